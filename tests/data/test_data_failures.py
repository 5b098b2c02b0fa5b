"""data/prepare.py when things go wrong: bad bytes are reported where they are, and nothing is left behind."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerotrain.data.prepare import Interrupted
from zerotrain.data.sources import first_invalid_utf8, iter_file_records
from zerotrain.data.tokenizer import train_sentencepiece
from zerotrain.errors import DataError

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "corpus" / "shakespeare_milton.txt"


def _records(path: Path) -> str:
    with pytest.raises(DataError) as failure:
        list(iter_file_records([path]))
    return str(failure.value)


def test_bad_byte_in_a_jsonl_is_reported_at_its_true_line_and_offset(tmp_path):
    # Lines of varying length with multi-byte characters: a read-ahead decoder fails chunks, not lines, ahead.
    lines = [json.dumps({"text": f"line {i} " + "é" * (i % 7)}, ensure_ascii=False).encode() + b"\n"
             for i in range(1, 6001)]
    lines[3999] = b'{"text": "a bad \xff byte"}\n'
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"".join(lines))
    offset = sum(map(len, lines[:3999])) + lines[3999].index(b"\xff")
    message = _records(path)
    assert f"{path}:4000: not UTF-8 (byte offset {offset:,}:" in message
    assert "convert the file to UTF-8" in message


def test_bad_byte_in_a_text_file_is_reported_at_its_true_offset(tmp_path):
    data = bytearray(CORPUS.read_bytes()[:200_000])
    data[82_870] = 0xE9  # a Latin-1 'é' where UTF-8 expects a lead or ASCII byte
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(data))
    line = data[:82_870].count(b"\n") + 1
    assert f"{path}:{line}: not UTF-8 (byte offset 82,870:" in _records(path)


@pytest.mark.parametrize("block", [1, 2, 3, 7, 4096])
def test_invalid_utf8_position_does_not_depend_on_the_read_size(tmp_path, block):
    path = tmp_path / "x.txt"
    path.write_bytes("héllo\nwörld\n".encode() + b"ab\xe2\x82" + b"\nend")  # a truncated 3-byte character
    assert first_invalid_utf8(path, block_bytes=block) == (3, 16, "invalid continuation byte")
    path.write_bytes("ok\n€".encode()[:-1])  # truncated at the end of the file
    assert first_invalid_utf8(path, block_bytes=block) == (2, 3, "unexpected end of data")
    path.write_bytes("fine €\n".encode())
    assert first_invalid_utf8(path, block_bytes=block) is None


def _start(tmp_path: Path, output: str) -> subprocess.Popen:
    # The whole corpus with tokenizer training takes a few seconds: long enough to be interrupted mid-way.
    return subprocess.Popen([sys.executable, str(REPO / "data" / "prepare.py"), f"input={CORPUS}",
                             f"output={output}", "tokenizer.train_vocab_size=2048", "progress=false"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def _wait_for_temp_dir(directory: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not _hidden(directory):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)


def test_sigterm_during_prepare_removes_the_partial_output(tmp_path):
    proc = _start(tmp_path, "prepared")
    _wait_for_temp_dir(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM; the partial output was removed" in stderr and "Traceback" not in stderr
    assert _hidden(tmp_path) == [] and not (tmp_path / "prepared").exists()


def test_temp_dir_left_by_sigkill_is_removed_by_the_next_run(tmp_path):
    proc = _start(tmp_path, "prepared")
    _wait_for_temp_dir(tmp_path, proc)
    proc.kill()  # no handler can run: the directory stays (the control for what the next run must clean)
    proc.communicate(timeout=60)
    assert _hidden(tmp_path), "SIGKILL cannot clean up; the next run must"
    again = _start(tmp_path, "prepared")
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert _hidden(tmp_path) == [] and (tmp_path / "prepared" / "manifest.json").is_file()


def _prepare(tmp_path: Path, output: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "data" / "prepare.py"), f"input={CORPUS}", f"output={output}",
                           "max_documents=5", "tokenizer.train_vocab_size=400", "progress=false"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_output_that_is_a_file_or_under_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "taken").write_text("not a directory")
    result = _prepare(tmp_path, "taken/prepared")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cannot create its parent directory taken" in result.stderr
    result = _prepare(tmp_path, "taken")
    assert result.returncode == 2 and "output=taken is an existing file" in result.stderr


def test_output_on_a_read_only_file_system_is_refused_clearly(tmp_path, read_only_dir):
    result = _prepare(tmp_path, "ro/prepared")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "output=ro/prepared: cannot write in ro (read-only file system)" in result.stderr


@pytest.mark.parametrize("content", ["", '{"text": "  "}\n{"text": ""}\n'], ids=["empty", "blank"])
def test_no_text_to_train_the_tokenizer_on_is_our_error_naming_the_input(tmp_path, content):
    from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, prepare

    path = tmp_path / "docs.jsonl"
    path.write_text(content)
    cfg = PrepareConfig(input=str(path), output=str(tmp_path / "out"), progress=False,
                        tokenizer=TokenizerArgs(train_vocab_size=300))
    with pytest.raises(DataError, match=rf"no text to train the tokenizer on in {path}: it has no document, or every "
                                        rf"document is blank or in the valid split\. Give input with text"):
        prepare(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"], "nothing may be left behind"


def test_one_line_of_text_is_enough_to_reach_sentencepiece(tmp_path):
    """The control: with text the check lets training through (sentencepiece's own limits then apply)."""
    from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, prepare

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "  "}\n' + json.dumps({"text": CORPUS.read_text()[:20_000]}) + "\n")
    cfg = PrepareConfig(input=str(path), output=str(tmp_path / "out"), progress=False, valid_fraction=0.0,
                        tokenizer=TokenizerArgs(train_vocab_size=400))
    assert prepare(cfg).manifest["tokenizer"]["vocab_size"] == 400


@pytest.mark.parametrize("raised", [Interrupted(signal.SIGTERM), DataError("input.jsonl line 3: not JSON")],
                         ids=["sigterm", "bad_input"])
def test_what_the_text_iterator_raises_during_tokenizer_training_comes_out_as_itself(tmp_path, raised):
    """sentencepiece turns an exception from its sentence iterator into RuntimeError("INTERNAL: ..."), which made a
    SIGTERM during tokenizer training exit 2 as "training ... failed" (found when the suite ran on two workers:
    the signal of test_sigterm_during_prepare_removes_the_partial_output landed in training)."""

    def texts():
        for i in range(2000):
            yield f"line {i} of a text that is long enough to train on, with words and more words {i % 37}"
        raise raised

    with pytest.raises(type(raised)) as caught:
        train_sentencepiece(texts(), tmp_path / "t.model", vocab_size=300)
    assert caught.value is raised


def test_control_sentencepiece_itself_wraps_what_its_iterator_raises():
    """Why the iterator is watched: called directly, sentencepiece reports the iterator's error as its own."""
    import sentencepiece as spm

    def sentences():
        yield "one line"
        raise Interrupted(signal.SIGTERM)

    with pytest.raises(RuntimeError, match="Interrupted"):
        spm.SentencePieceTrainer.train(sentence_iterator=sentences(), model_writer=io.BytesIO(), vocab_size=300)


def _signal_becomes(wrapper: type[BaseException] | None) -> None:
    """A SIGTERM to this process whose handler's exception the code it lands in turns into ``wrapper``, as a C
    extension's module initialisation does (``ImportError: initialization failed``), or swallows (None)."""
    try:
        signal.raise_signal(signal.SIGTERM)
    except BaseException as e:  # noqa: BLE001 -- what a library does to an exception it did not expect
        if wrapper is not None:
            raise wrapper("initialization failed") from e


@pytest.mark.parametrize("wrapper", [ImportError, RuntimeError, None], ids=["import_error", "runtime_error",
                                                                            "swallowed"])
def test_a_signal_the_code_it_lands_in_turns_into_another_error_still_ends_as_interrupted(wrapper):
    """On CI the SIGTERM of test_sigterm_during_prepare_removes_the_partial_output landed in ``import sentencepiece``,
    whose extension reported ``ImportError: initialization failed``: the run exited 1 with a traceback, not 143."""
    from zerotrain.data.prepare import _signals_raise

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as caught, _signals_raise():
        _signal_becomes(wrapper)
    assert caught.value.signum == signal.SIGTERM
    assert wrapper is None or isinstance(caught.value.__cause__, wrapper)
    assert signal.getsignal(signal.SIGTERM) is before


def test_control_without_a_signal_an_error_stays_itself_and_a_bare_raising_handler_loses_the_signal():
    from zerotrain.data.prepare import _signals_raise

    with pytest.raises(DataError), _signals_raise():
        raise DataError("input.jsonl line 3: not JSON")
    def bare(signum, frame):
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, bare)
    try:
        with pytest.raises(ImportError):  # what prepare did before: the signal's exit status was lost
            _signal_becomes(ImportError)
    finally:
        signal.signal(signal.SIGTERM, previous)

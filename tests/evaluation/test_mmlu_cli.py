"""The standalone script: one process in-process, two under torchrun, bad checkpoints."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from mmlu_testlib import MMLU_JSONL, REPO, tiny_export

from tools.launcher import run
from zerotrain.evaluation import NotAnHFExportError, resolve_checkpoint

SCRIPT = REPO / "evaluation" / "mmlu.py"
ARGS = ["--data", str(MMLU_JSONL), "--subjects", "anatomy", "marketing", "high_school_us_history",
        "--limit-per-subject", "3", "--shots", "2", "--batch-size", "2"]


def load_script():
    spec = importlib.util.spec_from_file_location("mmlu_cli_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_process_and_torchrun_two_processes_agree(tmp_path, capsys):
    one = tmp_path / "one.json"
    assert load_script().main(["--checkpoint", str(tiny_export()), *ARGS, "--output", str(one)]) == 0
    table = capsys.readouterr().out
    for line in ("overall (micro, over questions)", "stem", "humanities", "other", "anatomy",
                 "question(s) held out as few-shot examples", "skipped"):
        assert line in table

    two = tmp_path / "two.json"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(SCRIPT), "--checkpoint", str(tiny_export()), *ARGS, "--output", str(two)], timeout=300,
               check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stdout.count("overall (micro") == 1  # only rank 0 prints

    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert a["overall"]["micro"]["total"] + a["skipped"]["total"] == 9 and a["skipped"]["total"] > 0
    for key in ("overall", "categories", "subjects", "skipped", "held_out_for_fewshot", "max_length"):
        assert a[key] == b[key], key
    assert [q["prediction"] for q in a["questions"]] == [q["prediction"] for q in b["questions"]]
    torch.testing.assert_close(torch.tensor([q["loglikelihoods"] for q in a["questions"]]),
                               torch.tensor([q["loglikelihoods"] for q in b["questions"]]), rtol=0, atol=1e-5)


def test_bad_checkpoints_are_refused_with_guidance(tmp_path, capsys, caplog):
    assert resolve_checkpoint(tiny_export()) == tiny_export()
    with pytest.raises(NotAnHFExportError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    run_dir = tmp_path / "run"
    (run_dir / "global_step100").mkdir(parents=True)
    (run_dir / "latest").write_text("global_step100")
    with pytest.raises(NotAnHFExportError, match="DeepSpeed training checkpoint, not an HF export"):
        resolve_checkpoint(run_dir)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(NotAnHFExportError, match=r"not an HF export: missing weights .*, tokenizer files"):
        resolve_checkpoint(partial)
    assert load_script().main(["--checkpoint", str(run_dir), *ARGS]) == 2
    assert "NotAnHFExportError" in caplog.text


def test_bad_subject_exits_with_a_message(caplog):
    rc = load_script().main(["--checkpoint", str(tiny_export()), "--data", str(MMLU_JSONL),
                             "--subjects", "anatomyy"])
    assert rc == 2 and "Did you mean: anatomy" in caplog.text


def test_zero3_on_four_ranks_scores_as_one_process(tmp_path):
    """--zero3: the weights partitioned over 4 ranks (rank 0 reads them), the same scores as the plain model."""
    one, four = tmp_path / "one.json", tmp_path / "four.json"
    assert load_script().main(["--checkpoint", str(tiny_export()), *ARGS, "--output", str(one)]) == 0
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                str(SCRIPT), "--zero3", "--checkpoint", str(tiny_export()), *ARGS, "--output", str(four)],
               timeout=600, check=False)  # a rank running fewer forwards than the others would deadlock
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "partitioned over 4 ranks (25.0% of the weights on each)" in log, log[-3000:]
    a, b = json.loads(one.read_text()), json.loads(four.read_text())
    for key in ("overall", "categories", "subjects", "skipped", "held_out_for_fewshot", "max_length"):
        assert a[key] == b[key], key
    assert [q["prediction"] for q in a["questions"]] == [q["prediction"] for q in b["questions"]]
    torch.testing.assert_close(torch.tensor([q["loglikelihoods"] for q in a["questions"]]),
                               torch.tensor([q["loglikelihoods"] for q in b["questions"]]), rtol=0, atol=1e-5)

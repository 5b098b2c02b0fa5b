"""tools.compare on synthetic run directories: the table's numbers, the figure, resumed and diverged runs, the
parity check (--assert-equal), the W&B online conversion (a stand-in API) and clear errors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from compare_helpers import FakeApi, FakeHistoryRun, record, write_run

from tools import compare
from tools.compare import CompareError
from tools.launcher import run
from zerotrain.loggers import WANDB_STEP_KEY

STEPS = list(range(10, 101, 10))  # log_interval 10, 100 steps


def losses_down(step: int) -> float:
    return 3.0 - 0.01 * step


@pytest.fixture
def runs(tmp_path):
    """zero3 (2 s/step), hpz (1 s/step), stock (loss 0 at 30, NaN from 40), nan (NaN from 50), resumed (steps
    40-60 logged twice); each with a slow first (warm-up) window."""
    def rows(step_time, loss=losses_down, mfu=None):
        return [record(s, loss(s), step_time=(5 * step_time if s == 10 else step_time), mfu=mfu) for s in STEPS]

    stock = lambda s: losses_down(s) if s < 30 else (0.0 if s == 30 else math.nan)  # noqa: E731
    nan = lambda s: losses_down(s) if s < 50 else math.nan  # noqa: E731
    first = [record(s, losses_down(s)) for s in STEPS if s <= 60]
    second = [record(s, losses_down(s) - 0.5) for s in STEPS if s >= 40]  # restarted from the step-30 checkpoint
    return {
        "zero3": write_run(tmp_path / "g-zero3", rows(2.0, mfu=0.2), group="g"),
        "hpz": write_run(tmp_path / "g-hpz", rows(1.0, mfu=0.4), group="g"),
        "stock": write_run(tmp_path / "g-hpz-stock", rows(1.0, loss=stock), group="g"),
        "nan": write_run(tmp_path / "nan", rows(1.0, loss=nan)),
        "resumed": write_run(tmp_path / "resumed", first + second, group="other"),
    }


def load(path, name=None):
    return compare.load_run_dir(path, name=name)


def test_summary_table_numbers(runs):
    loaded = [load(runs[k], k) for k in ("zero3", "hpz", "stock", "nan", "resumed")]
    by_name = {s.name: s for s in compare.summarize(loaded, baseline="zero3")}

    zero3, hpz, stock, nan, resumed = (by_name[k] for k in ("zero3", "hpz", "stock", "nan", "resumed"))
    # Throughput leaves the slow first window out: 1000 tokens/step at 2 s/step and 1 s/step.
    assert zero3.tokens_per_s == pytest.approx(500) and hpz.tokens_per_s == pytest.approx(1000)
    assert hpz.relative == pytest.approx(2.0) and zero3.relative == pytest.approx(1.0)
    assert zero3.mfu == pytest.approx(0.2) and hpz.mfu == pytest.approx(0.4) and stock.mfu is None
    # Training time: 10 steps of the warm-up window (10 s each for zero3) + 90 steps.
    assert zero3.train_time_s == pytest.approx(10 * 10.0 + 90 * 2.0)
    assert hpz.train_time_s == pytest.approx(10 * 5.0 + 90 * 1.0)
    assert zero3.final_loss == pytest.approx(2.0) and zero3.last_step == 100 and zero3.logged == 10
    assert zero3.first_bad is None and hpz.first_bad is None
    assert stock.first_bad == (30, "zero") and math.isnan(stock.final_loss)
    assert nan.first_bad == (50, "NaN")
    assert resumed.replaced == 3 and resumed.final_loss == pytest.approx(2.0 - 0.5) and resumed.logged == 10

    table = compare.summary_markdown(list(by_name.values()), "zero3")
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "vs zero3" in lines["run"]
    assert "| 100 (10 logged) | 2.0000 |" in lines["zero3"] and "| 500 | 100.0% | 20.0% | 0:04:40 |" in lines["zero3"]
    assert "| 1,000 | 200.0% | 40.0% | 0:02:20 |" in lines["hpz"]
    assert "| 30 (zero) |" in lines["stock"] and "| nan |" in lines["stock"]
    assert "| 50 (NaN) |" in lines["nan"]
    assert "resumed (3 row(s))" in table


def test_throughput_is_total_tokens_over_total_time(tmp_path):
    # After the warm-up window: 10 steps at 1 s (1000 tok/s) and 30 steps at 3 s (333 tok/s): 40,000 tokens in
    # 100 s is 400 tok/s -- not the mean of the two rates (667).
    run = load(write_run(tmp_path / "r", [record(10, 2.0, 9.0), record(20, 1.9, 1.0), record(50, 1.8, 3.0)]))
    assert compare.mean_throughput(run) == pytest.approx(40_000 / 100)


def test_resumed_run_keeps_the_last_value_of_a_relogged_step(runs):
    run = load(runs["resumed"])
    assert run.steps == STEPS
    assert run.losses[:3] == [losses_down(s) for s in (10, 20, 30)]
    assert run.losses[3:] == [losses_down(s) - 0.5 for s in STEPS[3:]]


def test_figure_panels_png_and_divergence_marks(runs, tmp_path):
    loaded = [load(runs[k], k) for k in ("zero3", "hpz", "stock", "nan")]
    out = tmp_path / "plots" / "cmp.png"
    fig = compare.plot_runs(loaded, out, title="t")
    assert [ax.get_title() for ax in fig.axes] == [compare.PANEL_LOSS_STEP, compare.PANEL_LOSS_TIME,
                                                   compare.PANEL_TOKENS, compare.PANEL_MFU]
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000

    loss_ax = fig.axes[0]
    curves = {line.get_label(): line for line in loss_ax.lines if not line.get_label().startswith("_")}
    assert curves["nan (NaN at step 50)"].get_xdata().tolist() == [10, 20, 30, 40]  # drawn up to the divergence
    assert curves["stock (loss 0 at step 30)"].get_xdata().tolist() == [10, 20, 30]
    marks = [line for line in loss_ax.lines if line.get_marker() == "x"]
    assert sorted((float(m.get_xdata()[0]), float(m.get_ydata()[0])) for m in marks) == [
        (30.0, 0.0), (40.0, pytest.approx(losses_down(40)))]
    assert len(fig.axes[2].lines) == 4 and len(fig.axes[3].lines) == 2  # MFU: only runs that logged it


def test_panels_without_data_are_left_out(tmp_path):
    bare = write_run(tmp_path / "bare", [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)])
    fig = compare.plot_runs([load(bare)], tmp_path / "bare.png")
    assert [ax.get_title() for ax in fig.axes] == [compare.PANEL_LOSS_STEP]


def run_main(capsys, *argv):
    code = compare.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_assert_equal_exact_one_ulp_and_atol(tmp_path, capsys):
    base = [record(s, losses_down(s)) for s in STEPS]
    a = write_run(tmp_path / "a", base)
    b = write_run(tmp_path / "b", base)
    code, out = run_main(capsys, "--assert-equal", a, b)
    assert code == 0 and "OK: loss of a and b: bitwise equal on 10 common step(s)" in out

    bumped = [dict(r) for r in base]
    bumped[6]["loss"] = math.nextafter(bumped[6]["loss"], math.inf)  # one ulp at step 70
    c = write_run(tmp_path / "c", bumped)
    code, out = run_main(capsys, "--assert-equal", a, c)
    assert code == 1
    assert f"loss differs first at step 70: a={base[6]['loss']!r} c={bumped[6]['loss']!r}" in out
    code, out = run_main(capsys, "--assert-equal", a, c, "--atol", "1e-12")
    assert code == 0 and "within atol 1e-12" in out


def test_assert_equal_step_sets_and_nan(tmp_path, capsys):
    full = write_run(tmp_path / "full", [record(s, losses_down(s)) for s in STEPS])
    short = write_run(tmp_path / "short", [record(s, losses_down(s)) for s in STEPS[:6]])
    code, out = run_main(capsys, "--assert-equal", full, short)
    assert code == 1 and "only in full: 70, 80, 90, 100 (4 step(s))" in out
    code, out = run_main(capsys, "--assert-equal", full, short, "--common-steps-only")
    assert code == 0 and "6 common step(s)" in out
    # The same divergence at the same step is equal; NaN against a number is not.
    n1 = write_run(tmp_path / "n1", [record(10, 2.0), record(20, math.nan)])
    n2 = write_run(tmp_path / "n2", [record(10, 2.0), record(20, math.nan)])
    n3 = write_run(tmp_path / "n3", [record(10, 2.0), record(20, 1.5)])
    assert run_main(capsys, "--assert-equal", n1, n2)[0] == 0
    code, out = run_main(capsys, "--assert-equal", n1, n3)
    assert code == 1 and "step 20: n1=nan n3=1.5" in out


def test_clear_errors(tmp_path, capsys):
    code, out = run_main(capsys, tmp_path / "missing")
    assert code == 2 and "does not exist" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    code, out = run_main(capsys, empty)
    assert code == 2 and "metrics.jsonl is empty" in out
    (tmp_path / "notarun").mkdir()
    code, out = run_main(capsys, tmp_path / "notarun")
    assert code == 2 and "notarun: no metrics.jsonl" in out
    val_only = write_run(tmp_path / "val_only", [{"step": 10, "val/loss": 2.0}])
    code, out = run_main(capsys, val_only)
    assert code == 2 and "no training records" in out
    broken = write_run(tmp_path / "broken", [record(10, 2.0), record(20, 1.9)])
    text = (broken / "metrics.jsonl").read_text().splitlines()
    (broken / "metrics.jsonl").write_text(text[0] + "\n{oops\n" + text[1] + "\n")
    code, out = run_main(capsys, broken)
    assert code == 2 and "metrics.jsonl:2: not a JSON object" in out
    good = write_run(tmp_path / "good", [record(10, 2.0)])
    code, out = run_main(capsys, good, "--baseline", "nope", "-o", tmp_path / "x.png")
    assert code == 2 and "--baseline nope: no such run. Runs: good" in out


def test_truncated_last_line_is_skipped(tmp_path):
    run_dir = write_run(tmp_path / "r", [record(10, 2.0), record(20, 1.9)])
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 30, "loss": 1.')  # killed mid-write
    assert load(run_dir).steps == [10, 20]


def test_local_group_and_baseline_suffix(runs, tmp_path, capsys):
    table = tmp_path / "t.md"
    code, out = run_main(capsys, "--group", "g", "--runs-root", runs["zero3"].parent, "--baseline", "hpz-stock",
                         "-o", tmp_path / "g.png", "--table", table)
    assert code == 0, out
    names = [line.split("|")[1].strip() for line in table.read_text().splitlines()[2:] if line.startswith("| ")]
    assert names == ["g-hpz", "g-hpz-stock", "g-zero3"]  # 'nan' has no config, 'resumed' is in another group
    assert "vs g-hpz-stock" in out and (tmp_path / "g.png").stat().st_size > 0


def test_wandb_online_rows_go_through_the_same_conversion():
    def row(step, loss, **kw):  # as scan_history returns them: W&B's own keys, our step metric, NaN as a string
        return {"_step": kw.pop("_step", step), "_runtime": 1.0, "_timestamp": 1e9 + step, WANDB_STEP_KEY: step,
                "loss": loss, "step_time_s": 0.5, "tokens_per_s": 200.0, "mfu": None, **kw}

    rows = [row(1, 2.0), row(2, 1.5), {"_step": 3, WANDB_STEP_KEY: 2, "val/loss": 1.7}, row(3, "NaN"),
            row(2, 1.25, _step=4), row(3, 1.0, _step=5)]  # a restart from step 1: steps 2 and 3 re-logged
    api = FakeApi([FakeHistoryRun("zero3", rows), FakeHistoryRun("empty", [{"_step": 0, "x": 1}])])
    runs = compare.load_wandb_group("p", "g", entity="e", api=api)
    assert api.calls == [("e/p", {"group": "g"})]
    assert [r.name for r in runs] == ["zero3"]  # a run without training rows is skipped with a warning
    run = runs[0]
    assert run.steps == [1, 2, 3] and run.losses == [2.0, 1.25, 1.0] and run.replaced == 2
    assert run.val == [(2, 1.7)] and run.elapsed() == [0.5, 1.0, 1.5] and run.group == "g"
    with pytest.raises(CompareError, match="no W&B runs"):
        compare.load_wandb_group("p", "none", api=FakeApi([]))


# Both ways a user runs it, from outside the repository: the module, and the console script `pip install -e .` made.
COMMANDS = {"module": [sys.executable, "-m", "tools.compare"],
            "console-script": [str(Path(sys.executable).parent / "zerotrain-compare")]}


@pytest.mark.parametrize("how", sorted(COMMANDS))
def test_command_line(runs, tmp_path, how):
    command = COMMANDS[how]
    assert Path(command[0]).is_file(), f"{command[0]} missing: run .venv/bin/python -m pip install --no-deps -e ."
    out = tmp_path / "cli.png"
    proc = run([*command, f"zero3={runs['zero3']}", f"hpz={runs['hpz']}", "--baseline", "zero3", "-o", out],
               timeout=120, cwd=tmp_path)
    assert "| hpz | 100 (10 logged) |" in proc.stdout and "200.0%" in proc.stdout
    assert out.stat().st_size > 0

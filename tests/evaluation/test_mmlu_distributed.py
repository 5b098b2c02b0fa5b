"""4 processes under DeepSpeed ZeRO-3 + hpZ give the single-process result (one launch)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from mmlu_testlib import MAX_POSITIONS, MMLU_JSONL, ZERO3_CASES, load_tiny, tiny_export

from tools.launcher import run
from zerotrain.evaluation import evaluate, load_mmlu

WORLD = 4
WORKER = Path(__file__).with_name("mmlu_zero3_worker.py")


@pytest.fixture(scope="module")
def zero3_reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("zero3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           str(WORKER), str(tiny_export()), str(out)]
    proc = run(cmd, timeout=300, check=False)  # a padding bug would deadlock, not fail
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def single_process(case: dict):
    model, tokenizer = load_tiny()
    data = load_mmlu(MMLU_JSONL, subjects=case["subjects"], shots=case["shots"], limit_per_subject=case["limit"])
    return evaluate(model, tokenizer, data, batch_size=case["batch_size"], max_length=MAX_POSITIONS, device="cpu")


@pytest.mark.parametrize("name", sorted(ZERO3_CASES))
def test_zero3_hpz_four_ranks_equal_single_process(zero3_reports, name):
    reference = single_process(ZERO3_CASES[name]).to_dict()
    for report in zero3_reports:
        assert report["world"] == WORLD
        case = report["cases"][name]
        assert case["rng_restored"] and case["train_mode_restored"], f"rank {report['rank']}"
        got = case["result"]
        assert [q["index"] for q in got["questions"]] == [q["index"] for q in reference["questions"]]
        assert [q["prediction"] for q in got["questions"]] == [q["prediction"] for q in reference["questions"]]
        torch.testing.assert_close(
            torch.tensor([q["loglikelihoods"] for q in got["questions"]]),
            torch.tensor([q["loglikelihoods"] for q in reference["questions"]]),
            rtol=0, atol=1e-5,
        )
        for key in ("overall", "categories", "subjects", "held_out_for_fewshot", "skipped"):
            assert got[key] == reference[key], key


def test_hpz_was_active(zero3_reports):
    for report in zero3_reports:
        assert report["hpz_secondary_partitions"] == report["parameters"] > 0


def test_every_rank_gets_the_same_result(zero3_reports):
    first = zero3_reports[0]["cases"]
    for report in zero3_reports[1:]:
        assert report["cases"] == first

"""benchmarks/gpu_check.py without a GPU: the skipped table and JSON, its arithmetic, and its DeepSpeed plumbing.

The GPU results themselves need a GPU. What the CPU can check: the command a GPU user runs prints one table with
every row skipped and exits 0; the MFU arithmetic, the model-size rule and the verdicts are right; and every
section's code runs against DeepSpeed 0.19.8's real ZeRO-3 machinery on the CPU accelerator (tiny shapes, where
nothing can race), reading the hpZ shards through DeepSpeed's gather in every arm.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tools.launcher import PYTHON, REPO, run
from zerotrain import hpz, metrics

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
GIB = 2**30


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


gc = _load_script()


# --------------------------------------------------------------------------- the command without a GPU


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = run([PYTHON, str(SCRIPT), "--out", str(out)], timeout=300, check=False)
    return proc, json.loads((out / "gpu_check.json").read_text()), out


def test_cpu_run_prints_one_table_of_skipped_rows_and_exits_0(cpu_run):
    proc, _, _ = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected_rows = (len(hpz.MODES) + 1) * 2 + len(gc.arms("stall", hpz.MODES)) + len(gc.TRAIN_MEASURES)
    table = [ln for ln in proc.stdout.splitlines() if ln.split()[:1] and ln.split()[0] in gc.SECTIONS]
    assert len(table) == expected_rows
    assert all("no GPU: skipped" in ln and ln.rstrip().endswith("SKIPPED") for ln in table)
    assert "CPU-only build" in proc.stdout and "needs: one NVIDIA GPU" in proc.stdout
    assert "nothing was checked" in proc.stdout
    stock = next(ln for ln in table if ln.split()[:2] == ["race", "stock"])
    assert "> 0 (racy)" in stock  # the expected GPU outcome is shown even when skipped


def test_cpu_run_writes_json_with_every_row_skipped_and_why(cpu_run):
    _, result, out = cpu_run
    assert result["ok"] is True and result["checked"] is False
    assert result["device"]["torch_cuda"] is None and "CPU-only" in result["device"]["reason"]
    assert result["device"]["modes"] == list(hpz.MODES)
    assert set(result["sections"]) == set(gc.SECTIONS)
    assert {r["verdict"] for r in result["rows"]} == {"SKIPPED"}
    assert all("CPU-only" in r["data"]["reason"] for r in result["rows"])
    assert [r["arm"] for r in result["rows"] if r["section"] == "race"] == list(hpz.MODES) + ["deepspeed"]
    for section in gc.SECTIONS:  # each section's own files, written as it ended
        own = json.loads((out / f"{section}.json").read_text())
        assert own["rows"] == [r for r in result["rows"] if r["section"] == section]
        assert "| section | arm |" in (out / f"{section}.md").read_text()
    assert (out / "gpu_check.md").read_text().count("SKIPPED") == len(result["rows"])


def test_each_section_fits_4_minutes_the_check_two_5_minute_calls_and_quick_2_minutes():
    full, quick = ({s: b[i] for s, b in gc.BUDGET_S.items()} for i in (0, 1))
    assert max(full.values()) <= 240
    first = full["probe"] + full["race"] + full["record_stream"] + full["stall"]
    assert first <= 270 and full["probe"] + full["train"] <= 270  # each call: 30 s left for start and install
    assert sum(quick.values()) <= 120


def test_unknown_section_is_refused_naming_the_valid_ones(tmp_path):
    proc = run([PYTHON, str(SCRIPT), "--sections", "race,racing", "--json", str(tmp_path / "x.json")],
                       timeout=120, check=False)
    assert proc.returncode == 2
    assert "racing" in proc.stderr and "race,record_stream,stall,train" in proc.stderr
    assert not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------- arithmetic and rules


def test_llama2_7b_parameter_counts_match_the_hugging_face_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    s = gc.LLAMA2_7B
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    total, largest = gc.llama_params(s["layers"])
    assert total == sum(p.numel() for p in model.parameters()) == 6_738_415_616
    assert largest == s["vocab"] * s["hidden"]
    assert metrics.matmul_params(model) == total - largest == 6_607_343_616


def test_throughput_and_mfu_of_a_llama2_7b_step():
    flops = metrics.flops_per_token(6_607_343_616, 32, 4096, 4096)  # 6N + 12 L d T
    assert flops == 46_086_512_640
    t = gc.throughput(tokens=8192, seconds=2.0, flops_per_token=flops, peak_tflops=989.0)
    assert t["tokens_per_s"] == 4096.0
    assert t["tflops"] == pytest.approx(4096 * flops / 1e12)
    assert t["mfu"] == pytest.approx(t["tflops"] / 989.0) and 0.19 < t["mfu"] < 0.20
    assert gc.throughput(8192, 2.0, flops, None)["mfu"] is None


@pytest.mark.parametrize("device_gib, layers", [(139.7, 32), (79.2, 18), (39.4, 6), (23.6, 2), (16.0, None)])
def test_training_size_is_full_llama2_7b_only_where_it_fits(device_gib, layers):
    device = int(device_gib * GIB)
    shape = gc.choose_train_shape(device, quick=False)
    if layers is None:
        assert shape is None
        return
    assert (shape.layers, shape.full, shape.micro_batch, shape.seq_len) == (layers, layers == 32, 2, 4096)
    assert shape.estimate_bytes <= device  # it fits, and one more layer would not
    if layers < 32:
        assert gc.train_memory_estimate(layers + 1, 2, 4096) > device
    assert "full" in shape.describe() if shape.full else f"reduced to {layers}/32 layers" in shape.describe()


def test_train_layers_override_the_size_rule():
    shape = gc.choose_train_shape(int(139.7 * GIB), quick=False, layers=24)
    assert (shape.layers, shape.full) == (24, False)
    assert shape.estimate_bytes == gc.train_memory_estimate(24, 2, 4096)
    with pytest.raises(SystemExit):
        gc.parse_args(["--train-layers", "33"])
    assert gc.parse_args(["--train-layers", "2"]).train_layers == 2


def test_quick_training_is_at_most_4_layers_of_2048_tokens():
    shape = gc.choose_train_shape(int(139.7 * GIB), quick=True)
    assert (shape.layers, shape.micro_batch, shape.seq_len, shape.full) == (4, 1, 2048, False)


def test_memory_estimate_covers_deepspeeds_real_model_states():
    # DeepSpeed 0.19.8 holds 16 bytes per parameter (bf16 weight and gradient, fp32 master, two Adam moments).
    for layers in (2, 18, 32):
        assert gc.train_memory_estimate(layers, 2, 4096) > 16 * gc.llama_params(layers)[0] + 5 * GIB


def test_memory_plan_prediction_is_the_plan_of_the_benchmarked_shape():
    from zerotrain import memory_plan, run_config

    shape = gc.choose_train_shape(int(139.7 * GIB), quick=False)
    value, note = gc.memory_plan_prediction(shape)
    assert value is not None and note.startswith(f"{value:.1f} GiB")
    # Model states on one GPU are DeepSpeed's estimator for the exact 7B count (4 x embedding + 18 P), P counted
    # on the meta device (gc.llama_params is the same shape's closed form).
    total, largest = gc.llama_params(shape.layers)
    states = 4 * largest + 18 * total
    assert 0 < value * GIB - states < 60 * GIB  # + checkpointed activations, logits, buffers, reserve
    cfg = run_config.Config()
    cfg.model.num_layers = shape.layers
    assert memory_plan.count_parameters(cfg.model).total == total  # the plan's model is the benchmarked one


def test_arms_follow_hpz_modes():
    modes = ("stock", "sync", "ordered", "legacy")
    assert gc.arms("race", modes) == ["stock", "sync", "ordered", "legacy", "deepspeed"]
    assert gc.arms("stall", modes) == ["sync", "ordered", "deepspeed"]  # racy modes are not worth timing


def _race_arm(arm, poisoned, wrong=None, shards=9, reps=5, read=None, allocations=None):
    return {"arm": arm, "reps": reps, "elements_read": 1000, "poisoned_read": poisoned,
            "wrong_read": poisoned if wrong is None else wrong, "shards_built": reps * shards,
            "poisoned_allocations": reps * shards if allocations is None else allocations,
            "shards_read": reps * shards if read is None else read}


def test_race_verdicts():
    def verdicts(arms, streams=True):
        return [r["verdict"] for r in gc.race_rows({"arms": arms, "has_streams": streams})]

    assert verdicts([_race_arm("stock", 1000), _race_arm("sync", 0), _race_arm("deepspeed", 0)]) == ["PASS"] * 3
    assert verdicts([_race_arm("stock", 0)]) == ["INCONCLUSIVE"]  # the race not reproduced proves nothing
    assert verdicts([_race_arm("ordered", 3), _race_arm("sync", 0, wrong=1)]) == ["FAIL", "FAIL"]
    assert verdicts([_race_arm("ordered", 0, read=0), _race_arm("sync", 0, allocations=44)]) == ["ERROR", "ERROR"]
    assert verdicts([_race_arm("stock", 0)], streams=False) == ["INFO"]


def _rs_arm(arm, recycled, poisoned, record_streams=0, read=9):
    return {"arm": arm, "shards": 9, "shards_read": read, "recycled": recycled, "elements_read": 100,
            "poisoned_read": poisoned, "wrong_read": poisoned, "record_streams": record_streams}


def test_record_stream_verdicts_need_the_negative_control():
    def verdicts(arms):
        return [r["verdict"] for r in gc.record_stream_rows({"arms": arms, "has_streams": True})]

    control = _rs_arm("sync", 9, 100)
    assert verdicts([control, _rs_arm("ordered", 0, 0, record_streams=9)]) == ["INFO", "PASS"]
    assert verdicts([_rs_arm("sync", 0, 0), _rs_arm("ordered", 0, 0, record_streams=9)]) == ["INFO", "INCONCLUSIVE"]
    assert verdicts([control, _rs_arm("ordered", 2, 20, record_streams=9)]) == ["INFO", "FAIL"]
    assert verdicts([_rs_arm("ordered", 0, 0, record_streams=9, read=0)]) == ["ERROR"]


def _stall_arm(arm, release_ms, syncs, bytes_ok=True, read=72):
    return {"arm": arm, "steps": 10, "release_ms": release_ms, "fetch_ms": 1.0, "step_ms": 60.0, "step_ms_min": 59.0,
            "host_syncs_per_step": syncs, "waits_per_step": 0 if syncs else 72, "shard_copies_per_step": 72,
            "shards_read_per_step": read, "bytes_ok": bytes_ok}


def test_stall_verdicts():
    def verdicts(arms):
        return [r["verdict"] for r in gc.stall_rows({"arms": arms, "has_streams": True})]

    sync, deepspeed = _stall_arm("sync", 50.0, 72), _stall_arm("deepspeed", 50.0, None)
    assert verdicts([sync, _stall_arm("ordered", 2.0, 0), deepspeed]) == ["PASS", "PASS", "PASS"]
    assert verdicts([sync, _stall_arm("ordered", 2.0, 1)]) == ["PASS", "FAIL"]  # a host sync in ordered
    assert verdicts([sync, _stall_arm("ordered", 60.0, 0)]) == ["PASS", "FAIL"]  # stalls more than sync
    assert verdicts([_stall_arm("sync", 50.0, 72, bytes_ok=False), _stall_arm("ordered", 2.0, 0, read=0)]) == \
        ["FAIL", "ERROR"]


def test_train_rows_report_throughput_mfu_memory_and_the_plan_slot():
    shape = gc.TrainShape(32, 2, 4096, True, 130 * GIB)
    flops = metrics.flops_per_token(6_607_343_616, 32, 4096, 4096)
    raw = {"shape": shape.__dict__, "warmup": 3, "steps": 10, "seconds": 20.0, "tokens": 81920,
           "losses": [10.4, 10.3], "flops_per_token": flops, "peak_tflops": 989.0, "peak_allocated": 115 * GIB,
           "peak_reserved": 120 * GIB, "device_total": 140 * GIB, "plan": [None, "n/a: not yet"]}
    rows = {r["measure"]: r for r in gc.train_rows(raw)}
    assert list(rows) == list(gc.TRAIN_MEASURES)
    assert rows["tokens/s"]["verdict"] == "PASS" and rows["tokens/s"]["result"].startswith("4,096 (full")
    assert rows["MFU, one GPU"]["result"].startswith("19.1% of 989") and "one GPU" in rows["MFU, one GPU"]["result"]
    assert rows["peak memory, one GPU"]["result"].startswith("115.0 GiB allocated")
    assert rows["peak memory, one GPU"]["result"].endswith("memory plan for this shape: n/a: not yet")
    assert rows["memory plan prediction"]["result"] == "n/a: not yet"
    assert gc.train_rows({**raw, "losses": [10.4, float("nan")]})[0]["verdict"] == "FAIL"
    assert gc.train_rows({**raw, "activation_checkpointing": False})[0]["verdict"] == "FAIL"


# --------------------------------------------------------------------------- the sections' code on the CPU


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``--dry-run``: every section end to end on the CPU, tiny shapes; race, record_stream and stall on the emulated
    asynchronous accelerator, train on DeepSpeed's CPU accelerator; one process each, as on a GPU."""
    out = tmp_path_factory.mktemp("gpu_check_dry")
    proc = run([PYTHON, str(SCRIPT), "--dry-run", "--out", str(out)], timeout=1200, check=False)
    summary = json.loads((out / "gpu_check.json").read_text())
    return proc, summary, {s: json.loads((out / f"{s}.json").read_text())["raw"] for s in gc.SECTIONS}


@pytest.fixture(scope="module")
def tiny_sections(dry_run):
    return dry_run[2]


def test_dry_run_runs_every_section_and_passes(dry_run):
    proc, summary, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert summary["dry_run"] and summary["ok"] and summary["checked"]
    assert "--dry-run" in summary["title"] and "emulated" in summary["title"]
    assert {r["verdict"] for r in summary["rows"]} <= {"PASS", "INFO"}
    for section, info in summary["sections"].items():
        assert info["error"] is None and info["skipped"] is None and info["elapsed_s"] < info["budget_s"], section


def test_race_harness_reads_every_poisoned_shard_through_deepspeeds_gather(tiny_sections):
    raw = tiny_sections["race"]
    assert raw["has_streams"] is True and raw["emulated"] is True
    assert [a["arm"] for a in raw["arms"]] == list(hpz.MODES) + ["deepspeed"]
    for arm in raw["arms"]:
        assert arm["poisoned_allocations"] == arm["shards_built"] == arm["shards_read"] == 5 * 9, arm
        assert arm["elements_read"] > 0, arm
        racy = arm["arm"] in gc.RACY_MODES  # emulated streams: an unordered read sees the poison, every element
        assert arm["poisoned_read"] == arm["wrong_read"] == (arm["elements_read"] if racy else 0), arm
    counters = {a["arm"]: a["counters"] for a in raw["arms"]}
    assert counters["deepspeed"] is None
    assert counters["stock"]["unordered_copies"] == 45
    assert counters["sync"]["host_syncs"] == 45 and counters["sync"]["waits_issued"] == 0
    assert counters["ordered"]["host_syncs"] == 0 and counters["ordered"]["waits_issued"] == 45
    assert counters["ordered"]["record_streams"] == 45
    assert {r["verdict"] for r in gc.race_rows(raw)} == {"PASS"}


def test_record_stream_harness_frees_shards_with_their_gather_queued(tiny_sections):
    raw = tiny_sections["record_stream"]
    for arm in raw["arms"]:
        assert arm["shards_read"] == arm["shards"] == 9 and arm["wrong_read"] == 0, arm
    record_streams = {a["arm"]: a["record_streams"] for a in raw["arms"]}
    assert record_streams == {m: 0 for m in hpz.MODES if m != "ordered"} | {"ordered": 9, "deepspeed": 0}
    # The emulator has no caching allocator: a recycled block proves nothing there, so no verdict but INFO.
    assert {r["verdict"] for r in gc.record_stream_rows(raw)} == {"INFO"}


def test_stall_harness_gathers_exact_bytes_from_shards_in_every_arm(tiny_sections):
    raw = tiny_sections["stall"]
    assert [a["arm"] for a in raw["arms"]] == gc.arms("stall", hpz.MODES)
    for arm in raw["arms"]:
        assert arm["bytes_ok"] and arm["shards_read_per_step"] == arm["shard_copies_per_step"] == 18, arm
        assert arm["steps"] == 3 and arm["step_ms"] > 0
    by_arm = {a["arm"]: a for a in raw["arms"]}
    # As on a GPU: one host sync per shard copy for sync, one wait and no host sync for ordered.
    assert by_arm["sync"]["host_syncs_per_step"] == 18 and by_arm["sync"]["waits_per_step"] == 0
    assert by_arm["ordered"]["host_syncs_per_step"] == 0 and by_arm["ordered"]["waits_per_step"] == 18
    assert raw["compute_ms"] > 0  # the GEMMs alone, each arm's step time is compared with
    rows = {r["arm"]: r for r in gc.stall_rows(raw)}
    assert "GEMMs alone" in rows["sync"]["result"] and "host blocked" in rows["ordered"]["result"]


def test_train_step_runs_zero3_with_fused_adamw_and_counts_flops(tiny_sections):
    raw = tiny_sections["train"]
    assert raw["steps"] == 2 and raw["tokens"] == 2 * 2 * gc.TINY["seq"]
    assert all(0 < x < 20 for x in raw["losses"])  # finite (NaN fails every comparison)
    s = gc.TINY
    total, embedding = gc.llama_params(s["layers"], s)
    assert raw["flops_per_token"] == metrics.flops_per_token(total - embedding, s["layers"], s["hidden"], s["seq"])
    assert raw["activation_checkpointing"] is True
    assert raw["peak_tflops"] is None and raw["plan"][0] is None
    assert gc.train_rows(raw)[0]["verdict"] == "PASS"


CONTROLS = """
import argparse, json
import gpu_check as gc
from zerotrain import hpz

opts = argparse.Namespace(tiny=True, quick=True, modes=list(hpz.MODES))
results = {{}}


class CopyNotLanded(gc.PoisonFreshShards):
    # What a GPU shows when the gather overtakes the copy: the shard still holds its poison when it is read.
    def __exit__(self, *exc):
        super().__exit__(*exc)
        for ref in self.fresh:
            ref().fill_(float("nan"))


real = gc.PoisonFreshShards
gc.PoisonFreshShards = CopyNotLanded
results["copy_not_landed"] = gc.race_section(opts)
gc.PoisonFreshShards = real
gc.serve_shards_in_a_world_of_one = lambda param: None  # DeepSpeed's own all_gather_coalesced: world-of-one shortcut
results["no_wrapper"] = gc.race_section(opts)
json.dump(results, open({out!r}, "w"))
"""


def test_race_check_counts_poison_that_deepspeed_gathers_and_errors_when_no_shard_is_read(tmp_path):
    out = tmp_path / "controls.json"
    script = tmp_path / "controls.py"
    script.write_text(CONTROLS.format(out=str(out)))
    run([PYTHON, str(script)], timeout=600, env={"PYTHONPATH": str(REPO / "benchmarks")})  # gpu_check importable
    results = json.loads(out.read_text())
    for arm in results["copy_not_landed"]["arms"]:  # every element DeepSpeed gathered from a poisoned shard is seen
        assert arm["shards_read"] == arm["shards_built"] and arm["poisoned_read"] == arm["elements_read"] > 0, arm
    no_wrapper = results["no_wrapper"]
    assert all(a["shards_read"] == 0 and a["poisoned_read"] == 0 for a in no_wrapper["arms"])
    rows = gc.race_rows({**no_wrapper, "has_streams": True})  # on a GPU this would otherwise read "0: PASS"
    assert {r["verdict"] for r in rows} == {"ERROR"}
    assert all("DeepSpeed's gather read 0 of" in r["result"] for r in rows)

"""End to end on 4 CPU processes through real DeepSpeed ZeRO-3 (gloo): training, exact resume, export, failures.

Launches are expensive (~15-20 s each before the first step on 2 cores), so the module-scoped fixtures share them:
one 4-rank launch trains tiny Llama (probed), tiny Falcon and tiny Llama-3 in turn (``pretrained``); the exact
resume is two launches of train.py (``resumed``: the relaunch is what it tests); one 2-rank launch fine-tunes from
two of those exports (``fine_tuned``); the single-process failures run in one process (``failures``,
tests/workers/train_py_cases.py: train.py's ``main`` per case).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from chat_templates import LLAMA3_CHAT_TEMPLATE
from tools.launcher import PYTHON, REPO, run, torchrun

STEPS = 16
COMMON = ["recipe=tiny_llama", f"train.steps={STEPS}", "train.log_interval=1", "train.eval_interval=8",
          "train.eval_batches=2", "schedule.warmup_steps=4", "optim.lr=3e-3", "checkpoint.interval=0",
          "wandb.mode=offline"]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


MMLU_HOOK = ["mmlu.enabled=true", "mmlu.interval=8", "mmlu.limit_per_subject=3", "mmlu.shots=2",
             "mmlu.subjects=[astronomy,marketing,world_religions]", "mmlu.batch_size=4"]
# Steps 3 and 4 traced by torch.profiler (one window, saved at step 4), rank 0's trace logged to W&B.
PROFILE = ["profile.enabled=true", "profile.steps=[3,4]", "profile.wandb_artifact=true"]


FALCON = ["recipe=tiny_falcon", "train.steps=12", "train.log_interval=1", "train.precision=bf16",
          "schedule.warmup_steps=3", "optim.lr=3e-3", "train.eval_interval=0", "checkpoint.save_final=false",
          "wandb.enabled=false", "run.name=falcon"]
LLAMA3 = ["recipe=tiny_llama3", "train.steps=12", "train.log_interval=1", "schedule.warmup_steps=3", "optim.lr=3e-3",
          "train.eval_interval=0", "checkpoint.interval=0", "checkpoint.export_hf=true", "wandb.enabled=false",
          "run.name=llama3"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, shakespeare) -> dict[str, Path]:
    """ONE 4-rank launch (tests/workers/train_and_probe.py), three runs in turn: ``full``, tiny Llama, hpZ 2, 16 steps
    in one go with the MMLU hook every 8 steps and steps 3-4 profiled, exported to Hugging Face, engine logits
    probed; ``falcon``, tiny Falcon in bf16, 12 steps; ``llama3``, recipes/tiny_llama3 on data prepared with a
    trained Llama-3-style tokenizer, 12 steps, exported."""
    out = tmp_path_factory.mktemp("runs")
    probe, llama3_data = out / "probe.pt", out / "shakespeare_llama3"
    run([PYTHON, "data/prepare.py", "input=data/corpus/shakespeare_milton.txt", f"output={llama3_data}",
         "tokenizer.train_kind=llama3", "tokenizer.train_vocab_size=2048", "valid_fraction=0.02", "progress=false"],
        timeout=600)
    full = [*COMMON, *MMLU_HOOK, *PROFILE, f"run.output_dir={out}", "run.name=full", f"data.train.0.path={shakespeare}",
            "checkpoint.export_hf=true"]
    falcon = [*FALCON, f"run.output_dir={out}", f"data.train.0.path={shakespeare}"]
    llama3 = [*LLAMA3, f"run.output_dir={out}", f"data.train.0.path={llama3_data}"]
    torchrun(4, "tests/workers/train_and_probe.py", str(probe), *(" ".join(r) for r in (full, falcon, llama3)),
             timeout=1500)
    return {"full": out / "full", "probe": probe, "falcon": out / "falcon", "llama3": out / "llama3"}


@pytest.fixture(scope="module")
def uninterrupted(pretrained) -> tuple[Path, Path]:
    """The tiny Llama run of ``pretrained`` and its probe."""
    return pretrained["full"], pretrained["probe"]


RESUMED_LOG_INTERVAL = 3  # does not divide the stop step (8): the line of step 9 averages steps 7-9 of two launches


def windowed(curve: dict[int, float], interval: int, last: int) -> dict[int, float]:
    """The logged losses of a run with ``train.log_interval=interval`` from every step's loss ``curve``, averaged
    the way the trainer does (same order, same arithmetic: bitwise the same floats)."""
    out, window = {}, []
    for step in range(1, last + 1):
        window.append(curve[step])
        if step % interval == 0 or step == last:
            out[step], window = sum(window) / len(window), []
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, shakespeare):
    """The same run through train.py, stopped after step 8 (checkpoint, exit) and relaunched with the same command;
    logging every 3 steps, with communication accounting on (it must not change training either)."""
    out = tmp_path_factory.mktemp("runs")
    args = [*COMMON, f"run.output_dir={out}", "run.name=resumed", f"data.train.0.path={shakespeare}",
            "train.exit_interval=8", "comm.accounting=true", f"train.log_interval={RESUMED_LOG_INTERVAL}"]
    first = torchrun(4, "train.py", *args, timeout=900)
    after_first = losses(out / "resumed")
    second = torchrun(4, "train.py", *args, timeout=900)
    return out / "resumed", after_first, first.stdout + first.stderr, second.stdout + second.stderr


def test_tiny_llama_loss_falls_on_4_processes_under_zero3_hpz(uninterrupted):
    run_dir, _ = uninterrupted
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, STEPS + 1))
    first, last = sum(curve[s] for s in (1, 2, 3)) / 3, sum(curve[s] for s in (14, 15, 16)) / 3
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0 for r in train)
    assert train[-1]["tokens"] == STEPS * 4 * 128 * 4  # steps x micro-batch x seq_len x ranks
    assert train[-1]["hpz/shards_read"] > 0 and train[-1]["hpz/host_syncs"] == 0  # hpZ really ran, ordered mode
    assert [r["step"] for r in records if "val/loss" in r] == [8, 16]


def test_every_line_says_where_the_step_time_went(uninterrupted, resumed):
    for run_dir in (uninterrupted[0], resumed[0]):
        train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        for r in train:
            shares = {k: r[k] for k in ("time/forward_share", "time/backward_share", "time/optimizer_share",
                                        "time/comm_wait_share")}
            assert all(0 <= v <= 1 for v in shares.values()) and sum(shares.values()) <= 1 + 1e-6, (r["step"], shares)
            assert shares["time/forward_share"] > 0 and shares["time/backward_share"] > 0, (r["step"], shares)
        # 4 gloo ranks on one host: ZeRO-3's all-gathers and reduce-scatters block each step for a while.
        assert sum(r["time/comm_wait_share"] for r in train) / len(train) > 0.01, [r["time/comm_wait_share"]
                                                                                 for r in train]


def test_profiled_steps_leave_one_trace_per_rank_with_the_zero3_gathers_and_hpz_shard_copies(uninterrupted,
                                                                                                resumed):
    run_dir = uninterrupted[0]
    traces = sorted((run_dir / "profile").rglob("*.json"))
    assert [p.relative_to(run_dir / "profile").as_posix() for p in traces] == [
        f"step_4/rank_{r}.json" for r in range(4)]
    for path in traces:
        events = json.loads(path.read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert "c10d::_allgather_base_" in names and "gloo:all_gather" in names, path  # ZeRO-3's parameter gathers
        assert "c10d::_reduce_scatter_base_" in names, path  # its gradient reduce-scatter
        assert "zerotrain/hpz/shard_copy" in names, path  # hpZ's secondary shards, rebuilt after each step
        steps = [e for e in events if e.get("name") in ("zerotrain/forward", "zerotrain/backward")]
        assert len(steps) == 2 * 2, path  # two traced steps, one micro-batch each
    wandb_records = b"".join(p.read_bytes() for p in (run_dir / "wandb").glob("offline-run-*/*.wandb"))
    assert b"trace-step_4" in wandb_records and b"rank_0.json" in wandb_records  # rank 0's trace as an artifact
    # The control: the resumed run, profile section left off, writes nothing there.
    assert not (resumed[0] / "profile").exists()


def test_step_callbacks_see_every_step_once_in_order_with_the_logged_loss(uninterrupted):
    run_dir, probe_path = uninterrupted
    events = torch.load(probe_path)["step_events"]
    # Before step s the trainer has done s-1 steps; after it, s. log_interval=1: each step's loss is a logged line.
    assert [e[:3] for e in events] == [e for s in range(1, STEPS + 1) for e in (("begin", s, s - 1), ("end", s, s))]
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "loss" in r}
    assert all(e[3] == records[e[1]]["loss"] and e[4] == records[e[1]]["lr"] and e[5] for e in events[1::2])


def test_run_directory_holds_resolved_config_deepspeed_config_and_tokenizer(uninterrupted, shakespeare):
    run_dir, _ = uninterrupted
    saved = (run_dir / "config.yaml").read_text()
    assert "steps: 16" in saved and "recipe: tiny_llama" in saved
    ds = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert ds["train_batch_size"] == 4 * 1 * 4
    tokenizer = "tokenizer/tokenizer.model"  # copied by rank 0, what the exports ship (tests/test_export.py)
    assert (run_dir / tokenizer).read_bytes() == (shakespeare / tokenizer).read_bytes()


def test_resume_continues_the_loss_curve_exactly(uninterrupted, resumed):
    run_dir, after_first, first_log, second_log = resumed
    assert sorted(after_first) == [3, 6], "the first launch must stop at train.exit_interval, after step 8"
    assert "resumed from" in second_log
    every_step = losses(uninterrupted[0])
    expected = windowed(every_step, RESUMED_LOG_INTERVAL, STEPS)
    # Bitwise: the same floats at every logged step, including step 9, whose window (7-9) spans the restart.
    assert losses(run_dir) == expected
    # The control: without the saved window, step 9's line averaged only step 9.
    assert expected[9] != every_step[9]


def test_deepspeeds_deprecated_collective_warnings_are_silenced(resumed):
    _, _, first_log, second_log = resumed
    for text in (first_log, second_log):
        assert "Please use `torch.distributed.all_gather_single` instead" not in text
        assert "`torch.distributed.reduce_scatter_tensor` is deprecated" not in text
        assert "FutureWarning" not in text, [line for line in text.splitlines() if "FutureWarning" in line][:3]


def test_mmlu_hook_logs_scores_and_does_not_change_training(uninterrupted, resumed):
    records = [json.loads(line) for line in (uninterrupted[0] / "metrics.jsonl").read_text().splitlines()]
    mmlu = [r for r in records if "mmlu/acc" in r]
    assert [r["step"] for r in mmlu] == [8, 16]
    assert all(r["mmlu/questions"] == 3 * 3 for r in mmlu)  # 3 scored per subject (after 2 held out as shots)
    assert all(0.0 <= r["mmlu/acc"] <= 1.0 and "mmlu/acc_macro" in r and "mmlu/stem" in r for r in mmlu)
    # The uninterrupted run evaluated MMLU twice, the resumed one never: the training losses are the same floats.
    assert windowed(losses(uninterrupted[0]), RESUMED_LOG_INTERVAL, STEPS) == losses(resumed[0])


def test_communication_accounting_is_logged_per_step(resumed):
    records = [json.loads(line) for line in (resumed[0] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    # One host: every byte stays inside the node; the parameter all-gathers and gradient reduce-scatters are counted.
    assert all(r["comm/inter_node_bytes"] == 0 and r["comm/intra_node_bytes"] > 0 for r in train)
    assert all(r["comm/all_gather/intra_node_bytes"] > 0 and r["comm/reduce_scatter/intra_node_bytes"] > 0
               for r in train)


def test_resumed_run_continues_the_same_wandb_run(resumed):
    run_dir = resumed[0]
    offline_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2, "one offline segment per launch"
    assert len({p.name.rsplit("-", 1)[1] for p in offline_runs}) == 1, "both launches must log to one W&B run id"
    meta = json.loads((run_dir / "checkpoints" / "step_00000016" / "zerotrain" / "meta.json").read_text())
    assert offline_runs[0].name.endswith(meta["wandb_run_id"])


def test_keep_last_prunes_old_checkpoints_and_latest_points_at_the_newest(resumed):
    ckpts = resumed[0] / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000016"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000008", "step_00000016"]  # keep_last=2


def test_hf_export_reloads_in_transformers_with_the_same_logits(uninterrupted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerotrain.data.tokenizer import load_tokenizer

    run_dir, probe_path = uninterrupted
    export = run_dir / "hf"
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    probe = torch.load(probe_path)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(export)
    training = load_tokenizer(run_dir / "tokenizer")
    text = " To be, or not to be:\n\tthat is the question."
    assert tokenizer(text)["input_ids"] == [training.bos_id] + training.encode(text)  # the ids it was trained on
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_offline_export_command_writes_the_same_weights(uninterrupted, tmp_path):
    from safetensors.torch import load_file

    from zerotrain import export

    run_dir, _ = uninterrupted
    # The command's main in this process (it needs no process group; tests/test_export.py runs the command itself).
    assert export.main([str(run_dir), str(tmp_path / "hf")]) == 0
    again, first = load_file(tmp_path / "hf" / "model.safetensors"), load_file(run_dir / "hf" / "model.safetensors")
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


# ---- single-process failures, all in one process (train.py's main per case) ------------------------------------


@pytest.fixture(scope="module")
def failures(uninterrupted, resumed, shakespeare, tmp_path_factory) -> dict:
    """Three relaunches of train.py (tests/workers/train_py_cases.py): ``corrupt``, the resumed run with a truncated
    model shard, asking for 4 more steps; ``stop`` and ``continue``, the export of the uninterrupted run with a NaN
    weight, under the default nan_policy and under nan_policy=continue."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("failures")
    run_dir = root / "resumed"
    shutil.copytree(resumed[0], run_dir)
    victim = run_dir / "checkpoints" / "step_00000016" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file())
    poisoned = root / "poisoned"
    shutil.copytree(uninterrupted[0] / "hf", poisoned)
    weights = load_file(poisoned / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, poisoned / "model.safetensors", metadata={"format": "pt"})
    nan = ["recipe=tiny_llama", "zero=zero3_cpu", f"data.train.0.path={shakespeare}",
           f"model.pretrained_path={poisoned}", "train.steps=3", "train.log_interval=10", "train.eval_interval=0",
           "wandb.enabled=false", f"run.output_dir={root}"]
    # One process is enough: the integrity check runs before the world-size check. (Under torchrun the ranks exit
    # with 2 too, but torchrun itself reports any failed rank as 1.)
    cases = [{"name": "corrupt", "argv": [*COMMON, "train.steps=20", f"run.output_dir={root}", "run.name=resumed",
                                          f"data.train.0.path={shakespeare}"]},
             {"name": "stop", "argv": [*nan, "run.name=stop"]},
             {"name": "continue", "argv": [*nan, "run.name=continue", "train.nan_policy=continue"]}]
    out = root / "out"
    out.mkdir()
    (root / "cases.json").write_text(json.dumps([{**case, "cwd": str(REPO)} for case in cases]))
    run([PYTHON, "tests/workers/train_py_cases.py", root / "cases.json", out], timeout=900)
    codes = json.loads((out / "results.json").read_text())
    return {"root": root, "victim": victim, "before": before,
            "after": sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file()),
            **{case["name"]: (codes[case["name"]], (out / f"{case['name']}.log").read_text()) for case in cases}}


def test_corrupt_checkpoint_fails_clearly_and_loses_nothing(failures):
    code, log = failures["corrupt"]
    assert code == 2, log[-3000:]
    assert f"checkpoint file {failures['victim']} is corrupt" in log
    assert "Traceback" not in log
    assert set(failures["before"]) <= set(failures["after"]), "a failed resume must not delete any checkpoint file"


def test_non_finite_loss_stops_with_a_clear_error_and_keeps_the_curve(failures):
    """A checkpoint with a NaN weight makes every loss NaN: the default policy logs the step, stops with a message
    naming it and exits 3 without saving; nan_policy=continue records the diverged curve to the end."""
    code, log = failures["stop"]
    assert code == 3, log[-3000:]
    assert "non-finite loss (nan) at step 1" in log
    assert math.isnan(losses(failures["root"] / "stop")[1])  # logged although step 1 is not a logging step
    assert not (failures["root"] / "stop" / "checkpoints" / "latest").exists()
    assert failures["continue"][0] == 0, failures["continue"][1][-3000:]
    assert sorted(losses(failures["root"] / "continue")) == [1, 2, 3]


# ---- more architectures, and fine-tuning from the exports ---------------------------------------------------------


def test_tiny_falcon_trains_in_bf16_on_4_processes(pretrained):
    curve = losses(pretrained["falcon"])
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1] - 0.3, curve
    assert not (pretrained["falcon"] / "wandb").exists()


HUB_SHA = "5ca1ab1e" * 5


@pytest.fixture(scope="module")
def fine_tuned(pretrained, shakespeare, tmp_path_factory) -> dict[str, Path]:
    """ONE 2-rank launch (hpZ 2, tests/workers/train_variants.py), two fine-tunings of 3 steps with the loss on
    responses only, each model loaded under zero.Init: ``sft``, from the tiny Llama export (model.pretrained_path
    a directory) on prompt/response and chat data; ``hub``, from the tiny Llama-3 export put in a fake Hub cache,
    offline, as model.pretrained_path=<Hub id>@<commit>, on chat data rendered with the tokenizer's own template
    (fetched by Hub id)."""
    out = tmp_path_factory.mktemp("fine_tuned")
    rows = [{"prompt": "Who wrote Hamlet?", "response": "William Shakespeare, who wrote many plays."},
            {"messages": [{"role": "user", "content": "Say a line of verse."},
                          {"role": "assistant", "content": "To be, or not to be: that is the question."}]}]
    source = out / "sft.jsonl"
    source.write_text("".join(json.dumps(rows[i % 2]) + "\n" for i in range(32)))
    run([PYTHON, "data/prepare.py", f"input={source}", f"output={out / 'sft_data'}", "kind=sft",
         f"tokenizer={shakespeare}", "valid_fraction=0", "progress=false"], timeout=120)

    snapshot = out / "hub" / "models--zerotrain-test--tiny-llama3" / "snapshots" / HUB_SHA
    shutil.copytree(pretrained["llama3"] / "hf", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(HUB_SHA)
    config = json.loads((snapshot / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA3_CHAT_TEMPLATE
    (snapshot / "tokenizer_config.json").write_text(json.dumps(config))
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(out / "hub")}
    chats = out / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "Who wrote Hamlet?"},
                         {"role": "assistant", "content": "William Shakespeare, who wrote many plays."}]}
    chats.write_text((json.dumps(chat) + "\n") * 32)
    run([PYTHON, "data/prepare.py", f"input={chats}", f"output={out / 'hub_data'}", "kind=sft",
         "chat_template=tokenizer", "tokenizer=zerotrain-test/tiny-llama3", "valid_fraction=0", "progress=false"],
        env=offline, timeout=300)
    common = ["data.kind=sft", "train.steps=3", "train.log_interval=1", "train.seq_len=64", "train.micro_batch_size=2",
              "optim.lr=1e-4", "schedule.warmup_steps=0", "train.eval_interval=0", "wandb.enabled=false",
              f"run.output_dir={out}"]
    sft = ["recipe=tiny_llama", *common, f"data.train.0.path={out / 'sft_data'}",
           f"model.pretrained_path={pretrained['full'] / 'hf'}", "run.name=sft"]
    hub = ["recipe=tiny_llama3", *common, f"data.train.0.path={out / 'hub_data'}",
           f"model.pretrained_path=zerotrain-test/tiny-llama3@{HUB_SHA}", "run.name=from_hub"]
    torchrun(2, "tests/workers/train_variants.py", " ".join(sft), " ".join(hub), env=offline, timeout=900)
    return {"sft": out / "sft", "hub": out / "from_hub"}


def test_tiny_llama3_trains_on_4_processes_under_hpz_and_fine_tunes_from_a_hub_id(pretrained, fine_tuned):
    """recipes/tiny_llama3: data prepared with a trained Llama-3-style tokenizer (<|begin_of_text|> documents), a
    GQA model with Llama-3 RoPE scaling and tied embeddings, 4 ranks with hpZ 2; the Hugging Face export carries the
    Llama-3 shape and the run's tokenizer, and, put in a Hub cache, is fine-tuned from its Hub id offline."""
    from transformers import AutoConfig, AutoTokenizer

    run_dir = pretrained["llama3"]
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1] - 0.5, curve
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if "loss" in r][-1]["hpz/shards_read"] > 0
    export = run_dir / "hf"
    hf = AutoConfig.from_pretrained(export)
    assert (hf.num_key_value_heads, hf.tie_word_embeddings, hf.rope_parameters["rope_type"]) == (2, True, "llama3")
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (tokenizer.bos_token_id, len(tokenizer)) == (1792, 2048)
    assert tokenizer("To be")["input_ids"][0] == 1792  # as every training document starts

    tuned = losses(fine_tuned["hub"])
    # From scratch the loss starts at ln(2048) = 7.62; the pretrained weights start below it.
    assert sorted(tuned) == [1, 2, 3] and all(math.isfinite(v) for v in tuned.values()) and tuned[1] < 7.2, tuned


def test_standalone_mmlu_scores_a_training_run_directory(uninterrupted, tmp_path):
    """evaluation/mmlu.py on the run directory exports the latest checkpoint once and scores it; on these questions
    it agrees with the in-training hook's last evaluation (same weights, same protocol)."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted[0], run_dir)
    report = tmp_path / "mmlu.json"
    run([PYTHON, "evaluation/mmlu.py", "--checkpoint", str(run_dir), "--data", "data/mmlu/test.jsonl",
         "--subjects", "astronomy", "marketing", "world_religions", "--limit-per-subject", "3",
         "--shots", "2", "--batch-size", "4", "--output", str(report)], timeout=300)
    assert (run_dir / "checkpoints" / "step_00000016" / "hf" / "config.json").is_file()
    standalone = json.loads(report.read_text())["overall"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    hook = [r for r in records if "mmlu/acc" in r][-1]
    assert standalone["micro"]["total"] == hook["mmlu/questions"]
    assert standalone["micro"]["accuracy"] == pytest.approx(hook["mmlu/acc"])


def test_sft_fine_tuning_starts_from_a_hugging_face_checkpoint(fine_tuned):
    """model.pretrained_path: the export of the pretraining run is loaded under zero.Init (2 ranks, hpZ 2) and
    fine-tuned on prompt/response and chat data with the loss on responses only."""
    curve = losses(fine_tuned["sft"])
    assert sorted(curve) == [1, 2, 3]
    # A randomly initialised model starts at ln(vocab) = ln(2048) = 7.62; the pretrained weights start well below.
    assert all(math.isfinite(v) for v in curve.values()) and curve[1] < 7.2, curve

"""The training loop: config -> process group -> data -> model -> DeepSpeed engine -> steps, checkpoints, logs.

One class, read top to bottom: ``__init__`` sets everything up in the order the pieces depend on each other,
``fit`` runs the steps. Everything it uses lives in its own module, and each component decides when it is due
(``CheckpointConfig.save_due``, ``Validation.due``, ``MMLUHook.due``, ``TrainConfig.log_due``/``exit_due``) and what
it adds to a logged line (a :data:`MetricSource`); this file only wires them together, handing each component its
own section of the config.

Code outside the loop (tests, benchmarks, profilers) observes every step through :class:`StepCallback` objects
passed to the trainer (``Trainer(cfg, callbacks=[...])``), on every rank, right before and right after each
optimizer step. The loop itself times each step's forward, backward and optimizer phases
(:mod:`zerotrain.step_timing`: the ``time/*_share`` of every line) and, when the ``profile`` section asks, calls
:class:`zerotrain.profiling.Profiler` right before and after each step.

No host wait of ours between logged lines: a step's loss sum, non-finite count and token-less flag stay on the
device, and the steps since the last line are reduced over ranks (one all-gather, one ``.tolist()``) at the next
log step, checkpoint or exit, so an accelerator is never drained by the loop itself (and ``hpz.mode=sync`` costs
only what it costs). ``tests/test_host_syncs.py`` counts them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers.integrations import HfDeepSpeedConfig

from zerotrain import (
    checkpoint,
    config,
    distributed,
    durable,
    loss_reduction,
    metrics,
    models,
    profiling,
    run_tokenizer,
    step_timing,
)
from zerotrain import engine as engine_lib
from zerotrain.data.loader import build_loader, build_valid_loader
from zerotrain.errors import EXIT_OK, CheckpointError, StorageError, TrainingDiverged, ZerotrainError
from zerotrain.hpz import options as hpz_options
from zerotrain.hpz.config import GradReduce
from zerotrain.hpz.emulated_run import EmulatedRun
from zerotrain.launch.layout import resolve_layout, verify_deepspeed_hpz_groups
from zerotrain.launch.preemption import PreemptionHandler
from zerotrain.loggers import MetricsLogger, setup_console
from zerotrain.run_config import Config, LossReduction, NanPolicy
from zerotrain.validation import Validation

log = logging.getLogger("zerotrain")

LOG_WINDOW = "log_window"  # TrainState.extra key: the StepResults since the last logged line


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step gave."""

    loss: float
    """The loss averaged over micro-batches and ranks (under train.loss_reduction=token: the mean over every
    trained token of the step)."""
    nonfinite: bool
    """Whether any rank saw a non-finite loss."""
    lr: float
    """The learning rate the step used."""
    seconds: float
    """Host wall time of the step: forward, backward and optimizer step of every micro-batch, as queued (the loss
    is reduced at the log step; on an accelerator the host may run ahead of it until then)."""


@dataclass
class _PendingStep:
    """A step whose loss is not reduced over ranks yet."""

    step: int
    local: torch.Tensor
    """This rank's [sum of micro-batch losses, non-finite micro-batches, 1.0 if the step had no trained token]."""
    lr: float
    seconds: float


class StepView:
    """What ``StepCallback.on_step_end`` is shown. ``lr`` and ``seconds`` are known at once; ``loss`` and
    ``nonfinite`` need the ranks' reduction, which the trainer does once per logged line. Reading them earlier
    reduces the pending steps now: collective (read them on every rank, as callbacks run on every rank) and one
    host sync. The values are those of the logged records, bitwise."""

    def __init__(self, trainer: Trainer, step: int, lr: float, seconds: float):
        self._trainer, self.step, self.lr, self.seconds = trainer, step, lr, seconds

    @property
    def loss(self) -> float:
        return self._trainer._result(self.step).loss

    @property
    def nonfinite(self) -> bool:
        return self._trainer._result(self.step).nonfinite


class StepCallback:
    """Observes the loop on every rank; override what you need. ``step`` counts from 1: the step about to run in
    ``on_step_begin``, the one just done in ``on_step_end`` (called before that step's logging, evaluations and
    checkpoint; ``trainer.state.step == step`` by then)."""

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        pass

    def on_step_end(self, trainer: Trainer, step: int, result: StepView) -> None:
        pass


# A component's part of each logged line: called with the steps since its previous call, it returns what it counted
# over them under its own keys (and starts counting afresh). Collective: every rank calls it at the same steps.
MetricSource = Callable[[int], dict[str, Any]]


class Trainer:
    def __init__(self, cfg: Config, callbacks: Sequence[StepCallback] = ()):
        self.cfg = cfg
        self.callbacks = list(callbacks)
        distributed.apply_environment(cfg.cluster.env)
        distributed.enable_flight_recorder(cfg.cluster.nccl_flight_recorder, Path(cfg.run.output_dir) / cfg.run.name)
        # Before any set-up: a DeepSpeed op that cannot be built fails now, not after the model is built.
        self.optimizer_impl = engine_lib.resolve_impl(cfg.optim, cfg.zero, cfg.deepspeed)
        engine_lib.check_optimizer_available(self.optimizer_impl)
        # hpz.emulate_async: the emulated asynchronous accelerator goes in before the process group exists.
        self.emulation = EmulatedRun.start(cfg.hpz, cfg.zero)
        # Before the slow set-up: a SLURM warning signal arriving with no handler installed would kill the process.
        self.preemption = PreemptionHandler()
        self.dist = distributed.init(cfg.cluster.init_timeout_s, cfg.cluster.collective_timeout_s)
        setup_console(self.dist.rank)
        self.layout = resolve_layout(cfg.zero.get("zero_hpz_partition_size", 1))
        # gloo's reduce-scatter / all-gather as rings (cluster.collectives), before any engine issues one.
        from zerotrain import ring_collectives

        self.collectives = ring_collectives.install(str(cfg.cluster.collectives))
        self.dp_size = self.dist.world_size  # ZeRO-3 is pure data parallelism: every rank is a DP rank
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.ckpt_root = self.run_dir / "checkpoints"
        train = cfg.train
        # Opening the data checks shard checksums and that the tokenizer fits model.vocab_size.
        self.train_loader = self._train_loader()
        validation = self._validation() if train.eval_interval else None
        self.ds_config = engine_lib.deepspeed_config(
            cfg.zero, micro_batch_size=train.micro_batch_size, grad_accum=train.grad_accum,
            grad_clip=train.grad_clip, precision=train.precision, seed=cfg.run.seed, dp_size=self.dp_size,
            hpz_size=self.layout.hpz_size, extra=cfg.deepspeed)
        # Options hpZ is refused with (docs/hpz.md's option matrix): exit 2 before anything is written or built.
        hpz_options.check(self.ds_config, get_accelerator().device_name())
        # A checkpoint of another world size resumes from its universal copy (made here if needed, from a verified
        # checkpoint), which DeepSpeed reads only when its config says so at initialize.
        self.resume_plan = checkpoint.plan_resume(cfg.checkpoint, self.ckpt_root, self.dist.rank,
                                                  self.dist.world_size, train.micro_batch_size, train.grad_accum)
        self.ds_config.update(self.resume_plan.deepspeed_config)
        distributed.seed_everything(cfg.run.seed)

        self.hpz_active = self.layout.hpz_size > 1
        from zerotrain import hpz

        self.grad_reduce = self._choose_grad_reduce()
        if self.hpz_active or self.grad_reduce != GradReduce.flat:  # without hpZ the engine build refuses it
            hpz.install(mode=str(cfg.hpz.mode), verify=cfg.hpz.verify, grad_reduce=self.grad_reduce)
        else:  # plain ZeRO-3: nothing an earlier run in this process installed (benchmarks, tests) may apply to it
            hpz.uninstall()
        # transformers partitions the model at construction (zero.Init) while this object is referenced.
        self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        model = models.build_model(cfg.model, train.precision, train.activation_checkpointing)
        self.flops_per_token = metrics.flops_per_token(
            metrics.matmul_params(model), cfg.model.num_layers, cfg.model.hidden_size, train.seq_len
        )
        leaves = models.set_fetch_unit(model, train.param_fetch)  # before the engine registers its hooks
        if self.dist.is_main:
            log.info("ZeRO-3 fetch unit: %s (train.param_fetch=%s)", ", ".join(leaves) or "every submodule",
                     train.param_fetch)
        self.engine = engine_lib.initialize(model, cfg.optim, cfg.schedule, train.steps, self.ds_config,
                                            self.optimizer_impl)
        verify_deepspeed_hpz_groups(self.layout)  # DeepSpeed's real hpZ groups must be intra-node
        if self.dist.is_main:
            inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
            log.info("optimizer: %s (optim.impl=%s)", type(inner).__name__, self.optimizer_impl)
        self.device = get_accelerator().current_device_name()

        # Periodic evaluations, in the order they run after a step.
        mmlu = self._mmlu_hook() if cfg.mmlu.enabled else None
        self.evaluations = [e for e in (validation, mmlu) if e is not None]

        self.state = checkpoint.TrainState()
        resumed = self._maybe_resume()
        # Every check has passed (config, data and tokenizer checksums, checkpoint CRC32s, memory plan): only now is
        # the run directory created or changed, so a launch that fails leaves it as it was.
        self._write_run_files(replace_tokenizer=not resumed)
        self.state.extra[run_tokenizer.STATE_KEY] = run_tokenizer.state_record(cfg.data.train[0].path)
        # The steps since the last logged line: saved with a checkpoint, so a resumed run's next line averages the
        # same steps as an uninterrupted run's would.
        self.window = [StepResult(**r) for r in self.state.extra.get(LOG_WINDOW, [])]
        self._pending: list[_PendingStep] = []  # steps after the window's, not reduced over ranks yet
        self._reduced: dict[int, StepResult] = {}  # this line's steps by number, for StepView
        self._steps_since_snapshot = 0  # the steps the metric sources have counted since their last call
        self.logger = MetricsLogger(cfg.wandb, self.run_dir, self.dist.is_main,
                                    resume_step=self.state.step if resumed else None,
                                    wandb_run_id=self.state.wandb_run_id, run_name=cfg.run.name,
                                    run_config=config.as_container(cfg), total_steps=train.steps)
        self.state.wandb_run_id = self.logger.wandb_run_id or self.state.wandb_run_id
        self.peak_tflops = metrics.peak_tflops(train.precision, cfg.cluster.peak_tflops)
        # What the components add to each logged line, in this order.
        self.metric_sources: list[MetricSource] = []
        if self.hpz_active:
            self.metric_sources.append(hpz.interval_metrics)
        if self.emulation is not None:
            self.metric_sources.append(self.emulation.interval_metrics)
        if cfg.comm.accounting:  # installed last, so start-up traffic (zero.Init, resume) is not counted
            from zerotrain import comm_accounting

            comm_accounting.install(self.layout)
            self.metric_sources.append(comm_accounting.interval_metrics)
        self.step_times = step_timing.StepTimes(self.device)  # the time/*_share breakdown of every logged line
        step_timing.install(self.step_times)
        self.metric_sources.append(lambda _steps: self.step_times.read())  # forward, backward, optimizer, comm wait
        self.profiler = (profiling.Profiler(cfg.profile, self.run_dir, self.dist.rank,
                                            publish=self.logger.log_artifact)
                         if cfg.profile.active_any else None)

    # ----------------------------------------------------------------------------------------------------------
    # Set-up helpers
    # ----------------------------------------------------------------------------------------------------------

    def _choose_grad_reduce(self) -> str:
        """hpz.grad_reduce resolved by the ring model (auto), the choice and its predicted saving logged."""
        from zerotrain.hpz import grad_reduce

        requested = str(self.cfg.hpz.grad_reduce)
        if requested == GradReduce.flat:
            return requested
        layout = self.layout
        choice = grad_reduce.choose(requested, layout.num_nodes, layout.ranks_per_node, layout.hpz_size)
        if self.dist.is_main:
            log.info("%s (cluster.collectives=%s)", choice.describe(), self.collectives)
            if choice.warning:
                log.warning(choice.warning)
        return choice.mode

    def _train_loader(self):
        data, train = self.cfg.data, self.cfg.train
        return build_loader(
            sources=[(source.path, source.weight) for source in data.train],
            split="train",
            seq_len=train.seq_len,
            micro_batch_size=train.micro_batch_size,
            dp_rank=self.dist.rank,
            dp_size=self.dp_size,
            seed=self.cfg.run.seed,
            kind=data.kind,
            packing=data.packing,
            vocab_size=self.cfg.model.vocab_size,
        )

    def _validation(self) -> Validation:
        data, train = self.cfg.data, self.cfg.train
        # data.valid: a prepared validation directory; otherwise the first source's own 'valid' split.
        loader = build_valid_loader(
            data.valid or data.train[0].path,
            seq_len=train.seq_len,
            micro_batch_size=train.micro_batch_size,
            dp_rank=self.dist.rank,
            dp_size=self.dp_size,
            num_batches=train.eval_batches,
            kind=data.kind,
            packing=data.packing,
            vocab_size=self.cfg.model.vocab_size,
        )
        return Validation(loader, train.eval_interval, train.steps, train.eval_batches, self.dp_size)

    def _mmlu_hook(self):
        from zerotrain.evaluation.training_hook import MMLUHook

        # The tokenizer the training data was made with (a Hugging Face re-export may split whitespace differently).
        return MMLUHook(self.cfg.mmlu, self.cfg.data.train[0].path, self.cfg.model.max_seq_len, self.cfg.train.steps)

    def _write_run_files(self, replace_tokenizer: bool) -> None:
        error: ZerotrainError | None = None
        if self.dist.is_main:
            try:
                self._write_run_files_rank0(replace_tokenizer)
            except ZerotrainError as e:  # e.g. a full disk: every rank must stop, not wait for rank 0
                error = e
        if not distributed.all_agree(error is None):
            raise error or StorageError(f"rank 0 could not write the run directory {self.run_dir} (see its message)")

    def _write_run_files_rank0(self, replace_tokenizer: bool) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The tokenizer first (exports use it, from anywhere): a resumed run whose copy is another tokenizer stops here.
        try:
            run_tokenizer.save_copy(self.cfg.data.train[0].path, self.run_dir, replace=replace_tokenizer)
        except OSError as e:
            raise durable.write_error(e, self.run_dir / run_tokenizer.RUN_TOKENIZER_DIR) from None
        text = config.to_yaml(self.cfg)
        log.info("resolved config (saved to %s):\n%s", self.run_dir / "config.yaml", text)
        config.save(self.cfg, self.run_dir / "config.yaml")
        ds_config = self.run_dir / "deepspeed_config.json"
        try:
            durable.atomic_write_text(ds_config, json.dumps(self.ds_config, indent=2))
        except OSError as e:
            raise durable.write_error(e, ds_config) from None
        log.info("world: %d ranks on %d node(s), hpZ size %d (%s)", self.dist.world_size,
                 self.layout.num_nodes, self.layout.hpz_size,
                 self.cfg.hpz.mode if self.layout.hpz_size > 1 else "off")

    def _maybe_resume(self) -> bool:
        loaded = checkpoint.execute_resume(self.engine, self.resume_plan, self.dist.rank, self.dist.world_size)
        if loaded is None:
            return False
        self.state, rank_state = loaded
        self.train_loader.load_state_dict(rank_state["loader"])
        distributed.set_rng_state(rank_state["rng"])
        log.info("resumed from %s at step %d (%d tokens)", self.ckpt_root / checkpoint.tag_for(self.state.step),
                 self.state.step, self.state.tokens)
        return True

    # ----------------------------------------------------------------------------------------------------------
    # The loop
    # ----------------------------------------------------------------------------------------------------------

    def fit(self) -> int:
        """Train to ``train.steps``. Returns 0 when done or stopped at ``train.exit_interval``, 75 when preempted
        and 130 when interrupted under ``checkpoint.on_interrupt`` (checkpoint saved); raises
        :class:`~zerotrain.errors.TrainingDiverged` on a non-finite loss under ``train.nan_policy=stop`` (at the first
        log step, checkpoint or exit after it) and ``KeyboardInterrupt`` (Ctrl-C otherwise) saying where it stopped."""
        train = self.cfg.train
        if self.cfg.checkpoint.on_interrupt:
            self.preemption.catch_interrupt()
        try:
            while self.state.step < train.steps:
                step = self.state.step + 1
                for callback in self.callbacks:
                    callback.on_step_begin(self, step)
                if self.profiler is not None:
                    self.profiler.begin(step)
                pending = self._train_step(step)
                if self.profiler is not None:
                    self.profiler.end(step)
                self._pending.append(pending)
                self.state.step = step
                self.state.tokens += self.tokens_per_step
                view = StepView(self, step, pending.lr, pending.seconds)
                for callback in self.callbacks:
                    callback.on_step_end(self, step, view)
                self._steps_since_snapshot += 1
                if train.log_due(step):
                    self._log()
                for evaluation in self.evaluations:
                    if evaluation.due(step):
                        self.logger.log_event(step, *evaluation.run(self.engine, self.device))
                if self.preemption.should_stop():
                    self._checked_save()
                    log.info("%s", self.preemption.stop_message(step))
                    return self.preemption.exit_code
                if train.exit_due(step):
                    self._checked_save()
                    log.info("step %d: train.exit_interval reached, checkpoint saved; relaunch to continue", step)
                    return EXIT_OK
                if self.cfg.checkpoint.save_due(step, train.steps):
                    self._checked_save()
            if self.cfg.checkpoint.save_final:
                self._checked_save()
                if self.cfg.checkpoint.export_hf:
                    self._export()
            return EXIT_OK
        except KeyboardInterrupt as e:
            raise KeyboardInterrupt(self._interrupted(str(e))) from None
        finally:
            if self.profiler is not None:
                self.profiler.close()
            if self.emulation is not None:
                self.emulation.finish(self.run_dir, self.dist.rank, self.dist.world_size)
            self.logger.close()

    @property
    def tokens_per_step(self) -> int:
        train = self.cfg.train
        return train.micro_batch_size * train.seq_len * train.grad_accum * self.dp_size

    def _train_step(self, step: int) -> _PendingStep:
        """One optimizer step (grad_accum micro-batches). The loss sum and the non-finite count stay on this
        rank's device (no host sync): :meth:`_reduce_pending` reduces them over ranks at the next log step."""
        lr = self.engine.get_lr()[0]
        started = time.perf_counter()
        times = self.step_times
        with times.step():
            total = torch.zeros(3, dtype=torch.float32, device=self.device)
            # The step's micro-batches first: under token reduction every forward needs the step's global token
            # count.
            micro_batches = [{k: v.to(self.device) for k, v in next(self.train_loader).items()}
                             for _ in range(self.cfg.train.grad_accum)]
            extra = {}
            if self.cfg.train.loss_reduction == LossReduction.token:
                extra["num_items_in_batch"], total[2] = loss_reduction.num_items_in_batch(
                    micro_batches, self.dp_size, self.device)
            for batch in micro_batches:
                with times.phase("forward"):
                    loss = self.engine(**batch, **extra).loss
                with times.phase("backward"):
                    self.engine.backward(loss)
                with times.phase("optimizer"):
                    self.engine.step()
                value = loss.detach().float()
                total[0] += value
                total[1] += (~torch.isfinite(value)).float()
        return _PendingStep(step, total, lr, time.perf_counter() - started)

    def _reduce_pending(self) -> None:
        """Collective: the pending steps' losses summed over ranks, moved to the log window (one all-gather and
        one host sync for all of them). Ranks are summed in rank order on every rank, so a step's loss is the
        same float however many steps are reduced together (a resumed run's window differs in size)."""
        if not self._pending:
            return
        local = torch.stack([p.local for p in self._pending])
        gathered = [torch.empty_like(local) for _ in range(self.dist.world_size)]
        dist.all_gather(gathered, local)
        total = gathered[0].clone()
        for other in gathered[1:]:
            total += other
        total[:, 0] /= self.cfg.train.grad_accum * self.dp_size  # float32, as the per-step mean always was
        for pending, (loss, nonfinite, empty) in zip(self._pending, total.tolist()):
            result = StepResult(loss=loss, nonfinite=nonfinite > 0, lr=pending.lr, seconds=pending.seconds)
            self.window.append(result)
            self._reduced[pending.step] = result
            if empty > 0 and self.dist.is_main:
                log.warning("step %d had no trained tokens (every label is -100): its gradient is zero",
                            pending.step)
        self._pending = []

    def _result(self, step: int) -> StepResult:
        """Step ``step`` of the current line, reducing the pending steps first if needed (collective then)."""
        if step not in self._reduced:
            self._reduce_pending()
        return self._reduced[step]

    def _log(self) -> None:
        """Reduce the pending steps and write the window's records. A non-finite step closes a record of its own
        (a diverged run's curve shows where it diverged), then ``train.nan_policy`` acts on it."""
        self._reduce_pending()
        first = self.state.step - len(self.window) + 1
        start = 0
        for i, result in enumerate(self.window):
            if result.nonfinite or i == len(self.window) - 1:
                step = first + i
                self.logger.log_train(step, self._metrics(self.window[start:i + 1], step))
                start = i + 1
                if result.nonfinite:
                    self._on_nonfinite(result.loss, step)
        self.window = []
        self._reduced = {}

    def _checked_save(self) -> None:
        """Save, never a non-finite state under nan_policy=stop: the pending steps are reduced first (one sync at a
        checkpoint that is not a log step), and a non-finite one is logged and stops the run before the save."""
        self._reduce_pending()
        if any(r.nonfinite for r in self.window):
            self._log()
        self._save()

    def _interrupted(self, why: str) -> str:
        """What Ctrl-C that stopped the loop at once says: the last step done and where a relaunch resumes."""
        try:
            latest = checkpoint.latest_tag(self.ckpt_root)
        except CheckpointError:
            latest = None
        resumes = f"a relaunch resumes from {latest}" if latest else "no checkpoint exists yet"
        hint = "" if why else "; checkpoint.on_interrupt=true saves one at the step boundary first"
        return f"after step {self.state.step}, {why or 'no checkpoint saved on the way out'}: {resumes}{hint}"

    def _on_nonfinite(self, loss: float, step: int) -> None:
        message = (f"non-finite loss ({loss}) at step {step}. The last checkpoint is untouched: "
                   f"{checkpoint.latest_tag(self.ckpt_root) or 'none saved yet'}.")
        if self.cfg.train.nan_policy == NanPolicy.stop:
            raise TrainingDiverged(message + f" Stopping at step {self.state.step} (train.nan_policy=stop acts at "
                                   "the next logged line; 'continue' keeps going, e.g. to record a diverging curve).")
        if self.dist.is_main:
            log.warning("%s Continuing (train.nan_policy=continue).", message)

    def _metrics(self, window: list[StepResult], step: int) -> dict[str, Any]:
        step_time = sum(r.seconds for r in window) / len(window)
        tokens_per_s = self.tokens_per_step / step_time
        per_device = tokens_per_s / self.dist.world_size
        tflops = self.flops_per_token * per_device / 1e12
        out: dict[str, Any] = {
            "loss": sum(r.loss for r in window) / len(window),
            "lr": window[-1].lr,
            "grad_norm": _as_float(self.engine.get_global_grad_norm()),
            "skipped_steps": self.engine.skipped_steps,  # DeepSpeed's, since the start: steps dropped on a bad norm
            "step_time_s": step_time,
            "tokens": self.state.tokens - (self.state.step - step) * self.tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            **metrics.memory_gib(),
        }
        for source in self.metric_sources:  # every rank reaches here, as the collective sources need
            # A window restored from a checkpoint holds steps the previous launch counted: not the window's length.
            out.update(source(max(1, self._steps_since_snapshot)))
        self._steps_since_snapshot = 0
        return out

    def _save(self) -> None:
        self.state.extra[LOG_WINDOW] = [dataclasses.asdict(r) for r in self.window]
        rank_state = {"loader": self.train_loader.state_dict(), "rng": distributed.rng_state()}
        path = checkpoint.save(self.engine, self.ckpt_root, self.state, rank_state, config.to_yaml(self.cfg),
                               self.dist.rank, self.dist.world_size, self.cfg.checkpoint.keep_last,
                               low_space=self.cfg.checkpoint.low_space)
        if path is not None:
            log.info("checkpoint saved: %s", path)

    def _export(self) -> None:
        out = self.run_dir / "hf"
        if self.dist.is_main:
            checkpoint.export_checkpoint(self.ckpt_root / checkpoint.tag_for(self.state.step), out)
            log.info("Hugging Face export written: %s", out)
        distributed.barrier()


def _as_float(value: Any) -> float | None:
    return None if value is None else float(value)

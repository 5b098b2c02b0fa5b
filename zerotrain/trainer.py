"""The training loop: config -> process group -> data -> model -> DeepSpeed engine -> steps, checkpoints, logs.

One class, read top to bottom: ``__init__`` sets everything up in the order the pieces depend on each other,
``fit`` runs the steps. Everything it uses lives in its own module; this file only wires them together.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from omegaconf import DictConfig
from transformers.integrations import HfDeepSpeedConfig

from zerotrain import checkpoint, config, distributed, engine as engine_lib, metrics, models, run_tokenizer
from zerotrain.data.loader import build_loader, build_valid_loader
from zerotrain.launch.layout import resolve_layout, verify_deepspeed_hpz_groups
from zerotrain.launch.preemption import REQUEUE_EXIT_CODE, PreemptionHandler
from zerotrain.loggers import MetricsLogger, setup_console

log = logging.getLogger("zerotrain")

EXIT_OK = 0
EXIT_DIVERGED = 3


class TrainingDiverged(RuntimeError):
    pass


class Trainer:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        distributed.apply_environment(dict(cfg.cluster.env))
        # Before the slow set-up: a SLURM warning signal arriving with no handler installed would kill the process.
        self.preemption = PreemptionHandler()
        self.dist = distributed.init()
        setup_console(self.dist.rank)
        self.layout = resolve_layout(cfg.zero.get("zero_hpz_partition_size", 1))
        self.dp_size = self.dist.world_size  # ZeRO-3 is pure data parallelism: every rank is a DP rank
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.ckpt_root = self.run_dir / "checkpoints"
        self.ds_config = engine_lib.deepspeed_config(cfg, self.dp_size, self.layout.hpz_size)
        self._write_run_files()
        distributed.seed_everything(cfg.run.seed)

        # Opening the data checks shard checksums and that the tokenizer fits model.vocab_size.
        self.train_loader = self._train_loader()
        self.valid_loader = self._valid_loader() if cfg.train.eval_interval else None

        self.hpz_active = self.layout.hpz_size > 1
        if self.hpz_active:
            from zerotrain import hpz

            hpz.install(mode=cfg.hpz.mode, verify=cfg.hpz.verify)
        # transformers partitions the model at construction (zero.Init) while this object is referenced.
        self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        model = models.build_model(cfg.model, cfg.train.precision)
        self.flops_per_token = metrics.flops_per_token(
            metrics.matmul_params(model), cfg.model.num_layers, cfg.model.hidden_size, cfg.train.seq_len
        )
        self.engine = engine_lib.initialize(cfg, model, self.ds_config)
        verify_deepspeed_hpz_groups(self.layout)  # DeepSpeed's real hpZ groups must be intra-node
        self.device = get_accelerator().current_device_name()

        self.mmlu = self._prepare_mmlu() if cfg.mmlu.enabled else None

        self.state = checkpoint.TrainState()
        resumed = self._maybe_resume()
        self.logger = MetricsLogger(cfg, self.run_dir, self.dist.is_main,
                                    resume_step=self.state.step if resumed else None,
                                    wandb_run_id=self.state.wandb_run_id)
        self.state.wandb_run_id = self.logger.wandb_run_id or self.state.wandb_run_id
        self.peak_tflops = metrics.peak_tflops(cfg.train.precision, cfg.cluster.peak_tflops)
        if cfg.comm.accounting:  # installed last, so start-up traffic (zero.Init, resume) is not counted
            from zerotrain import comm_accounting

            comm_accounting.install(self.layout)

    # ----------------------------------------------------------------------------------------------------------
    # Set-up helpers
    # ----------------------------------------------------------------------------------------------------------

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

    def _valid_loader(self):
        data, train = self.cfg.data, self.cfg.train
        # data.valid: a prepared validation directory; otherwise the first source's own 'valid' split.
        return build_valid_loader(
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

    def _prepare_mmlu(self):
        """Questions tokenised once, identically on every rank, with the tokenizer the training data was made with
        (a Hugging Face re-export of it may split whitespace differently)."""
        from zerotrain.data.tokenizer import load_tokenizer
        from zerotrain.evaluation import load_mmlu, prepare_mmlu

        mmlu = self.cfg.mmlu
        data = load_mmlu(mmlu.data, subjects=list(mmlu.subjects) or None,
                         limit_per_subject=mmlu.limit_per_subject or None, shots=mmlu.shots)
        self.mmlu_tokenizer = load_tokenizer(self.cfg.data.train[0].path)
        return prepare_mmlu(data, self.mmlu_tokenizer, max_length=self.cfg.model.max_seq_len)

    def _write_run_files(self) -> None:
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            text = config.to_yaml(self.cfg)
            log.info("resolved config (saved to %s):\n%s", self.run_dir / "config.yaml", text)
            config.save(self.cfg, self.run_dir / "config.yaml")
            (self.run_dir / "deepspeed_config.json").write_text(json.dumps(self.ds_config, indent=2))
            run_tokenizer.save_copy(self.cfg.data.train[0].path, self.run_dir)  # exports use it, from anywhere
            log.info("world: %d ranks on %d node(s), hpZ size %d (%s)", self.dist.world_size,
                     self.layout.num_nodes, self.layout.hpz_size,
                     self.cfg.hpz.mode if self.layout.hpz_size > 1 else "off")
        distributed.barrier()

    def _maybe_resume(self) -> bool:
        if not self.cfg.checkpoint.resume:
            if checkpoint.latest_tag(self.ckpt_root) is not None:
                raise checkpoint.CheckpointError(
                    f"{self.ckpt_root} holds checkpoints and checkpoint.resume=false: refusing to overwrite them. "
                    f"Choose another run.name, or resume with checkpoint.resume=true"
                )
            return False
        loaded = checkpoint.load(self.engine, self.ckpt_root, self.dist.rank, self.dist.world_size)
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
        cfg = self.cfg.train
        window: list[float] = []
        window_losses: list[float] = []
        try:
            while self.state.step < cfg.steps:
                lr = self.engine.get_lr()[0]
                started = time.perf_counter()
                loss, nonfinite = self._train_step()
                window.append(time.perf_counter() - started)
                window_losses.append(loss)
                self.state.step += 1
                self.state.tokens += self.tokens_per_step
                step = self.state.step
                # A non-finite step is always logged, so a diverged run's curve shows where it diverged.
                if nonfinite or step % cfg.log_interval == 0 or step == cfg.steps:
                    self.logger.log_train(step, self._metrics(window, window_losses, lr))
                    window, window_losses = [], []
                if nonfinite:
                    self._on_nonfinite(loss)
                if cfg.eval_interval and (step % cfg.eval_interval == 0 or step == cfg.steps):
                    self._evaluate()
                mmlu_every = self.cfg.mmlu.interval
                if self.mmlu is not None and ((mmlu_every and step % mmlu_every == 0) or step == cfg.steps):
                    self._evaluate_mmlu()
                if self.preemption.should_stop():
                    self._save()
                    log.info("preempted at step %d: checkpoint saved, exiting for requeue", step)
                    return REQUEUE_EXIT_CODE
                if cfg.exit_interval and step % cfg.exit_interval == 0 and step != cfg.steps:
                    self._save()
                    log.info("step %d: train.exit_interval reached, checkpoint saved; relaunch to continue", step)
                    return EXIT_OK
                interval = self.cfg.checkpoint.interval
                if interval and step % interval == 0 and step != cfg.steps:
                    self._save()
            if self.cfg.checkpoint.save_final:
                self._save()
                if self.cfg.checkpoint.export_hf:
                    self._export()
            return EXIT_OK
        except TrainingDiverged as e:
            log.error("%s", e)
            return EXIT_DIVERGED
        finally:
            self.logger.close()

    @property
    def tokens_per_step(self) -> int:
        cfg = self.cfg.train
        return cfg.micro_batch_size * cfg.seq_len * cfg.grad_accum * self.dp_size

    def _train_step(self) -> tuple[float, bool]:
        """One optimizer step (grad_accum micro-batches). Returns the loss averaged over micro-batches and ranks,
        and whether any rank saw a non-finite loss (one small all-reduce per step, not per micro-batch)."""
        total = torch.zeros(2, dtype=torch.float32, device=self.device)
        for _ in range(self.cfg.train.grad_accum):
            batch = {k: v.to(self.device) for k, v in next(self.train_loader).items()}
            loss = self.engine(**batch).loss
            self.engine.backward(loss)
            self.engine.step()
            value = loss.detach().float()
            total[0] += value
            total[1] += (~torch.isfinite(value)).float()
        dist.all_reduce(total)
        mean = (total[0] / (self.cfg.train.grad_accum * self.dp_size)).item()
        return mean, bool(total[1].item() > 0)

    def _on_nonfinite(self, loss: float) -> None:
        message = (f"non-finite loss ({loss}) at step {self.state.step}. The last checkpoint is untouched: "
                   f"{checkpoint.latest_tag(self.ckpt_root) or 'none saved yet'}.")
        if self.cfg.train.nan_policy == "stop":
            raise TrainingDiverged(message + " Stopping (train.nan_policy=stop; 'continue' keeps going, e.g. to "
                                   "record a diverging curve).")
        if self.dist.is_main:
            log.warning("%s Continuing (train.nan_policy=continue).", message)

    def _metrics(self, window: list[float], losses: list[float], lr: float) -> dict[str, Any]:
        step_time = sum(window) / len(window)
        tokens_per_s = self.tokens_per_step / step_time
        per_device = tokens_per_s / self.dist.world_size
        tflops = self.flops_per_token * per_device / 1e12
        out: dict[str, Any] = {
            "loss": sum(losses) / len(losses),
            "lr": lr,
            "grad_norm": _as_float(self.engine.get_global_grad_norm()),
            "step_time_s": step_time,
            "tokens": self.state.tokens,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            **metrics.memory_gib(),
        }
        if self.hpz_active:
            from zerotrain import hpz

            out.update({f"hpz/{k}": v for k, v in hpz.counters().items()})
            hpz.reset_counters()
        if self.cfg.comm.accounting:  # every rank reaches here: the snapshot is summed over ranks
            from zerotrain import comm_accounting

            snapshot = comm_accounting.snapshot_and_reset(all_ranks=True)
            out.update(comm_accounting.metrics_record(snapshot, len(window)))
        return out

    def _evaluate(self) -> None:
        """Validation loss over the first ``eval_batches`` of the valid split: the same batches every time, on every
        rank the same number of forwards (ZeRO-3 gathers parameters collectively)."""
        from zerotrain.evaluation import isolated_evaluation  # eval mode, no_grad, RNG states put back

        total = torch.zeros(1, dtype=torch.float32, device=self.device)
        with isolated_evaluation(self.engine):
            for batch in self.valid_loader:
                batch = {k: v.to(self.device) for k, v in batch.items()}
                total += self.engine(**batch).loss.float()
        dist.all_reduce(total)
        val = total.item() / (self.cfg.train.eval_batches * self.dp_size)
        self.logger.log_event(self.state.step, {"val/loss": val, "val/ppl": math.exp(min(val, 50.0))},
                              f"validation loss {val:.4f}")

    def _evaluate_mmlu(self) -> None:
        """MMLU on all ranks (questions split across data-parallel ranks, equal forward counts). The evaluator puts
        the model in eval mode and back and restores the RNG states: training continues exactly as without it."""
        from zerotrain.evaluation import evaluate

        started = time.perf_counter()
        result = evaluate(self.engine, self.mmlu_tokenizer, self.mmlu, batch_size=self.cfg.mmlu.batch_size,
                          max_length=self.cfg.model.max_seq_len, device=self.device)
        record = result.to_log_dict()
        record["mmlu/questions"] = result.micro.total
        record["mmlu/seconds"] = time.perf_counter() - started
        self.logger.log_event(self.state.step, record,
                              f"MMLU {100 * result.micro.accuracy:.2f}% micro, {100 * result.macro:.2f}% macro "
                              f"({result.micro.total} questions, {record['mmlu/seconds']:.1f} s)")

    def _save(self) -> None:
        rank_state = {"loader": self.train_loader.state_dict(), "rng": distributed.rng_state()}
        path = checkpoint.save(self.engine, self.ckpt_root, self.state, rank_state, config.to_yaml(self.cfg),
                               self.dist.rank, self.dist.world_size, self.cfg.checkpoint.keep_last)
        log.info("checkpoint saved: %s", path)

    def _export(self) -> None:
        from zerotrain.export import export_checkpoint

        out = self.run_dir / "hf"
        if self.dist.is_main:
            export_checkpoint(self.ckpt_root / checkpoint.tag_for(self.state.step), out)
            log.info("Hugging Face export written: %s", out)
        distributed.barrier()


def _as_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)

"""A training run under the emulated asynchronous accelerator (``hpz.emulate_async=true``): install, metrics, report.

The trainer calls :meth:`EmulatedRun.start` before the process group exists (the emulator refuses to install later:
DeepSpeed creates its streams from the accelerator it finds then), :meth:`EmulatedRun.interval_metrics` with every
logged line, and :meth:`EmulatedRun.finish` when the run ends. What the emulator is and what it cannot show:
:mod:`zerotrain.hpz.async_emulator` and docs/hpz.md.

Metrics, summed over all ranks (so a W&B or metrics.jsonl curve shows where races happened):

==========================  ======================================================================================
``hpz/races``               reads (or writes) of a shard whose copy was not ordered before them, in this interval
``hpz/freed_source_races``  shard copies whose source memory could have been recycled before they ran (interval)
``hpz/racing_ranks``        ranks that recorded any race in this interval
``hpz/deferred_writes``     shard writes the emulator deferred in this interval (> 0: the emulator is at work)
``hpz/races_total``         ``hpz/races`` + ``hpz/freed_source_races`` since this process started
``hpz/first_race_step``     the training step (1-based, as logged) in which the first race of the run happened,
                            earliest over ranks; absent until a race happened (an evaluation pass counts as the
                            step it follows)
``hpz/first_race_micro``    that race's micro-batch within the step (-1: in an evaluation pass)
==========================  ======================================================================================

At the end each rank writes ``<run dir>/hpz_emulator/rank_<r>.json``: its report (races by phase and stream, racy
parameter ids, every stream operation counted) and its first races in full; rank 0 logs a summary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerotrain.durable import atomic_write_text
from zerotrain.errors import ConfigError

from . import async_emulator
from .config import HpzConfig

log = logging.getLogger("zerotrain")

REPORT_DIR = "hpz_emulator"
RACES_KEPT = 200  # races written in full per rank; the counts cover all of them
NO_RACE = 2**62  # first-race position of a rank that has none (the all-ranks minimum then stays there)
_PHASE = re.compile(r"^(?P<kind>train|eval)\b.*?\bstep (?P<step>\d+)(?: micro (?P<micro>\d+))?")


def race_position(where: str) -> tuple[int, int] | None:
    """(training step, micro-batch) of a race's phase label, in the trainer's 1-based step numbering.

    The emulator labels phases with DeepSpeed's ``global_steps``, the optimizer steps *completed*: a training
    phase belongs to step ``global_steps + 1``; an evaluation pass runs after step ``global_steps`` (micro -1).
    None for a label that names no step (a race outside the engine's forward/backward/step)."""
    m = _PHASE.match(where)
    if m is None:
        return None
    if m["kind"] == "eval":
        return int(m["step"]), -1
    return int(m["step"]) + 1, int(m["micro"] or 0)


class EmulatedRun:
    """The emulator installed for one run, and what it has reported so far."""

    def __init__(self, zero: Mapping[str, Any]):
        # DeepSpeed gathers on the compute stream without overlap_comm: then the shard copy is ordered before the
        # read by program order, and no race can happen (on a GPU either).
        self.gathers_on_compute_stream = zero.get("overlap_comm") is False
        self._reported = (0, 0, 0)  # races, freed-source races, deferred writes: at the last interval
        self._totals: dict[str, int] = {}
        self._first: tuple[int, int] | None = None  # this rank's first race (step, micro), once seen

    @classmethod
    def start(cls, hpz: HpzConfig, zero: Mapping[str, Any]) -> EmulatedRun | None:
        """Install the emulator when ``hpz.emulate_async`` is set (None otherwise). Call it before the process
        group exists; on a GPU (DeepSpeed's accelerator not the CPU one) it is refused as a config error."""
        if not hpz.emulate_async:
            return None
        try:
            async_emulator.install()
        except async_emulator.EmulatorError as e:
            raise ConfigError(f"hpz.emulate_async=true: {e}. Set hpz.emulate_async=false, or run on the CPU "
                              f"(DS_ACCELERATOR=cpu)") from None
        run = cls(zero)
        if run.gathers_on_compute_stream:  # said now, not only in the end-of-run summary: the run will race nothing
            log.warning("hpz.emulate_async=true with zero.overlap_comm=false: DeepSpeed gathers on the compute stream,"
                        " which orders every shard copy before its read, so no race can happen in this run (on a GPU"
                        " either). Add zero.overlap_comm=true to see the race.")
        return run

    def _counts(self) -> tuple[int, int, int]:
        report = async_emulator.report()
        return report["races"], report["freed_source_races"], sum(report["ops"].get("deferred_write", {}).values())

    def interval_metrics(self, steps: int = 1) -> dict[str, int]:
        """Since the last call, all ranks summed (totals over the ``steps`` since then: the trainer's metric
        source). Collective: every rank calls it, at the same steps."""
        now = self._counts()
        interval = [a - b for a, b in zip(now, self._reported)]
        self._reported = now
        # .tolist() reads the values without a dispatcher op, so the emulator sees no host sync here.
        local = torch.tensor([*interval, int(interval[0] + interval[1] > 0), now[0] + now[1]], dtype=torch.int64)
        dist.all_reduce(local)
        races, freed, deferred, racing_ranks, total = local.tolist()
        self._totals = {"hpz/races": races, "hpz/freed_source_races": freed, "hpz/racing_ranks": racing_ranks,
                        "hpz/deferred_writes": deferred, "hpz/races_total": total}
        first = self._earliest_over_ranks()
        if first is not None:
            self._totals["hpz/first_race_step"], self._totals["hpz/first_race_micro"] = first
        return dict(self._totals)

    def _first_local(self) -> tuple[int, int] | None:
        if self._first is None:
            # Races are kept in order: the first one with a step in its label is this rank's first.
            self._first = next((p for p in (race_position(r.where) for r in async_emulator.races()) if p), None)
        return self._first

    def _earliest_over_ranks(self) -> tuple[int, int] | None:
        """(step, micro) of the run's first race, the minimum over ranks (collective). An evaluation race
        (micro -1) sorts after the step's training micro-batches it follows, as it happened."""
        first = self._first_local()
        encoded = NO_RACE if first is None else first[0] * 2**20 + (first[1] if first[1] >= 0 else 2**20 - 1)
        local = torch.tensor([encoded], dtype=torch.int64)
        dist.all_reduce(local, op=dist.ReduceOp.MIN)
        (value,) = local.tolist()
        if value == NO_RACE:
            return None
        step, micro = divmod(value, 2**20)
        return step, (-1 if micro == 2**20 - 1 else micro)

    def finish(self, run_dir: Path, rank: int, world_size: int) -> None:
        """Write this rank's report; rank 0 logs a summary. Not collective (it runs however the run ended)."""
        report = async_emulator.report()
        races = async_emulator.races()
        out = Path(run_dir) / REPORT_DIR
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / f"rank_{rank}.json", json.dumps({
            "rank": rank,
            "report": report,
            "races": [dataclasses.asdict(r) for r in races[:RACES_KEPT]],
            "races_left_out": max(0, len(races) - RACES_KEPT),
        }, indent=1))
        if rank == 0:
            log.info("%s", self.summary(report, world_size, out))

    def summary(self, report: Mapping[str, Any], world_size: int, out: Path) -> str:
        where = ", ".join(f"{n} in {w}" for w, n in sorted(report["races_by_where"].items(), key=lambda kv: -kv[1])[:3])
        # All-ranks figures are as of the last logged step (they need a collective; this runs on rank 0 alone).
        all_ranks = (f"{self._totals['hpz/races_total']} on all {world_size} ranks, "
                     if self._totals else "")
        first = ""
        if "hpz/first_race_step" in self._totals:
            micro = self._totals["hpz/first_race_micro"]
            first = (f"; first race in step {self._totals['hpz/first_race_step']} "
                     f"{'evaluation' if micro < 0 else f'micro-batch {micro}'}")
        text = (f"hpz emulator (ordering, not timing; docs/hpz.md): racy shard accesses since start: {all_ranks}"
                f"{report['races']} + {report['freed_source_races']} freed-source on rank 0"
                f"{' (' + where + ', ...)' if where else ''}{first}; per-rank reports in {out}")
        if self.gathers_on_compute_stream:
            text += (". zero.overlap_comm=false: DeepSpeed gathers on the compute stream, so the shard copy is always "
                     "ordered before its read and no race is possible")
        return text

"""``python -m zerotrain.launch.torchrun [torchrun options] train.py [key=value ...]``: torchrun, with the ranks' code.

Takes exactly torchrun's options (it is torchrun: ``torch.distributed.run``'s own parser and launcher). What differs
is the end of a failed run: plain torchrun prints a summary of every failed rank and exits 1, so a user error (2) or
a preemption (75) looks like a crash to a shell or a scheduler. This exits with the exit code of the rank that
failed first (128 + n when it was killed by signal n), after one line naming that rank, and prints that rank's error
message when rank 0 did not print it already (see :mod:`zerotrain.launch.failures`). Signalled itself (``scancel``,
Ctrl-C), torchrun passes the signal on to the ranks; this exits 128 + n after one line, or, for Ctrl-C (SIGINT, 130),
after none: rank 0 says where the run stopped and whether it saved a checkpoint (``checkpoint.on_interrupt``).
torchrun's own warnings about passing the signal on are not shown: the line says it.

    python -m zerotrain.launch.torchrun --standalone --nproc_per_node 4 train.py recipe=tiny_llama
"""

from __future__ import annotations

import logging
import signal
import sys

from zerotrain.launch.failures import failure_from_torchrun, first_failure

# torchrun's warnings while it passes a signal on to the ranks ("Received 2 death signal, shutting down workers",
# "Sending process 123 closing signal SIGINT"): the run's own line says what happened, once.
_SHUTDOWN_WARNINGS = {
    "torch.distributed.elastic.agent.server.api": "Received %s death signal, shutting down workers",
    "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal %s",
}


def _not_a_shutdown_warning(record: logging.LogRecord) -> bool:
    return _SHUTDOWN_WARNINGS.get(record.name) != record.msg


def _quiet_shutdown_warnings() -> None:
    for name in _SHUTDOWN_WARNINGS:
        logging.getLogger(name).addFilter(_not_a_shutdown_warning)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    _quiet_shutdown_warnings()
    try:
        run(args)
    except ChildFailedError as e:
        failures = [failure_from_torchrun(rank, failure) for rank, failure in e.failures.items()]
        first = first_failure(failures)
        lines = [f"[zerotrain.launch.torchrun] {first.describe()}"]
        # Rank 0 printed its own error (the same one, for a config error every rank hits); another rank's, here.
        rank0_printed = any(f.rank == 0 and f.message == first.message for f in failures)
        if first.message is not None and not rank0_printed:
            lines.append(f"error (rank {first.rank}): {first.message}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        return first.exit_code
    except SignalException as e:  # torchrun itself was signalled (scancel, Ctrl-C): it stopped the ranks
        if e.sigval != signal.SIGINT:
            print(f"[zerotrain.launch.torchrun] stopped by {e.sigval.name}; the ranks were stopped", file=sys.stderr,
                  flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m zerotrain.launch.torchrun [torchrun options] train.py [key=value ...]``: torchrun, with the ranks' code.

Takes exactly torchrun's options (it is torchrun: ``torch.distributed.run``'s own parser and launcher). What differs
is the end of a failed run: plain torchrun prints a summary of every failed rank and exits 1, so a user error (2) or
a preemption (75) looks like a crash to a shell or a scheduler. This exits with the exit code of the rank that
failed first (128 + n when it was killed by signal n), after one line naming that rank, and prints that rank's error
message when rank 0 did not print it already (see :mod:`zerotrain.launch.failures`).

    python -m zerotrain.launch.torchrun --standalone --nproc_per_node 4 train.py recipe=tiny_llama
"""

from __future__ import annotations

import sys

from zerotrain.launch.failures import failure_from_torchrun, first_failure


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
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
        print(f"[zerotrain.launch.torchrun] stopped by {e.sigval.name}; the ranks were stopped", file=sys.stderr,
              flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The end of a rank's process: its exit code reaches the launcher whatever the C++ libraries do at exit.

A rank that leaves ``main`` with its gloo process groups alive and lets the interpreter finalize aborts now and
then ("terminate called without an active exception", SIGABRT, exit 134; pytorch/pytorch#190489, #179291): the
gloo worker threads and the tensors their work holds are torn down in the interpreter's finalization. Seen here
after a finished run's export (the run failed), after a collective timeout (134 instead of 5) and after a
preemption checkpoint (the job was marked FAILED instead of being requeued with 75).

:func:`exit_with` is how a rank's entry point ends (train.py, evaluation/mmlu.py, the tests' distributed workers), on
every path:

1. when the run's outcome is one every rank reached together (``0``, ``75``, ``130`` returned after an interrupt's
   checkpoint), every process group is destroyed (``destroy_process_group``, as PyTorch documents for the end of a
   job). After a failure it is not: a group whose peer is stopped or gone would wait in its destructor for work
   that never completes; nor after a ``KeyboardInterrupt``, which stops each rank wherever it was;
2. the ``atexit`` functions run while the interpreter is whole (W&B's service teardown, thread pools, logging);
3. the streams are flushed and the process ends with ``os._exit(code)``: no C++ static destructor or interpreter
   finalization runs, so nothing there can turn the code into 134.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from zerotrain.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_REQUEUE
from zerotrain.launch.failures import prints_here

AGREED_CODES = (EXIT_OK, EXIT_REQUEUE, EXIT_INTERRUPTED)  # returned by every rank together: the groups are healthy


def _code(value: object) -> int:
    """``SystemExit.code`` as a shell sees it: None is 0, an int itself, anything else (a message) 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def destroy_process_groups() -> None:
    """Destroy every torch.distributed process group of this process, if any exists."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_with(main: Callable[[], object]) -> NoReturn:
    """Run ``main()`` and end the process with its code (see the module docstring). An exception ``main`` lets
    through is printed as Python would print it (exit 1); a ``KeyboardInterrupt`` (Ctrl-C) as one line,
    ``interrupted`` and its message if it has one, by the rank that prints for all (exit 130)."""
    agreed = True
    try:
        code = _code(main())
    except SystemExit as e:
        code = _code(e.code)
    except KeyboardInterrupt as e:
        if prints_here():
            print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        code, agreed = EXIT_INTERRUPTED, False
    except BaseException:  # noqa: BLE001 - printed in full, then the same exit as any other failure
        traceback.print_exc()
        code = 1
    try:
        if agreed and code in AGREED_CODES:
            destroy_process_groups()
    except Exception:  # noqa: BLE001 - the outcome is decided; a failed teardown must not change it
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

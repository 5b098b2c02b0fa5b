"""Every error a run can end with, and the exit code each one means to a user or a scheduler.

``train.py`` catches :class:`ZerotrainError` once and exits with the error's ``exit_code``; everything else in the
package raises one of these types (or a subclass defined next to the code that raises it). Exit codes:

====  ====================================================================================================
0     done (or stopped at ``train.exit_interval``: relaunch to continue)
2     a problem the user can fix: config, data, checkpoint, storage, node layout, rendezvous, SLURM env
3     training diverged (a non-finite loss under ``train.nan_policy=stop``); the last checkpoint is untouched
4     ``hpz.verify=true`` found a secondary shard that differs from its primary partitions
5     a collective timed out (``cluster.collective_timeout_s``): another rank is stopped, hung or lost
75    preempted: a checkpoint was saved, requeue the job (``slurm/train.sbatch`` does)
130   interrupted (Ctrl-C, SIGINT; 128 + 2 as a shell reports it): with ``checkpoint.on_interrupt`` a checkpoint
      was saved at the step boundary first
====  ====================================================================================================

Python itself exits 1 on an uncaught exception (a bug, not a user error) and 2 on its own usage errors; shells use
126, 127 and 128+n. 75 is EX_TEMPFAIL from sysexits.h ("temporary failure; the user is invited to retry"), which
neither Python, the shells nor torchrun use, so a requeue cannot be confused with a crash.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_HPZ_VERIFICATION = 4
EXIT_COLLECTIVE_TIMEOUT = 5
EXIT_REQUEUE = 75
EXIT_INTERRUPTED = 130


class ZerotrainError(Exception):
    """Base of the errors a run ends with; the message says what happened and what to do about it."""

    exit_code = EXIT_USER_ERROR


class ConfigError(ZerotrainError, ValueError):
    """A configuration problem a user can fix: the message names the key, file or value and what is valid."""


class DataError(ZerotrainError, RuntimeError):
    """A data problem a user can fix; the message names the file (and line) and the remedy."""


class CheckpointError(ZerotrainError, RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


class StorageError(ZerotrainError, OSError):
    """The run's files cannot be written there: out of space, read-only, a file where a directory must be; the
    message names the path and the file system."""


class LayoutError(ZerotrainError, RuntimeError):
    """Ranks are not laid out the way hpZ (or the rest of the trainer) needs; the message shows the layout."""


class RendezvousError(ZerotrainError, RuntimeError):
    """The rendezvous address is unusable from this node; the message says what to check."""


class SlurmEnvError(ZerotrainError, RuntimeError):
    """The SLURM environment is incomplete or inconsistent; the message says which variable and why."""


class EvaluationError(ZerotrainError):
    """Base of the errors raised by zerotrain.evaluation (bad MMLU data, a prompt that cannot fit, a bad checkpoint)."""


class TrainingDiverged(ZerotrainError, RuntimeError):
    """A non-finite loss under ``train.nan_policy=stop``; the message names the step and the last checkpoint."""

    exit_code = EXIT_DIVERGED


class HpzVerificationError(ZerotrainError, RuntimeError):
    """A secondary shard disagrees with the primary partitions it should mirror."""

    exit_code = EXIT_HPZ_VERIFICATION


class CollectiveTimeout(ZerotrainError, RuntimeError):
    """A collective waited ``cluster.collective_timeout_s`` for a rank that did not take part; the message names the
    waiting rank and the key."""

    exit_code = EXIT_COLLECTIVE_TIMEOUT

"""Exception types of the evaluation package.

Every error a user can cause with bad input (a wrong path, a typo in a subject,
a malformed data row, a prompt that cannot fit) has its own type, so callers can
catch them, and a message that names the file/line/key and what would be valid.
Their base, :class:`~zerotrain.errors.EvaluationError`, is a user error (exit code 2).
"""

from __future__ import annotations

from zerotrain.errors import EvaluationError


class MMLUDataError(EvaluationError, ValueError):
    """The MMLU data cannot be used: missing file, unknown layout, bad rows."""


class UnknownSubjectError(MMLUDataError):
    """A subject that is not one of the 57 MMLU subjects, or not in the data."""


class MalformedRowError(MMLUDataError):
    """A data row that does not follow the schema (message names file and line)."""


class MissingSplitError(MMLUDataError):
    """The data has no split of the requested name (e.g. no dev split for few-shot)."""


class PromptTooLongError(EvaluationError):
    """A question does not fit the model context even with zero few-shot examples."""


class NotAnHFExportError(EvaluationError, FileNotFoundError):
    """A checkpoint path that is not a Hugging Face export directory."""

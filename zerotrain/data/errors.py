"""The one exception type of the data pipeline.

Every problem a user can fix (a missing or corrupted file, a malformed input line, a tokenizer that does not fit the
model) raises :class:`DataError` with a message that names the offending path and says what to do about it.
"""

from __future__ import annotations


class DataError(RuntimeError):
    """A data problem a user can fix; the message names the file (and line) and the remedy."""

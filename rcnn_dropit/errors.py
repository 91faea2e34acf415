"""The error type for problems a user can fix, told apart from bugs.

A :class:`UsageError` (a bad config value, a missing file, data that cannot be read, a checkpoint
of another model, a study plan that cannot be used) is shown as one line naming the value and
what is allowed; anything else is a bug and keeps its traceback (``rcnn_dropit.cli.run_cli``).
Both are ``ValueError`` (the missing-path one also ``FileNotFoundError``), so code that caught
those before still catches them.
"""

from __future__ import annotations


def one_line(err: BaseException) -> str:
    """An error's message on one line (messages naming files or YAML may span several)."""
    return " ".join(str(err).split())


class UsageError(ValueError):
    """Something the user can fix; the message says what is wrong and what is allowed."""


class MissingPathError(UsageError, FileNotFoundError):
    """A file or folder the user named (in a config, an argument, a run) does not exist."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""

"""The error type for problems a user can fix, told apart from bugs.

A :class:`UsageError` (a bad config value, a missing file, data that cannot be read, a checkpoint
of another model, a study plan that cannot be used) is shown as one line naming the value and
what is allowed; anything else is a bug and keeps its traceback (``rcnn_dropit.cli.run_cli``).
Both are ``ValueError`` (the missing-path one also ``FileNotFoundError``), so code that caught
those before still catches them.
"""

from __future__ import annotations

import re
from pathlib import Path


def one_line(err: BaseException) -> str:
    """An error's message on one line (messages naming files or YAML may span several)."""
    return " ".join(str(err).split())


class UsageError(ValueError):
    """Something the user can fix; the message says what is wrong and what is allowed."""


class MissingPathError(UsageError, FileNotFoundError):
    """A file or folder the user named (in a config, an argument, a run) does not exist."""


def require_path(path: Path | str, kind: str, label: str) -> Path:
    """``path`` as a ``kind`` ("file" or "folder") that exists; else one message naming it: it
    does not exist, or something of the other kind stands there."""
    path = Path(path)
    if path.is_file() if kind == "file" else path.is_dir():
        return path
    if not path.exists():
        raise MissingPathError(f"{label} '{path}' does not exist")
    other = "folder" if path.is_dir() else "file" if path.is_file() else "special file"
    raise UsageError(f"{label} '{path}' is a {other}, not a {kind}")


def make_folder(path: Path | str, label: str, hint: str = "") -> Path:
    """A folder the user named, made where missing; one message naming ``label`` (and ``hint``,
    what to do instead) when a file stands there or it cannot be made."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{label} '{path}' is a file, not a folder{hint}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where a parent folder should be, no permission
        raise cannot_write(label, path, err, hint) from None
    return path


def cannot_write(label: str, path: Path, err: OSError, hint: str = "") -> UsageError:
    """The message for a folder or file the user named that cannot be written."""
    return UsageError(f"{label} '{path}' cannot be written ({err.strerror or err}){hint}")


def load_failure(err: Exception) -> str:
    """What torch.load's error says about a file: for one the safe loader refuses, the refusal
    itself, without torch's advice to load it unsafely (never taken here); else its first
    paragraph, on one line."""
    text = str(err)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", text, re.S)
    if found:
        return f"the weights_only loader refused it: {' '.join(found.group(1).split())}"
    return " ".join(text.split("\n\n")[0].split())


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""

"""Files written whole or not at all: a temp file next to the target, fsynced, renamed over it.

Readers see the old file or the new one, never half of one (a kill, a full disk). Used for the
run directory's files, checkpoints and their pointer, and exported backbones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Run write(file) on a temp file next to path, fsync it, then rename it over path.

    Readers see the old file or the new one, never half of one (a kill, a full disk).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, obj: Any, indent: int | None = 2) -> None:
    """obj as JSON (a trailing newline when indented), written atomically."""
    text = json.dumps(obj, indent=indent) + ("\n" if indent is not None else "")
    write_atomic(path, lambda f: f.write(text.encode()))


def _fsync_dir(directory: Path) -> None:
    # The rename is only durable once the directory entry itself reaches the disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)

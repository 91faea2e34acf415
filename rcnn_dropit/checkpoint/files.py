"""Atomic checkpoint files, the last-checkpoint pointer, resume lookup."""

from __future__ import annotations

import os
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from rcnn_dropit.atomic import write_atomic
from rcnn_dropit.errors import CheckpointWriteError, UsageError, load_failure, require_path

POINTER_NAME = "last_checkpoint"
_NUMBERED = re.compile(r"model_(\d+)\.pth")
_TMP = re.compile(r"\..+\.tmp-(\d+)")


def _write_atomic(path: Path, write: Any) -> None:
    """The run directory's atomic writer, its OS errors told as checkpoint write errors."""
    try:
        write_atomic(path, write)
    except OSError as err:  # disk full, permissions, quota: a user-facing problem
        raise CheckpointWriteError(
            f"could not write '{path}': {err}; the previous checkpoint is kept"
        ) from err


def _iteration(path: Path) -> int | None:
    match = _NUMBERED.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _prune(ckpt_dir: Path, keep_last: int, just_written: Path) -> None:
    numbered = sorted(
        (
            p
            for p in ckpt_dir.glob("model_*.pth")
            if _iteration(p) is not None and p != just_written
        ),
        key=lambda p: _iteration(p),
        reverse=True,
    )
    for old in numbered[max(keep_last - 1, 0) :]:
        try:
            old.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            warnings.warn(f"could not remove old checkpoint '{old}': {err}", stacklevel=3)


def _remove_stale_tmp(ckpt_dir: Path) -> None:
    # Temp files of writers killed mid-write (kill -9, OOM): as large as a checkpoint each.
    for tmp in ckpt_dir.glob(".*.tmp-*"):
        match = _TMP.fullmatch(tmp.name)
        if match and not _pid_alive(int(match.group(1))):
            tmp.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but belongs to someone else
    return True


def save_checkpoint(ckpt_dir: Path | str, name: str, state: dict, keep_last: int) -> Path:
    """Write state atomically to ckpt_dir/name, point last_checkpoint at it, prune old ones.

    keep_last counts numbered model_<iter>.pth files including the new one; 0 keeps all.
    """
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"checkpoint name {name!r} must be a plain file name like model_0001.pth")
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        raise CheckpointWriteError(
            f"could not write checkpoints into '{ckpt_dir}': it exists and is not a folder"
        )
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointWriteError(
            f"could not create checkpoint folder '{ckpt_dir}': {err}"
        ) from err
    path = ckpt_dir / name
    _remove_stale_tmp(ckpt_dir)
    _write_atomic(path, lambda f: torch.save(state, f))
    _write_atomic(ckpt_dir / POINTER_NAME, lambda f: f.write(name.encode()))
    if keep_last > 0:
        _prune(ckpt_dir, keep_last, path)
    return path


def load_checkpoint(path: Path | str, map_location: Any = "cpu") -> dict:
    """Load a checkpoint dict with torch.load(weights_only=True)."""
    path = require_path(path, "file", "checkpoint")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises many types for truncated or foreign files
        why = load_failure(err)
        raise UsageError(f"checkpoint '{path}' is unreadable or corrupt: {why}") from err
    if not isinstance(state, dict):
        raise UsageError(f"checkpoint '{path}' holds a {type(state).__name__}, not a dict")
    return state


def _looks_valid(path: Path) -> bool:
    # torch.save writes a zip archive; a truncated one has no central directory.
    return path.is_file() and zipfile.is_zipfile(path)


def find_last_checkpoint(ckpt_dir: Path | str) -> Path | None:
    """Checkpoint named by the pointer file, else the newest valid model_<iter>.pth, else None."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / POINTER_NAME
    if pointer.is_file():
        target = ckpt_dir / pointer.read_text().strip()
        if _looks_valid(target):
            return target
    numbered = [p for p in ckpt_dir.glob("model_*.pth") if _iteration(p) is not None]
    for candidate in sorted(numbered, key=lambda p: _iteration(p), reverse=True):
        if _looks_valid(candidate):
            return candidate
    return None


def resolve_resume(resume: str | Path | None, ckpt_dir: Path | str) -> Path | None:
    """Checkpoint to resume from: None, 'auto' (last in ckpt_dir, if any) or an existing path."""
    if resume is None:
        return None
    if str(resume).strip() == "":
        raise UsageError("--resume: give 'auto' (the newest checkpoint) or a checkpoint's path")
    if str(resume) == "auto":
        return find_last_checkpoint(ckpt_dir)
    return require_path(resume, "file", "resume: checkpoint")

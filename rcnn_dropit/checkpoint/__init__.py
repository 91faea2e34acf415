"""Checkpoints: atomic files with a last-checkpoint pointer (files), and the training
checkpoint format that one object writes and restores (checkpointer)."""

from rcnn_dropit.checkpoint.checkpointer import (
    Checkpointer,
    ResumePoint,
    format_version,
    load_on_every_rank,
    model_weights,
)
from rcnn_dropit.checkpoint.files import (
    POINTER_NAME,
    CheckpointWriteError,
    find_last_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)

__all__ = [
    "POINTER_NAME",
    "CheckpointWriteError",
    "Checkpointer",
    "ResumePoint",
    "find_last_checkpoint",
    "format_version",
    "load_checkpoint",
    "load_on_every_rank",
    "model_weights",
    "resolve_resume",
    "save_checkpoint",
]

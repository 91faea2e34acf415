"""The training checkpoint format: one object writes it, reads it, and restores every part."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rcnn_dropit.checkpoint.files import (
    load_checkpoint,
    save_checkpoint,
)
from rcnn_dropit.distributed import all_gather_object, get_rank, get_world_size, run_on_main
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models.weights import check_model_compat
from rcnn_dropit.rng import capture_rng_state

# Version 1: the unversioned files written before this module (still read). Version 2 drops
# the unread "epoch" and "sampler" fields and keeps the loop's bookkeeping under "loop".
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
REQUIRED = ("model", "optimizer", "scheduler", "iteration", "rng")


@dataclass
class ResumePoint:
    """Where a restored run continues: the iteration, this rank's RNG streams, the loop's state."""

    iteration: int
    rng: dict
    loop: dict


def format_version(state: dict, path: Path | str) -> int:
    """The format version of a loaded checkpoint dict; unknown versions are a clear error."""
    version = state.get("version", 1)
    if version not in READABLE_VERSIONS:
        raise UsageError(
            f"checkpoint '{path}' has format version {version!r}; this rcnn-dropit reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))} (a newer rcnn-dropit wrote it?)"
        )
    return version


def model_weights(state: dict) -> dict:
    """The model's state dict from a training checkpoint, or the file itself if it is one."""
    return state["model"] if "model" in state else state


class Checkpointer:
    """Saves and restores the whole training state of a run in one versioned format."""

    def __init__(
        self,
        ckpt_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler | None,
        iters_per_epoch: int,
        config: dict,
        keep_last: int = 0,
    ) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.model = model  # the plain module, never the DDP wrapper ('module.' keys)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.iters_per_epoch = iters_per_epoch
        self.config = config
        self.keep_last = keep_last

    def state_dict(self, iteration: int, rng_per_rank: list[dict], loop: dict) -> dict:
        """The checkpoint's content: weights, optimizer, schedule, scaler, RNG, loop state."""
        return {
            "version": FORMAT_VERSION,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "iteration": iteration,
            "iters_per_epoch": self.iters_per_epoch,
            "rng": rng_per_rank[0],  # what ranks of a job of another size resume with
            "rng_per_rank": rng_per_rank,  # each rank resumes its own random streams
            "loop": loop,
            "config": self.config,  # how the run was configured, for whoever reads the file
        }

    def save(self, iteration: int, loop: dict) -> Path | None:
        """Write model_<iteration>.pth on rank 0 (a collective: every rank calls it).

        A failed write ends every rank with its message; nobody moves on before it is complete.
        """
        rng_per_rank = all_gather_object(capture_rng_state())
        return run_on_main(
            lambda: save_checkpoint(
                self.ckpt_dir,
                f"model_{iteration:07d}.pth",
                self.state_dict(iteration, rng_per_rank, loop),
                keep_last=self.keep_last,
            )
        )

    def load(self, path: Path) -> ResumePoint:
        """Restore weights, optimizer, scheduler and scaler from `path` (a collective); return
        where the run continues. Errors name the file and what does not fit."""
        state = load_on_every_rank(path)
        version = format_version(state, path)
        lacking = [k for k in REQUIRED if k not in state]
        if lacking:
            raise UsageError(
                f"--resume: '{path}' is not a training checkpoint (it lacks "
                f"{', '.join(lacking)}); to start from its weights use model.weights=PATH "
                "without --resume"
            )
        try:
            check_model_compat(self.model, state["model"])
        except ValueError as err:
            raise UsageError(f"--resume: checkpoint '{path}': {err}") from None
        if version == 1:
            done = state.get("sampler", {}).get("iters_per_epoch", self.iters_per_epoch)
            loop = {k: state[k] for k in ("log_window", "skipped_steps") if k in state}
        else:
            done, loop = state["iters_per_epoch"], state["loop"]
        if done != self.iters_per_epoch:
            raise UsageError(
                f"--resume: checkpoint '{path}' was written with {done} iterations per epoch, "
                f"this run has {self.iters_per_epoch} (batch size, world size or dataset changed)"
            )
        self.model.load_state_dict(state["model"])
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except ValueError as err:  # e.g. other trainable layers: parameter groups differ
            raise UsageError(
                f"--resume: checkpoint '{path}': its optimizer state does not fit this run ({err})"
            ) from None
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        return ResumePoint(int(state["iteration"]), rng_for_this_rank(state), loop)


def rng_for_this_rank(state: dict) -> dict:
    """The RNG states this rank had when the checkpoint was written.

    Checkpoints from the same world size hold one entry per rank ('rng_per_rank'), so resumed
    ranks continue their own streams; otherwise every rank gets rank 0's ('rng').
    """
    per_rank = state.get("rng_per_rank")
    if per_rank is not None and len(per_rank) == get_world_size():
        return per_rank[get_rank()]
    return state["rng"]


def load_on_every_rank(path: Path) -> dict:
    """Load a checkpoint on every rank (a collective).

    Rank 0 wrote it; on clusters without a shared filesystem other nodes may not see the file,
    and those ranks would otherwise fail alone while the rest wait. Then rank 0 sends its copy.
    """
    visible = all_gather_object(Path(path).is_file())
    if all(visible):
        return load_checkpoint(path, map_location="cpu")
    return run_on_main(lambda: load_checkpoint(path, map_location="cpu"))

"""Checkpoint state across ranks: each rank's RNG streams, and loading on every rank."""

from __future__ import annotations

from pathlib import Path

from rcnn_dropit.checkpoint import capture_rng_state, load_checkpoint
from rcnn_dropit.distributed import all_gather_object, run_on_main


def gather_rng_states() -> list[dict]:
    """Every rank's RNG states, in rank order (a collective: all ranks must call it)."""
    return all_gather_object(capture_rng_state())


def rng_state_for_rank(state: dict, rank: int, world_size: int) -> dict:
    """The RNG states this rank had when the checkpoint was written.

    Checkpoints from the same world size hold one entry per rank ('rng_per_rank'), so resumed
    ranks continue their own streams; otherwise every rank gets rank 0's ('rng').
    """
    per_rank = state.get("rng_per_rank")
    if per_rank is not None and len(per_rank) == world_size:
        return per_rank[rank]
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

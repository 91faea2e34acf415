"""Random streams: seeding them, and capturing and restoring them whole (python, numpy, torch
CPU and the current CUDA device), for checkpoints and around work that must not shift them."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch


def seed_all(seed: int) -> None:
    """Seed python, numpy (if present) and torch generators."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def _cuda_in_use() -> bool:
    # Not initialised: this process never drew from a CUDA generator (a CPU run on a GPU node),
    # and asking for its state would create a CUDA context on GPU 0 for nothing.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture_rng_state() -> dict:
    """RNG states of python, numpy (if installed), torch CPU and the current CUDA device, as
    weights_only types.

    Only the current device's CUDA state: a rank draws from its own GPU only, and which index
    that GPU has depends on how many GPUs the job lets each process see.
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss_next],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(torch.cuda.current_device()) if _cuda_in_use() else None,
    }
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]
    return state


def restore_rng_state(state: dict) -> None:
    """Restore what capture_rng_state recorded, the CUDA state into the current device."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(state["torch"])
    cuda_state = state.get("cuda")
    if isinstance(cuda_state, list):
        # Older checkpoints hold every visible device's state by index: the current device's
        # entry is what those runs restored for it (and all that was ever drawn from).
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        cuda_state = cuda_state[index] if index < len(cuda_state) else None
    if cuda_state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_state, torch.cuda.current_device())
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Inside: random streams may be drawn from; on leaving, they are as they were on entry.

    For work that must not shift training randomness: creating a loader iterator (it draws
    worker seeds), an evaluation, a measurement step. Resumed runs then stay bit-exact.
    """
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)

"""Test tiers and shared fixtures (helpers to import are in tests/helpers.py).

Folders mirror the code: core/ (dropit_core, nothing of the toolkit), toolkit/ (rcnn_dropit),
instruments/ (benchmarks and the study), system/ (reliability, torchrun, faults, GPU); the
repository's shape (layout, package) at the top.

Tiers: unmarked tests are the quick inner loop (`make test-fast`, `-m "not slow"`); `slow` marks
tests that train or start fresh interpreters, `dist` those that start several processes
(torchrun or plain processes with the launcher's variables), `gpu` those that need a CUDA GPU
(tests/system/test_gpu*.py: skipped without one, `make test-gpu` where there is one).
`make test` runs everything. Each test file marks its own tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Without a GPU, the Triton kernels (tests/core/test_dropit_kernels.py) run under Triton's
# interpreter on CPU tensors. Triton reads TRITON_INTERPRET when a kernel is defined, its own
# standard library included (when triton is imported, which rcnn_dropit's imports do), so it is
# set here, before anything imports triton (`import torch` does not); with a GPU they compile and
# run on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test-fast` runs a pytest-xdist worker per core: one thread each, or the workers' thread
# pools would share the cores between them and every test would wait on the other's threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_configure(config) -> None:
    """Register the tier markers."""
    config.addinivalue_line("markers", "slow: trains a model or starts fresh interpreters")
    config.addinivalue_line("markers", "dist: starts several processes of one distributed job")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; make test-gpu)")


@pytest.fixture(scope="session")
def shapes_set(tmp_path_factory) -> Callable[..., Path]:
    """A synthetic shapes set by its parameters (TINY_SHAPES, with any of them changed), made
    once per session. Shared by every test that asks for it: copy it before changing it."""
    from rcnn_dropit.data import make_shapes  # here, not above: it imports triton
    from tests.helpers import TINY_SHAPES

    made: dict[tuple, Path] = {}

    def get(**changes: int) -> Path:
        params = {**TINY_SHAPES, **changes}
        key = tuple(sorted(params.items()))
        if key not in made:
            root = tmp_path_factory.mktemp("data") / "shapes"
            make_shapes(root, **params)
            made[key] = root
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_shapes(shapes_set) -> Path:
    """The shapes set tiny_opts(root) reads (tests/helpers.py)."""
    return shapes_set()


@pytest.fixture(autouse=True)
def _dropit_settings_as_they_were():
    """Every test leaves DropIT's settings as it found them (a test that configures kernels,
    loops or hooks must not change the next one's path)."""
    import dataclasses

    from dropit_core import configure, current_settings

    before = current_settings()
    yield
    configure(**dataclasses.asdict(before))


@pytest.fixture
def narrow_bench(monkeypatch) -> None:
    """Every bench model of the test built narrow (tests/helpers.py's ``NARROW_BENCH``)."""
    from instruments.measure import max_batch, step_bench, workload
    from rcnn_dropit.config import with_overrides
    from tests.helpers import NARROW_BENCH

    recipe = workload.recipe_config

    def narrow(*args, **kwargs):
        return with_overrides(recipe(*args, **kwargs), NARROW_BENCH)

    for module in (step_bench, max_batch, workload):
        monkeypatch.setattr(module, "recipe_config", narrow)

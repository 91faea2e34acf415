"""Host time of a DropIT layer on the GPU path, measured on any machine (a benchmark).

Used by ``tools/bench.py --host``. On a GPU the training step waits on the host, not on the
kernels (docs/gpu.md): what a DropIT layer costs there is mostly Python, its autograd Function,
its pack's bookkeeping and the launch wrappers. This runs that very code with the Triton launches
stubbed out: ``dropit_core`` is told to use its kernels (``dispatch``), every wrapper computes
its grid and buffers as it would, and the launch itself does nothing. Tiny tensors on the CPU then
leave the host work alone: a stack of 3x3 convs (and conv + ReLU pairs) on an 8x8 map, forward and
backward, against the plain layers, in microseconds per layer. The launch's own cost, Triton's,
is not in it: that needs a GPU (``tools/gpu_probe.py --what python``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dropit_core import dispatch, to_dropit
from dropit_core.timing import timed_rounds
from rcnn_dropit.errors import UsageError

# The kernels whose launches are stubbed: every one a quant layer and a masked ReLU reach.
KERNELS = (
    ("quant", "_quant_codes_kernel"),
    ("quant", "_quant_rebuild_kernel"),
    ("relu", "_relu_mask_kernel"),
    ("relu", "_relu_mask_grad_kernel"),
)


class _NoLaunch:
    """Stands in for a jit kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Within: DropIT takes its kernel path on any tensor, and no kernel is launched."""
    if not dispatch.triton_available():
        raise UsageError("--host runs the kernels' wrappers: it needs triton installed")
    import importlib

    modules = {name: importlib.import_module(f"dropit_core.kernels.{name}") for name, _ in KERNELS}
    saved = [(modules[m], k, getattr(modules[m], k)) for m, k in KERNELS]
    previous = dispatch.kernel_mode()
    try:
        for module, kernel, _ in saved:
            setattr(module, kernel, _NoLaunch())
        dispatch.set_kernels("triton")
        yield
    finally:
        dispatch.set_kernels(previous)
        for module, kernel, original in saved:
            setattr(module, kernel, original)


def _stack(layers: int, channels: int, relu: bool) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods.append(nn.Conv2d(channels, channels, 3, padding=1))
        if relu:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def host_costs(
    repeats: int = 15, layers: int = 20, channels: int = 8, size: int = 8, steps: int = 50
) -> list[dict[str, Any]]:
    """One row per stack (convs; conv + ReLU pairs): microseconds per layer of a forward and
    backward, plain and with quant 4-bit (launches stubbed), the fastest of ``repeats`` rounds
    of ``steps`` steps (noise on a shared machine only adds time), and the difference:
    DropIT's host time per layer."""
    x0 = torch.randn(1, channels, size, size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host work is one thread's; a pool on 8x8 maps adds only jitter
    try:
        return _rows(x0, repeats, layers, channels, steps)
    finally:
        torch.set_num_threads(threads)


def _rows(x0: torch.Tensor, repeats: int, layers: int, channels: int, steps: int) -> list[dict]:
    def steps_of(model: nn.Module):
        def run() -> None:
            for _ in range(steps):
                model(x0.clone().requires_grad_(True)).sum().backward()

        return run

    rows = []
    for what, relu in (("conv", False), ("conv+relu", True)):
        plain = _stack(layers, channels, relu)
        dropit = to_dropit(copy.deepcopy(plain), strategy="quant", bits=4, strict=False)
        with stubbed_launches():
            times = timed_rounds([steps_of(plain), steps_of(dropit)], repeats)
        plain_us, dropit_us = (min(t) / steps / layers * 1e6 for t in times)
        rows.append(
            {
                "stack": what,
                "plain_us": round(plain_us, 1),
                "dropit_us": round(dropit_us, 1),
                "extra_us": round(dropit_us - plain_us, 1),
                "layers": layers,
                "threads": 1,
            }
        )
    return rows


def is_host_rows(data: Any) -> bool:
    """Whether JSON data read from a file is ``--host`` rows."""
    return (
        isinstance(data, list)
        and bool(data)
        and all(isinstance(r, dict) and "stack" in r and "extra_us" in r for r in data)
    )


def host_markdown(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of ``--host`` rows."""
    lines = [
        "| stack | plain, µs per layer | quant 4-bit, launches stubbed | DropIT's host time |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['stack']} | {r['plain_us']:.1f} | {r['dropit_us']:.1f} | {r['extra_us']:+.1f} |"
        for r in rows
    ]
    return "\n".join(lines)

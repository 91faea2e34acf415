"""Host time of a DropIT layer on the GPU path, on any machine (``tools/bench.py host``).

The layers' Python, pack bookkeeping and kernel wrappers run on tiny CPU tensors with the Triton
launches stubbed out, against the plain layers; each row also counts the launches per unit.
docs/benchmark.md says what the rows are; the launch's own cost needs a GPU (an H200's:
docs/results/gpu_h200_2026-11-28/probe_launch.log).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dropit_core import compress_saved, configure, to_dropit
from dropit_core.backends import kernels, triton_available
from instruments.measure.rows import rows_with
from instruments.measure.timing import timed_rounds
from rcnn_dropit.errors import UsageError

# The kernels whose launches are stubbed: every one a quant layer and a masked ReLU reach.
KERNELS = (
    ("quant", "quant_codes_kernel"),
    ("quant", "quant_rebuild_kernel"),
    ("relu", "relu_mask_kernel"),
    ("relu", "relu_mask_grad_kernel"),
)


class Launches:
    """Counts what would launch a kernel on a GPU: Triton launches (stubbed) and, inside
    :class:`_CountOps`, the aten ops that compute (views and allocations launch nothing)."""

    def __init__(self) -> None:
        self.count = 0


# Ops that allocate or alias without a kernel and are not marked as views in their schema.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_NO_KERNEL |= {"_unsafe_view", "lift_fresh", "alias"}


class _CountOps(TorchDispatchMode):
    def __init__(self, launches: Launches) -> None:
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.launches.count += 1
        return func(*args, **(kwargs or {}))


class _NoLaunch:
    """Stands in for a jit kernel: ``kernel[grid](...)`` launches nothing, and is counted."""

    def __init__(self, launches: Launches) -> None:
        self.launches = launches

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.count += 1

        return launch


@contextlib.contextmanager
def stubbed_launches() -> Iterator[Launches]:
    """Within: DropIT takes its kernel path on any tensor, and no kernel is launched; what it
    yields counts the launches stubbed."""
    if not triton_available():
        raise UsageError("host runs the kernels' wrappers: it needs triton installed")
    modules = {name: kernels(name) for name, _ in KERNELS}
    saved = [(modules[m], k, getattr(modules[m], k)) for m, k in KERNELS]
    launches = Launches()
    try:
        for module, kernel, _ in saved:
            setattr(module, kernel, _NoLaunch(launches))
        previous = configure(kernels="triton")
        yield launches
    finally:
        configure(kernels=previous.kernels)
        for module, kernel, original in saved:
            setattr(module, kernel, original)


# (stack, what DropIT converts): each against the same stack of plain layers. "bare Function"
# converts nothing to DropIT: each conv (and ReLU) becomes the least a layer written as a Python
# autograd Function can be (it saves its input, its backward is one aten call), the part of
# DropIT's host time that its work cannot remove. (The rows that took apart the hooked conv,
# which issue 68 removed, went with it: docs/results/memory.md's host-time section.)
STACKS = (
    ("conv", "layers"),
    ("conv+relu", "layers"),
    ("conv+bn+relu", "layers"),
    ("conv+bn+relu", "layers+norm"),
    ("conv+bn+relu", "saved hooks"),
    ("conv", "bare Function"),
    ("conv+relu", "bare Function"),
)

CHANNELS = 8  # of each conv; its maps are 8x8: host work, not arithmetic, is what is timed


def _stack(layers: int, stack: str) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods.append(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias="bn" not in stack))
        if "bn" in stack:
            mods.append(nn.BatchNorm2d(CHANNELS))
        if "relu" in stack:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


class _BareConvFunction(torch.autograd.Function):
    """A convolution as a Python autograd Function and nothing more: it saves its input and
    weight, and its backward is the one aten call the plain layer's C++ node makes."""

    @staticmethod
    def forward(ctx, x, weight, bias, args):
        ctx.args = args
        ctx.save_for_backward(x, weight)
        return torch.convolution(x, weight, bias, *args)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mask = [True, True, ctx.needs_input_grad[2]]
        sizes = [weight.shape[0]] if mask[2] else None
        return (
            *torch.ops.aten.convolution_backward.default(
                grad, x, weight, sizes, *ctx.args, mask
            ),
            None,
        )  # fmt: skip


class _BareConv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (self.stride, self.padding, self.dilation, False, (0, 0), self.groups)
        return _BareConvFunction.apply(x, self.weight, self.bias, args)


class _BareReLUFunction(torch.autograd.Function):
    """A ReLU as a Python autograd Function: it saves its output, as torch's does."""

    @staticmethod
    def forward(ctx, x):
        out = torch.relu(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward.default(grad, out, 0)


class _BareReLU(nn.ReLU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BareReLUFunction.apply(x)


def _bare(model: nn.Module) -> nn.Module:
    """``model`` with its convs and ReLUs as bare Python autograd Functions (same parameters)."""
    for m in model.modules():
        if type(m) is nn.Conv2d:
            m.__class__ = _BareConv
        elif type(m) is nn.ReLU:
            m.__class__ = _BareReLU
    return model


def _dropit(plain: nn.Module, dropit: str) -> nn.Module:
    """A copy of ``plain`` with quant 4-bit: its conv (and ReLU) layers, its norms too, or every
    saved tensor through :func:`dropit_core.compress_saved` (no layer converted); or with its
    layers as bare autograd Functions (no DropIT)."""
    model = copy.deepcopy(plain)
    if dropit == "bare Function":
        return _bare(model)
    if dropit == "saved hooks":
        compress_saved(model, bits=4, min_bytes=1024)  # the maps, not BatchNorm's statistics
        return model
    return to_dropit(model, strategy="quant", bits=4, strict=False, norm=dropit == "layers+norm")


def host_costs(repeats: int = 15, layers: int = 20, steps: int = 50) -> list[dict[str, Any]]:
    """One row per stack of :data:`STACKS`: microseconds per unit (a conv and what follows it)
    of a forward and backward, plain and with quant 4-bit (launches stubbed), the fastest of
    ``repeats`` rounds of ``steps`` steps (noise on a shared machine only adds time), and the
    difference: DropIT's host time per unit; and the launches per unit of each."""
    x0 = torch.randn(1, CHANNELS, 8, 8)  # BatchNorm's statistics: over 64 positions
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host work is one thread's; a pool on 8x8 maps adds only jitter
    try:
        return _rows(x0, repeats, layers, steps)
    finally:
        torch.set_num_threads(threads)


def _rows(x0: torch.Tensor, repeats: int, layers: int, steps: int) -> list[dict]:
    def steps_of(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            for _ in range(steps):
                model(x0.clone().requires_grad_(True)).sum().backward()

        return run

    # Every way of converting one stack is timed in the same rounds as its plain layers, in
    # turn: rows of one stack compare side by side, whatever the machine's speed drifts to.
    by_stack: dict[str, list[str]] = {}
    for stack, dropit in STACKS:
        by_stack.setdefault(stack, []).append(dropit)
    rows: dict[tuple[str, str], dict] = {}
    for stack, ways in by_stack.items():
        plain = _stack(layers, stack)
        models = [plain, *(_dropit(plain, way) for way in ways)]
        with stubbed_launches() as launches:
            times = timed_rounds([steps_of(m) for m in models], repeats)
            counts = [_launches_per_step(m, x0, launches) / layers for m in models]
        plain_us, *dropit_us = (min(t) / steps / layers * 1e6 for t in times)
        for way, us, count in zip(ways, dropit_us, counts[1:], strict=True):
            rows[stack, way] = {
                "stack": stack,
                "dropit": way,
                "plain_us": round(plain_us, 1),
                "dropit_us": round(us, 1),
                "extra_us": round(us - plain_us, 1),
                "plain_launches": round(counts[0], 2),
                "dropit_launches": round(count, 2),
                "layers": layers,
                "threads": 1,
            }
    return [rows[key] for key in STACKS]


def _launches_per_step(model: nn.Module, x0: torch.Tensor, launches: Launches) -> int:
    """Launches of one forward and backward (the input's copy and the loss included, as in the
    timed steps)."""
    launches.count = 0
    with _CountOps(launches):
        model(x0.clone().requires_grad_(True)).sum().backward()
    return launches.count


def is_host_rows(data: Any) -> bool:
    """Whether JSON data read from a file is ``host`` rows."""
    return rows_with(data, "stack", "extra_us")


def host_markdown(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of ``host`` rows (rows measured before the launch counts and the
    norm stacks: their columns only)."""
    counted = all("dropit_launches" in r for r in rows)
    head = "| stack | plain, µs per layer | quant 4-bit, launches stubbed | DropIT's host time |"
    rule = "|---|---:|---:|---:|"
    if counted:
        head = (
            "| stack | DropIT on | plain, µs per unit | DropIT, launches stubbed "
            "| DropIT's host time | launches per unit, plain → DropIT |"
        )
        rule = "|---|---|---:|---:|---:|---:|"
    lines = [head, rule]
    for r in rows:
        cells = [r["stack"]]
        if counted:
            cells.append(r["dropit"])
        cells += [f"{r['plain_us']:.1f}", f"{r['dropit_us']:.1f}", f"{r['extra_us']:+.1f}"]
        if counted:
            cells.append(f"{r['plain_launches']:g} → {r['dropit_launches']:g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

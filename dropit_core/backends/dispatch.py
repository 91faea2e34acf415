"""Which implementation runs each DropIT op on a tensor: one table, one choice.

Eager torch is the reference and runs every op and setting. :data:`TABLE` lists, per op, the
faster implementations, ``triton`` and ``native`` (the CPU's C loops), each with what it takes of
the tensor; :func:`choose` picks by the settings (:mod:`dropit_core.settings`), the tensor's
device and dtype, and the backends the op's own setting allows (:func:`quant_backends`). Every
implementation writes the same bytes. No sync and no environment read per call: every layer asks,
on each pack and rebuild (host time).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from dropit_core import settings
from dropit_core.backends import native
from dropit_core.formats.quant import whole_bytes

ENV = settings.ENVIRONMENT["kernels"]
FAST = ("triton", "native")  # every faster backend: what an op's setting allows by default


def _fp32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous()


def _any(t: torch.Tensor) -> bool:
    return True


RELU_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the ReLU kernels'


# op -> {backend: what it takes of the tensor}, fastest first; eager (not listed) takes all.
TABLE: dict[str, dict[str, Callable[[torch.Tensor], bool]]] = {
    "quant_pack": {"triton": _any, "native": _fp32},  # fp32 read as itself or through a cast
    "quant_rebuild": {"triton": _any, "native": _any},  # the codes' device: fp32 values made
    "quant_signed": {"triton": _any},  # pack and rebuild with sign and zero flags
    "relu_mask": {"triton": lambda t: t.dtype in RELU_FLOATS, "native": _fp32},
    "relu_grad": {"triton": _any, "native": _fp32},
    "radix_select": {"triton": _any},  # the k-th largest magnitude's histograms
    "compact": {"triton": _any},  # the element-wise packs' compaction and scatter
}


def choose(op: str, t: torch.Tensor, allowed: tuple[str, ...] = FAST) -> str:
    """``"triton"``, ``"native"`` or ``"eager"``: what runs ``op`` on ``t``, of the ``allowed``."""
    mode = settings.current()
    kernels = mode.kernels
    if kernels == "eager":
        return "eager"
    ways = TABLE[op]
    if kernels == "triton" or t.is_cuda:  # the kernels or eager, never the C loops
        take = ways.get("triton")
        if take is not None and "triton" in allowed and (_has_triton or _no_triton(kernels)):
            if take is _any or take(t):
                return "triton"
    elif mode.loops and t.device.type == "cpu":
        take = ways.get("native")
        if take is not None and "native" in allowed and take(t) and native.library() is not None:
            return "native"
    return "eager"


MAX_KERNEL_GROUP = 8192  # values of a quant group one Triton program holds in its registers


def quant_kernels_take(bits: int, group: int) -> bool:
    """Whether the Triton kernels pack this quant setting: each group's codes whole bytes, and a
    group small enough for one program's registers; other settings run eager (same format)."""
    return whole_bytes(bits, group) and group <= MAX_KERNEL_GROUP


def quant_backends(bits: int, group: int, signs: bool = False) -> tuple[str, ...]:
    """The backends besides eager that take this quant setting (:func:`choose`'s ``allowed``);
    with ``signs`` (``CompressSaved``'s pack) the kernels alone, for groups of whole flag bytes."""
    if signs:
        return ("triton",) if quant_kernels_take(bits, group) and group % 8 == 0 else ()
    if quant_kernels_take(bits, group):
        return FAST
    return ("native",) if whole_bytes(bits, group) else ()


def fused(allowed: bool = True) -> bool:
    """While compiling: whether a pack or mask that ``allowed`` it is fused torch ops (``fuse``:
    off by default: on the CPU it compiled several times longer for a step hardly faster)."""
    return allowed and settings.current().fuse


def _no_triton(mode: str) -> bool:
    """False, where triton is missing: an error when the kernels are forced, else a warning."""
    global _warned
    if mode == "triton":
        raise RuntimeError(f"{ENV}=triton, but triton is not installed")
    if not _warned:
        _warned = True
        warnings.warn(
            "DropIT: triton is not installed; CUDA tensors use the eager torch path (slower)",
            RuntimeWarning,
            stacklevel=2,
        )
    return False


_warned = False


def pack_backend(device: torch.device | str) -> str:
    """Which path packs and rebuilds a 4-bit layer's tensors on ``device``: ``"triton"``,
    ``"native"`` or ``"eager"`` (torch ops, several launches each); what a run says once."""
    return choose("quant_rebuild", torch.empty(0, device=torch.device(device)))


def triton_available() -> bool:
    """Whether triton can be imported (looked up, not imported: cheap to ask per layer)."""
    return _has_triton


try:
    _has_triton = importlib.util.find_spec("triton") is not None
except (ImportError, ValueError):  # a broken install, or sys.modules["triton"] = None
    _has_triton = False


@functools.cache
def kernels(name: str) -> ModuleType:
    """The kernels module ``dropit_core.backends.triton.<name>``, imported on the first call (it
    imports triton), then held (an import statement per pack was host time)."""
    return importlib.import_module(f"{__package__}.triton.{name}")

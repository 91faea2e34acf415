"""Convert the layers of any ``nn.Module`` to DropIT in place, by module-path patterns, and back.

Conversion swaps the class of matching ``nn.Conv2d``, ``nn.ConvTranspose2d``, ``nn.Linear`` and
``nn.ReLU`` modules (with ``norm=True`` also ``nn.BatchNorm2d``, ``nn.SyncBatchNorm`` and
``nn.GroupNorm``: :mod:`dropit_core.norm`; with ``pool=True`` ``nn.MaxPool2d``:
:mod:`dropit_core.pooling`) for a DropIT subclass: parameters, buffers, hooks and
``state_dict()`` stay exactly as they were, so optimizers, checkpoints and DDP see the same model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from . import hooked, ops, traced
from .norm import NORM_CLASSES
from .ops import (
    ConvArgs,
    DropITConvFunction,
    DropITLinearFunction,
    InputCache,
    MaskedReLUFunction,
    autocast_inputs,
)
from .pooling import DropITMaxPool2d
from .rules import (
    Rule,
    assign_layers,
    check_rules,
)
from .saved import saved_compression

M = TypeVar("M", bound=nn.Module)


def _training_step(module: nn.Module, x: torch.Tensor) -> bool:
    # In eval, under no_grad, or for a frozen layer fed a constant, run the plain op: zero
    # selection work.
    return (
        module.training
        and torch.is_grad_enabled()
        and (module.weight.requires_grad or x.requires_grad)
        and x.numel() > 0  # an empty batch (a head without RoIs) keeps nothing either way
    )


class DropITConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose weight gradient is computed from a dropped input cache."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _training_step(self, x):
            return super().forward(x)
        if x.dim() == 3:  # an unbatched (C, H, W) input, as nn.Conv2d takes
            return self.forward(x.unsqueeze(0)).squeeze(0)
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        elif isinstance(padding, str):
            x, padding = _explicit_padding(x, padding, self.kernel_size, self.dilation)
        weight, bias, cache = self.weight, self.bias, self.dropit_cache  # one module lookup each
        if torch.compiler.is_compiling():
            args = ConvArgs(
                list(self.stride), list(padding), list(self.dilation), False, [0, 0], self.groups
            )
            return _compiling_conv(x, weight, bias, args, cache)
        # The module's tuples as they are: aten takes them so (a list of each per call was
        # host time, on every layer of every step).
        args = ConvArgs(self.stride, padding, self.dilation, False, _NO_OUTPUT_PADDING, self.groups)
        return _eager_conv(x, weight, bias, args, cache)


_NO_OUTPUT_PADDING = (0, 0)


def _eager_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: ConvArgs,
    cache: InputCache,
) -> torch.Tensor:
    """The DropIT convolution (plain or transposed) eagerly: aten's own autograd node with its
    input packed through a saved-tensor hook where that does what the Function does (less host
    time: dropit_core.hooked), else the autograd Function."""
    w, b, dtype = autocast_inputs(x, weight, bias, cache)
    # ops.SPLIT_BYTES read here, not copied at import: one threshold for both sides of the split
    if hooked.takes(x, w, dtype, ops.SPLIT_BYTES):
        return hooked.conv(x, w, b, args, cache.saved_hooks, dtype)
    return DropITConvFunction.apply(x, w, b, args, cache, dtype)


def _compiling_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: ConvArgs,
    cache: InputCache,
) -> torch.Tensor:
    """The DropIT convolution while compiling: the traced operators (strategies whose pack sizes
    depend on the data: the autograd Function, behind a graph break)."""
    if traced.traceable(cache):
        w, b, dtype = traced.autocast_inputs(x, weight, bias)
        return traced.conv(x, w, b, args, cache, dtype)
    return _conv_behind_break(x, weight, bias, args, cache)


def _compiling_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: InputCache
) -> torch.Tensor:
    """The DropIT linear layer while compiling (as :func:`_compiling_conv`)."""
    if traced.traceable(cache):
        w, b, dtype = traced.autocast_inputs(x, weight, bias)
        return traced.linear(x, w, b, cache, dtype)
    return _linear_behind_break(x, weight, bias, cache)


# A graph break, stated in dropit_core.traced (decorated copies: the eager path pays no wrapper).
@torch.compiler.disable
def _conv_behind_break(x, weight, bias, args: ConvArgs, cache: InputCache) -> torch.Tensor:
    w, b, dtype = autocast_inputs(x, weight, bias, cache)
    return DropITConvFunction.apply(x, w, b, args, cache, dtype)


@torch.compiler.disable
def _linear_behind_break(x, weight, bias, cache: InputCache) -> torch.Tensor:
    w, b, dtype = autocast_inputs(x, weight, bias, cache)
    return DropITLinearFunction.apply(x, w, b, cache, dtype)


def _explicit_padding(x, padding: str, kernel_size, dilation) -> tuple[torch.Tensor, tuple]:
    if padding == "valid":
        return x, (0, 0)
    pads = []
    for k, d in zip(reversed(kernel_size), reversed(dilation), strict=True):
        total = d * (k - 1)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads), (0, 0)


class DropITConvTranspose2d(nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` whose weight gradient is computed from a dropped input cache."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if not _training_step(self, x):
            return super().forward(x, output_size)
        if x.dim() == 3:  # an unbatched (C, H, W) input, as nn.ConvTranspose2d takes
            return self.forward(x.unsqueeze(0), output_size).squeeze(0)
        output_padding = self._output_padding(
            x, output_size, list(self.stride), list(self.padding), list(self.kernel_size), 2,
            list(self.dilation),
        )  # fmt: skip
        args = ConvArgs(
            list(self.stride),
            list(self.padding),
            list(self.dilation),
            True,
            list(output_padding),
            self.groups,
        )
        if torch.compiler.is_compiling():
            return _compiling_conv(x, self.weight, self.bias, args, self.dropit_cache)
        return _eager_conv(x, self.weight, self.bias, args, self.dropit_cache)


class DropITLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient is computed from a dropped input cache."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _training_step(self, x):
            return super().forward(x)
        if torch.compiler.is_compiling():
            return _compiling_linear(x, self.weight, self.bias, self.dropit_cache)
        w, b, dtype = autocast_inputs(x, self.weight, self.bias, self.dropit_cache)
        return DropITLinearFunction.apply(x, w, b, self.dropit_cache, dtype)


class DropITReLU(nn.ReLU):
    """``nn.ReLU`` that keeps a 1-bit mask of its output for backward, not the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled() and x.requires_grad):
            return super().forward(x)
        if torch.compiler.is_compiling():
            return traced.relu(x, self.inplace)
        return MaskedReLUFunction.apply(x, self.inplace)


_DROPIT_CLASS: dict[type, type] = {
    nn.Conv2d: DropITConv2d,
    nn.ConvTranspose2d: DropITConvTranspose2d,
    nn.Linear: DropITLinear,
    nn.ReLU: DropITReLU,
    **NORM_CLASSES,
    nn.MaxPool2d: DropITMaxPool2d,
}
_PLAIN_CLASS = {v: k for k, v in _DROPIT_CLASS.items()}
_DROPIT_NORMS = frozenset(NORM_CLASSES.values())
_NORM_KINDS = frozenset(plain.__name__ for plain in NORM_CLASSES)  # as ConvertedLayer.kind
# Layers that keep what their backward reads without a strategy's pack: how the record names it.
_UNCACHED = {nn.ReLU: "relu-mask", nn.MaxPool2d: "pool-winner-byte"}


@dataclass(frozen=True)
class ConvertedLayer:
    """One converted module: its dotted path, its original kind, the strategy it uses and the
    rule that chose it (its index in ``rules``; 0 without rules)."""

    path: str
    kind: str
    strategy: str
    rule: int = 0


@dataclass(frozen=True)
class AppliedSetting:
    """One DropIT setting as ``to_dropit`` applied it (one per rule; one without rules)."""

    rule: int | None  # its index in ``rules``; None without rules
    strategy: str  # the registry name, e.g. "mink"
    gamma: float  # as given (strategies with uses_gamma=False ignore it)
    options: dict[str, Any]  # the strategy options as given (defaults not filled in)
    description: str  # e.g. "mink(gamma=0.8)", as the layers' entries show it
    include: tuple[str, ...]
    exclude: tuple[str, ...]  # the call's exclude included
    layers: int  # conv/linear layers converted
    relus: int  # ReLUs converted to a 1-bit mask
    norms: int = 0  # normalisation layers whose input is packed (norm=True)
    pools: int = 0  # max-pools keeping one byte per output (pool=True)


class DropITRecord(list):
    """What ``to_dropit`` converted: a list of :class:`ConvertedLayer` in model order,
    plus ``settings`` (which strategy and gamma each rule applied, and to how many layers) and
    ``skipped`` (layers left plain because they run inside a checkpointed module)."""

    def __init__(
        self,
        layers: Sequence[ConvertedLayer] = (),
        settings: Sequence[AppliedSetting] = (),
        skipped: Sequence[str] = (),
    ) -> None:
        super().__init__(layers)
        self.settings = tuple(settings)
        self.skipped = tuple(skipped)

    def summary(self) -> str:
        """One line per setting, e.g. ``DropIT mink(gamma=0.8): 9 conv/linear layers and 4 ReLUs
        (include *; exclude backbone.body.conv1)``."""
        lines = []
        for s in self.settings:
            name = "DropIT" if s.rule is None else f"DropIT rules[{s.rule}]"
            where = f"include {', '.join(s.include)}"
            if s.exclude:
                where += f"; exclude {', '.join(s.exclude)}"
            extra = f", {s.norms} normalisation layers" if s.norms else ""
            extra += f", {s.pools} max-pools" if s.pools else ""
            lines.append(
                f"{name} {s.description}: {s.layers} conv/linear layers{extra} and {s.relus} "
                f"ReLUs ({where})"
            )
        if self.skipped:
            lines.append(
                f"left plain inside checkpointed modules: {len(self.skipped)} layers "
                f"({', '.join(self.skipped)})"
            )
        return "\n".join(lines)


def to_dropit(
    model: M,
    strategy: str = "mink",
    gamma: float = 0.8,
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = (),
    relu: bool = True,
    rules: Sequence[Mapping[str, Any]] | None = None,
    norm: bool = False,
    pool: bool = False,
    strict: bool = True,
    **options: Any,
) -> M:
    """Convert matching conv/linear layers (and ReLUs, when ``relu``; BatchNorm2d, SyncBatchNorm
    and GroupNorm, when ``norm``; MaxPool2d, when ``pool``) to DropIT, in place.

    ``relu``: a ReLU keeps a 1-bit mask of its output (exact). ``norm``: a trainable norm keeps
    its input packed by the strategy, which must keep every element (``quant``); the input
    gradient is then approximate (:mod:`dropit_core.norm`). ``pool``: a max-pool keeps one byte
    per output instead of its input and int64 indices (exact).

    ``include``/``exclude`` are fnmatch patterns on module paths as ``named_modules()`` gives them;
    a pattern also covers the modules below the one it names. ``options`` go to the strategy
    (e.g. ``chunk=16384``, ``values="int8"``), checked against its declaration in
    ``dropit_core.REGISTRY``. ``rules``: per-group settings, e.g. ``[{"include": ["backbone"],
    "gamma": 0.8}, {"include": ["roi_heads"], "strategy": "quant", "options": {"bits": 4}}]``;
    a rule's missing keys fall back to the arguments above and ``exclude`` applies to every rule
    (see :mod:`dropit_core.rules`). Each rule packs through its own cache. Layers inside a module
    whose class sets ``dropit_checkpointed = True`` (activation checkpointing) stay plain: the
    record lists them as ``skipped``. A pattern that matches no module is an error, unless
    ``strict=False`` (e.g. ``exclude=PAPER_EXCLUDE`` on a Faster R-CNN, which has no mask
    branch).

    Returns ``model`` itself, as torch's converters (``convert_sync_batchnorm``) do. What was
    converted is :func:`dropit_record` ``(model)``:
    a :class:`DropITRecord`, a list of :class:`ConvertedLayer` that also says which settings were
    applied (``record.settings``, ``record.summary()``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_dropit takes an nn.Module, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise ValueError(f"to_dropit strict={strict!r} must be True or False")
    if type(model) in _DROPIT_CLASS:  # the norms and the max-pool included
        raise ValueError(
            f"to_dropit converts the layers inside a model, not the model itself: wrap this "
            f"{type(model).__name__}, e.g. nn.Sequential(layer)"
        )
    checked = check_rules(rules, strategy, gamma, include, exclude, relu, norm, pool, **options)
    named = [(p, m) for p, m in model.named_modules() if p]
    already = [p for p, m in named if type(m) in _PLAIN_CLASS]
    if already:
        raise ValueError(f"model already has DropIT layers (e.g. {already[0]}); call from_dropit")
    chosen = assign_layers(named, checked, tuple(exclude), _DROPIT_CLASS, strict)
    # Under checkpointing a layer's forward runs twice and its saved tensors are dropped anyway:
    # leave the layers of checkpointed modules plain (the patterns were checked above).
    regions = [p for p, m in [("", model), *named] if _checkpointed(m)]
    skipped = [path for path, _, _ in chosen if any(_inside(path, r) for r in regions)]
    if skipped:
        left_plain = frozenset(skipped)
        chosen = [item for item in chosen if item[0] not in left_plain]
    caches = {id(rule): InputCache(rule.strategy, stream=rule.index or 0) for rule in checked}
    layers: list[ConvertedLayer] = []
    for path, module, rule in chosen:  # convert only once everything is validated
        plain = type(module)
        module.__class__ = _DROPIT_CLASS[plain]
        if plain not in _UNCACHED:
            module.dropit_cache = caches[id(rule)]
        label = _UNCACHED.get(plain) or rule.strategy.describe()
        layers.append(ConvertedLayer(path, plain.__name__, label, rule.index or 0))
    record = DropITRecord(layers, [_applied(rule, chosen) for rule in checked], skipped)
    # A plain attribute (not a buffer): outside state_dict, copied by deepcopy and pickle.
    model.__dict__[_RECORD_ATTRIBUTE] = record
    return model


_RECORD_ATTRIBUTE = "_dropit_record"


def dropit_record(model: nn.Module) -> DropITRecord:
    """What :func:`to_dropit` converted in ``model`` and is still converted: its layers in model
    order and settings (a part turned back by :func:`from_dropit` is no longer counted)."""
    record = model.__dict__.get(_RECORD_ATTRIBUTE)
    if record is None:
        raise ValueError(
            f"{type(model).__name__} has no DropIT record: it was not converted by to_dropit, or "
            "from_dropit undid it (for a DistributedDataParallel or compiled model, pass the "
            "module that to_dropit converted)"
        )
    # from_dropit on a part turns its layers back without reaching the whole's record: read
    # which layers are still DropIT ones instead of trusting the list made at conversion.
    modules = dict(model.named_modules())
    live = [layer for layer in record if type(modules.get(layer.path)) in _PLAIN_CLASS]
    if len(live) == len(record):
        return record
    return DropITRecord(live, [_recount(s, live) for s in record.settings], record.skipped)


def _recount(setting: AppliedSetting, layers: Sequence[ConvertedLayer]) -> AppliedSetting:
    """``setting`` with its counts taken from ``layers`` (those its rule converted)."""
    kinds = [layer.kind for layer in layers if layer.rule == (setting.rule or 0)]
    relus = kinds.count(nn.ReLU.__name__)
    pools = kinds.count(nn.MaxPool2d.__name__)
    norms = sum(kind in _NORM_KINDS for kind in kinds)
    return replace(
        setting, layers=len(kinds) - relus - pools - norms, relus=relus, norms=norms, pools=pools
    )


# A module whose class sets this attribute to True runs its forward under activation
# checkpointing (dropit_core.recompute sets it): to_dropit leaves the layers inside it plain.
CHECKPOINTED_ATTRIBUTE = "dropit_checkpointed"


def _checkpointed(module: nn.Module) -> bool:
    return getattr(type(module), CHECKPOINTED_ATTRIBUTE, False) is True


def _inside(path: str, region: str) -> bool:
    return region == "" or path == region or path.startswith(region + ".")


def _applied(rule: Rule, chosen: list[tuple[str, nn.Module, Rule]]) -> AppliedSetting:
    kinds = [type(m) for _, m, r in chosen if r is rule]
    relus = sum(k is DropITReLU for k in kinds)
    norms = sum(k in _DROPIT_NORMS for k in kinds)
    pools = sum(k is DropITMaxPool2d for k in kinds)
    return AppliedSetting(
        rule.index,
        rule.strategy.name,
        rule.gamma,
        dict(rule.options),
        rule.strategy.describe(),
        rule.include,
        rule.exclude,
        len(kinds) - relus - norms - pools,
        relus,
        norms,
        pools,
    )


def from_dropit(model: M) -> M:
    """Turn every DropIT layer of ``model`` back into its plain class, in place; its record
    (:func:`dropit_record`) goes too. Given a part of the module ``to_dropit`` converted, it
    turns that part back, and the whole's record no longer counts the part's layers."""
    for module in model.modules():
        module.__dict__.pop(_RECORD_ATTRIBUTE, None)  # to_dropit may have converted a submodule
        plain = _PLAIN_CLASS.get(type(module))
        if plain is None:
            continue
        module.__class__ = plain
        module.__dict__.pop("dropit_cache", None)
    return model


def set_step(model: nn.Module, step: int, rank: int = 0) -> None:
    """Seed the random draws of ``model``'s DropIT layers (and of :func:`compress_saved`'s
    block, where it is attached) for training step ``step``.

    Call it before each training forward (with the iteration a resumed run also counts): every
    pack that draws is then seeded from the strategy's ``seed``, the step, ``rank`` and the pack's
    place in the forward, so a resumed run draws exactly what the uninterrupted one did. Under
    DDP pass the process rank, so that ranks draw independently. Strategies that draw nothing
    ignore it; a model without DropIT layers is left as it is.
    """
    for name, value in (("step", step), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"DropIT set_step {name}={value!r} is invalid: allowed integers >= 0")
    caches = [getattr(m, "dropit_cache", None) for m in model.modules()]
    for cache in {id(c): c for c in caches if c is not None}.values():
        cache.set_step(step, rank)
    for module in model.modules():
        saved = saved_compression(module)
        if saved is not None:
            saved.set_step(step, rank)


def dropped_values(model: nn.Module) -> int:
    """How many values the DropIT layers of ``model`` chose to keep but could not store.

    Element-wise packs on a GPU hold a capacity sized from the input's shape, so that no host
    waits for the device; one that chose more (an estimate far off, see
    :mod:`dropit_core.elementwise`) stores the first ones and counts the rest, which rebuild as
    zeros. Counted on the device since conversion; this reads it (one host sync: call it where a
    step syncs anyway, e.g. when logging). Always 0 on the CPU, where packs fit their count.
    """
    caches = [getattr(m, "dropit_cache", None) for m in model.modules()]
    unique = {id(c): c for c in caches if c is not None}
    counts = [c.dropped for c in unique.values() if c.dropped is not None]
    return int(sum(counts)) if counts else 0


def is_dropit(module: nn.Module) -> bool:
    """Whether ``module`` is a converted DropIT layer."""
    return type(module) in _PLAIN_CLASS

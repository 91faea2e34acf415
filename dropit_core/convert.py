"""Convert the layers of any ``nn.Module`` to DropIT in place, by module-path patterns, and back.

Conversion swaps the class of matching ``nn.Conv2d``, ``nn.ConvTranspose2d``, ``nn.Linear`` and
``nn.ReLU`` modules (with ``norm=True`` also ``nn.BatchNorm2d``, ``nn.SyncBatchNorm`` and
``nn.GroupNorm``: :mod:`dropit_core.layers.norm`; with ``pool=True`` ``nn.MaxPool2d``:
:mod:`dropit_core.layers.pooling`) for a DropIT subclass: parameters, buffers, hooks and
``state_dict()`` stay exactly as they were, so optimizers, checkpoints and DDP see the same model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from torch import nn

from dropit_core.layers.functions import (
    InputCache,
)
from dropit_core.layers.modules import DropITConv2d, DropITConvTranspose2d, DropITLinear, DropITReLU
from dropit_core.layers.norm import NORM_CLASSES
from dropit_core.layers.pooling import DropITMaxPool2d
from dropit_core.rules import Rule, assign_layers, check_rules
from dropit_core.saved import saved_compression

M = TypeVar("M", bound=nn.Module)


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
    gradient is then approximate (:mod:`dropit_core.layers.norm`). ``pool``: a max-pool keeps one
    byte per output instead of its input and int64 indices (exact).

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
    :mod:`dropit_core.strategies.elementwise`) stores the first ones and counts the rest, which
    rebuild as zeros. Counted on the device since conversion; this reads it (one host sync: call it
    where a step syncs anyway, e.g. when logging). Always 0 on the CPU, where packs fit their count.
    """
    caches = [getattr(m, "dropit_cache", None) for m in model.modules()]
    unique = {id(c): c for c in caches if c is not None}
    counts = [c.dropped for c in unique.values() if c.dropped is not None]
    return int(sum(counts)) if counts else 0


def is_dropit(module: nn.Module) -> bool:
    """Whether ``module`` is a converted DropIT layer."""
    return type(module) in _PLAIN_CLASS

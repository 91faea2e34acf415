"""Convert the layers of any ``nn.Module`` to DropIT in place, by module-path patterns, and back.

Conversion swaps the class of each matching layer for its DropIT subclass: parameters, buffers,
hooks and ``state_dict()`` stay as they were, so optimizers, checkpoints and DDP see one model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from torch import nn

from dropit_core.layers.cache import InputCache
from dropit_core.layers.conv import DropITConv2d, DropITConvTranspose2d
from dropit_core.layers.linear import DropITLinear
from dropit_core.layers.norm import NORM_CLASSES
from dropit_core.layers.pooling import DropITMaxPool2d
from dropit_core.layers.relu import DropITReLU
from dropit_core.readers import masks_that_free_nothing
from dropit_core.rules import RELU_ALL, Rule, assign_layers, check_rules
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
_NORM_KINDS = frozenset(plain.__name__ for plain in NORM_CLASSES)  # as ConvertedLayer.kind
# Layers that keep what their backward reads without a strategy's pack: how the record names it.
_UNCACHED = {nn.ReLU: "relu-mask", nn.MaxPool2d: "pool-winner-byte"}
# Plain layers (and their subclasses) whose backward keeps their whole input: all but the ReLU
_KEEP_INPUT = tuple(plain for plain in _DROPIT_CLASS if plain is not nn.ReLU)


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
    """What ``to_dropit`` converted: a list of :class:`ConvertedLayer` in model order, plus
    ``settings`` (one per rule) and ``skipped`` (layers left plain inside checkpointed modules)."""

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
    relu: bool | str = True,
    rules: Sequence[Mapping[str, Any]] | None = None,
    norm: bool = False,
    pool: bool = False,
    strict: bool = True,
    **options: Any,
) -> M:
    """Convert matching conv/linear layers to DropIT, in place, and return ``model``; with
    ``relu`` also the ReLUs whose 1-bit mask frees their output (``"all"``: every one selected),
    with ``norm`` BatchNorm2d, SyncBatchNorm and GroupNorm, with ``pool`` MaxPool2d.
    ``include``/``exclude``: fnmatch patterns on module paths (one that matches nothing is an
    error unless ``strict=False``); ``options``: the strategy's; ``rules``: per-group settings
    (:mod:`dropit_core.rules`). docs/dropit.md, "Which modules convert", says the rest.
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
    regions = [p for p, m in [("", model), *named] if is_checkpointed(m)]
    skipped = [path for path, _, _ in chosen if any(_inside(path, r) for r in regions)]
    left_plain = frozenset(skipped)
    chosen = [item for item in chosen if item[0] not in left_plain]
    chosen = _masks_that_free(model, chosen, regions)
    caches = {id(rule): InputCache(rule.strategy, stream=rule.index or 0) for rule in checked}
    layers: list[ConvertedLayer] = []
    for path, module, rule in chosen:  # convert only once everything is validated
        plain = type(module)
        module.__class__ = _DROPIT_CLASS[plain]
        if plain not in _UNCACHED:
            module.dropit_cache = caches[id(rule)]
        label = _UNCACHED.get(plain) or rule.strategy.describe()
        layers.append(ConvertedLayer(path, plain.__name__, label, rule.index or 0))
    record = DropITRecord(layers, [_applied(rule, layers) for rule in checked], skipped)
    # A plain attribute (not a buffer): outside state_dict, copied by deepcopy and pickle.
    model.__dict__[_RECORD_ATTRIBUTE] = record
    return model


_RECORD_ATTRIBUTE = "_dropit_record"


def _masks_that_free(
    model: nn.Module, chosen: list[tuple[str, nn.Module, Rule]], regions: list[str]
) -> list[tuple[str, nn.Module, Rule]]:
    """``chosen`` without the ReLUs (but of rules with ``relu="all"``) whose every call's output a
    layer left plain that keeps its input, or a checkpointed module, keeps whole."""
    modules = dict(model.named_modules())
    converted = {path for path, _, _ in chosen}
    units = frozenset(regions)

    def keeps_whole(path: str) -> bool:
        return path in units or (isinstance(modules[path], _KEEP_INPUT) and path not in converted)

    idle = frozenset(masks_that_free_nothing(model, keeps_whole, units))
    return [item for item in chosen if item[0] not in idle or item[2].relu == RELU_ALL]


def dropit_record(model: nn.Module) -> DropITRecord:
    """What :func:`to_dropit` converted in ``model`` and is still converted, with its settings."""
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
    settings = [replace(s, **_counts(s.rule, live)) for s in record.settings]
    return DropITRecord(live, settings, record.skipped)


def _counts(rule: int | None, layers: Sequence[ConvertedLayer]) -> dict[str, int]:
    """AppliedSetting's counts of the ``layers`` rule ``rule`` converted."""
    kinds = [layer.kind for layer in layers if layer.rule == (rule or 0)]
    relus = kinds.count(nn.ReLU.__name__)
    pools = kinds.count(nn.MaxPool2d.__name__)
    norms = sum(kind in _NORM_KINDS for kind in kinds)
    return dict(layers=len(kinds) - relus - pools - norms, relus=relus, norms=norms, pools=pools)


def _applied(rule: Rule, layers: Sequence[ConvertedLayer]) -> AppliedSetting:
    name, description = rule.strategy.name, rule.strategy.describe()
    options = dict(rule.options)
    counts = _counts(rule.index, layers)
    return AppliedSetting(
        rule.index, name, rule.gamma, options, description, rule.include, rule.exclude, **counts
    )


# A module whose class sets this attribute to True runs its forward under activation
# checkpointing (dropit_core.recompute sets it): to_dropit leaves the layers inside it plain.
CHECKPOINTED_ATTRIBUTE = "dropit_checkpointed"


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is a unit made by :func:`~dropit_core.recompute.checkpoint_modules`."""
    return getattr(type(module), CHECKPOINTED_ATTRIBUTE, False) is True


def _inside(path: str, region: str) -> bool:
    return region == "" or path == region or path.startswith(region + ".")


def from_dropit(model: M) -> M:
    """Turn every DropIT layer of ``model`` (the whole ``to_dropit`` converted, or a part of it)
    back into its plain class, in place, and drop its record (:func:`dropit_record`)."""
    for module in model.modules():
        module.__dict__.pop(_RECORD_ATTRIBUTE, None)  # to_dropit may have converted a submodule
        plain = _PLAIN_CLASS.get(type(module))
        if plain is not None:
            module.__class__ = plain
            module.__dict__.pop("dropit_cache", None)
    return model


def set_step(model: nn.Module, step: int, rank: int = 0) -> None:
    """Seed the random draws of ``model``'s DropIT layers (and its :func:`compress_saved` block)
    for training step ``step`` on process ``rank``; call it before each training forward, so
    that a resumed run draws what the uninterrupted one did."""
    for name, value in (("step", step), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"DropIT set_step {name}={value!r} is invalid: allowed integers >= 0")
    for cache in _caches(model):
        cache.set_step(step, rank)
    for module in model.modules():
        saved = saved_compression(module)
        if saved is not None:
            saved.set_step(step, rank)


def dropped_values(model: nn.Module) -> int:
    """How many values the DropIT layers of ``model`` chose to keep but could not store (packs
    sized from the shape, on a GPU): one host sync; always 0 on the CPU."""
    counts = [c.dropped for c in _caches(model) if c.dropped is not None]
    return int(sum(counts)) if counts else 0


def _caches(model: nn.Module) -> list[InputCache]:
    """The input caches of ``model``'s DropIT layers, each once."""
    caches = [getattr(m, "dropit_cache", None) for m in model.modules()]
    return list({id(c): c for c in caches if c is not None}.values())


def is_dropit(module: nn.Module) -> bool:
    """Whether ``module`` is a converted DropIT layer."""
    return type(module) in _PLAIN_CLASS

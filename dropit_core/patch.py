"""Convert the layers of any ``nn.Module`` to DropIT in place, by module-path patterns, and back.

Conversion swaps the class of matching ``nn.Conv2d``, ``nn.ConvTranspose2d``, ``nn.Linear`` and
``nn.ReLU`` modules for a DropIT subclass: parameters, buffers, hooks and ``state_dict()`` stay
exactly as they were, so optimizers, checkpoints and DDP see the same model.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import Strategy
from .ops import (
    ConvArgs,
    DropITConvFunction,
    DropITLinearFunction,
    InputCache,
    MaskedReLUFunction,
    autocast_inputs,
)
from .strategies import build_strategy


def _training_step(module: nn.Module, x: torch.Tensor) -> bool:
    # In eval, under no_grad, or for a frozen layer fed a constant, run the plain op: zero
    # selection work.
    return (
        module.training
        and torch.is_grad_enabled()
        and (module.weight.requires_grad or x.requires_grad)
    )


class DropITConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose weight gradient is computed from a dropped input cache."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _training_step(self, x):
            return super().forward(x)
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        elif isinstance(padding, str):
            x, padding = _explicit_padding(x, padding, self.kernel_size, self.dilation)
        x, w, b, key = autocast_inputs(x, self.weight, self.bias, self.dropit_cache)
        args = ConvArgs(
            list(self.stride), list(padding), list(self.dilation), False, [0, 0], self.groups
        )
        return DropITConvFunction.apply(x, w, b, args, self.dropit_cache, key)


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
        output_padding = self._output_padding(
            x, output_size, list(self.stride), list(self.padding), list(self.kernel_size), 2,
            list(self.dilation),
        )  # fmt: skip
        x, w, b, key = autocast_inputs(x, self.weight, self.bias, self.dropit_cache)
        args = ConvArgs(
            list(self.stride),
            list(self.padding),
            list(self.dilation),
            True,
            list(output_padding),
            self.groups,
        )
        return DropITConvFunction.apply(x, w, b, args, self.dropit_cache, key)


class DropITLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient is computed from a dropped input cache."""

    dropit_cache: InputCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _training_step(self, x):
            return super().forward(x)
        x, w, b, key = autocast_inputs(x, self.weight, self.bias, self.dropit_cache)
        return DropITLinearFunction.apply(x, w, b, self.dropit_cache, key)


class DropITReLU(nn.ReLU):
    """``nn.ReLU`` that keeps a 1-bit mask of its output for backward, not the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled() and x.requires_grad):
            return super().forward(x)
        return MaskedReLUFunction.apply(x, self.inplace)


_DROPIT_CLASS: dict[type, type] = {
    nn.Conv2d: DropITConv2d,
    nn.ConvTranspose2d: DropITConvTranspose2d,
    nn.Linear: DropITLinear,
    nn.ReLU: DropITReLU,
}
_PLAIN_CLASS = {v: k for k, v in _DROPIT_CLASS.items()}


@dataclass(frozen=True)
class ConvertedLayer:
    """One converted module: its dotted path, its original kind and the strategy it uses."""

    path: str
    kind: str
    strategy: str


def _matches(path: str, pattern: str) -> bool:
    # A pattern selects a module and everything under it ("roi_heads" covers roi_heads.*).
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + ".*")


def _check_patterns(kind: str, patterns: Sequence[str], paths: list[str]) -> None:
    if isinstance(patterns, str):
        raise ValueError(f"DropIT {kind} must be a list of patterns, got the string {patterns!r}")
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"DropIT {kind} pattern {pattern!r} is not a string")
        if not any(_matches(p, pattern) for p in paths):
            close = difflib.get_close_matches(pattern, paths, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"DropIT {kind} pattern {pattern!r} matches no module{hint}")


def check_options(strategy: str, gamma: float, relu: bool = True, **options: Any) -> Strategy:
    """Validate what ``to_dropit`` takes besides the model and patterns (strategy, gamma, relu,
    strategy options); returns the built strategy. Needs no model, so configs call it on load."""
    built = build_strategy(strategy, gamma, **options)
    if not isinstance(relu, bool):
        raise ValueError(f"DropIT option relu={relu!r} must be true or false")
    return built


def to_dropit(
    model: nn.Module,
    strategy: str = "mink",
    gamma: float = 0.8,
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = (),
    relu: bool = True,
    **options: Any,
) -> tuple[nn.Module, list[ConvertedLayer]]:
    """Convert matching conv/linear layers (and ReLUs, when ``relu``) to DropIT, in place.

    ``include``/``exclude`` are fnmatch patterns on module paths as ``named_modules()`` gives them;
    a pattern also covers the modules below the one it names. ``options`` go to the strategy
    (e.g. ``chunk=16384``, ``values="int8"``), checked against its declaration in
    ``dropit_core.REGISTRY``. Returns the model and what was converted.
    """
    built = check_options(strategy, gamma, relu, **options)
    named = [(p, m) for p, m in model.named_modules() if p]
    paths = [p for p, _ in named]
    _check_patterns("include", include, paths)
    _check_patterns("exclude", exclude, paths)
    already = [p for p, m in named if type(m) in _PLAIN_CLASS]
    if already:
        raise ValueError(f"model already has DropIT layers (e.g. {already[0]}); call from_dropit")

    chosen = [
        (path, module)
        for path, module in named
        if type(module) in _DROPIT_CLASS
        and (relu or type(module) is not nn.ReLU)
        and any(_matches(path, p) for p in include)
        and not any(_matches(path, p) for p in exclude)
    ]
    if all(type(m) is nn.ReLU for _, m in chosen):
        raise ValueError(
            f"DropIT include={list(include)} with exclude={list(exclude)} selects no "
            "Conv2d/ConvTranspose2d/Linear layer"
        )
    cache = InputCache(built)
    record: list[ConvertedLayer] = []
    for path, module in chosen:  # convert only once everything is validated
        plain = type(module)
        module.__class__ = _DROPIT_CLASS[plain]
        if plain is not nn.ReLU:
            module.dropit_cache = cache
        label = "relu-mask" if plain is nn.ReLU else built.describe()
        record.append(ConvertedLayer(path, plain.__name__, label))
    return model, record


def from_dropit(model: nn.Module) -> nn.Module:
    """Turn every DropIT layer of ``model`` back into its plain class, in place."""
    for module in model.modules():
        plain = _PLAIN_CLASS.get(type(module))
        if plain is None:
            continue
        module.__class__ = plain
        module.__dict__.pop("dropit_cache", None)
    return model


def set_step(model: nn.Module, step: int, rank: int = 0) -> None:
    """Seed the random draws of ``model``'s DropIT layers for training step ``step``.

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


def is_dropit(module: nn.Module) -> bool:
    """Whether ``module`` is a converted DropIT layer."""
    return type(module) in _PLAIN_CLASS

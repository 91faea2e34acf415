"""Activation checkpointing of any ``nn.Module``'s submodules, chosen by module-path patterns.

A chosen module's class is swapped for a generated subclass whose training forward runs under
``torch.utils.checkpoint`` (non-reentrant; parameters, hooks and ``state_dict()`` unchanged):
the backward recomputes it bit for bit, BatchNorm running statistics updated once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from dropit_core.convert import CHECKPOINTED_ATTRIBUTE, is_checkpointed, is_dropit
from dropit_core.rules import check_matches, matches

_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


class _ScratchRunningStats:
    """Context in which each training BatchNorm of a unit updates throwaway running statistics:
    the recompute runs the forward's very ops, but the forward did the update."""

    def __init__(self, unit: nn.Module) -> None:
        self.unit = unit
        self.swapped: list[tuple[nn.Module, str, torch.Tensor]] = []

    def __enter__(self) -> None:
        for bn in self.unit.modules():
            if isinstance(bn, _BatchNorm) and bn.training and bn.track_running_stats:
                for name in _RUNNING_STATS:
                    stat = bn._buffers.get(name)
                    if stat is not None:
                        self.swapped.append((bn, name, stat))
                        bn._buffers[name] = stat.clone()

    def __exit__(self, *exc: object) -> None:
        for bn, name, stat in self.swapped:
            bn._buffers[name] = stat
        self.swapped.clear()


def _new_checkpointed(plain: type[nn.Module]) -> nn.Module:
    # Unpickling entry point: generated classes have no importable name of their own.
    cls = _checkpointed_class(plain)
    return cls.__new__(cls)


@functools.cache
def _checkpointed_class(plain: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return plain.forward(self, *args, **kwargs)

        # Inputs go in flat: checkpoint saves only top-level tensors as saved tensors (version
        # checked, seen by saved_tensors_hooks) and keeps nested ones (the FPN's dict) as plain
        # references; and no keyword of the module's forward can collide with checkpoint's.
        leaves, spec = tree_flatten((args, kwargs))

        def run(*leaves: Any) -> Any:
            args, kwargs = tree_unflatten(list(leaves), spec)
            return plain.forward(self, *args, **kwargs)

        return checkpoint(
            run,
            *leaves,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=lambda: (contextlib.nullcontext(), _ScratchRunningStats(self)),
        )

    def __reduce_ex__(self: nn.Module, protocol: int) -> tuple:
        _, _, *state = plain.__reduce_ex__(self, max(protocol, 2))
        return (_new_checkpointed, (plain,), *state)

    namespace = {
        "forward": forward,
        "__reduce_ex__": __reduce_ex__,
        "__module__": __name__,
        "__doc__": f"``{plain.__name__}`` whose training forward is recomputed in the backward.",
        CHECKPOINTED_ATTRIBUTE: True,
    }
    return type(f"Checkpointed{plain.__name__}", (plain,), namespace)


def checkpoint_modules(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Checkpoint, in place, each outermost module whose path matches one of ``patterns`` (as in
    ``to_dropit``): each unit recomputes its training forward in the backward. Returns the units'
    paths. Apply before ``to_dropit``, which leaves layers inside units plain."""
    if isinstance(patterns, str):
        raise ValueError(f"checkpoint patterns must be a list, got the string {patterns!r}")
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"checkpoint pattern {pattern!r} is not a string")
    named = [(path, module) for path, module in model.named_modules() if path]
    check_matches("checkpoint", patterns, [path for path, _ in named])
    already = [path or "the model" for path, m in model.named_modules() if is_checkpointed(m)]
    if already:
        raise ValueError(
            f"model already has checkpointed modules (e.g. {already[0]}); "
            "call uncheckpoint_modules first"
        )
    units: list[tuple[str, nn.Module]] = []
    for path, module in named:  # pre-order: a unit comes before the modules inside it
        inside = any(path.startswith(unit + ".") for unit, _ in units)
        if not inside and any(matches(path, p) for p in patterns):
            units.append((path, module))
    for path, module in units:  # validate every unit before swapping any class
        dropit = next((p for p, m in module.named_modules(prefix=path) if is_dropit(m)), None)
        if dropit is not None:
            raise ValueError(
                f"checkpointed module {path} would contain the DropIT layer {dropit} (a unit "
                "keeps nothing inside it anyway): call checkpoint_modules before to_dropit"
            )
        if "forward" in module.__dict__:
            raise ValueError(f"cannot checkpoint {path}: its instance overrides forward")
    for _, module in units:
        module.__class__ = _checkpointed_class(type(module))
    return [path for path, _ in units]


def uncheckpoint_modules(model: nn.Module) -> list[str]:
    """Turn ``model``'s checkpointed units back into their plain classes; returns their paths."""
    restored = []
    for path, module in model.named_modules():
        if is_checkpointed(module):
            module.__class__ = type(module).__bases__[0]
            restored.append(path)
    return restored

"""Which layers get which DropIT setting: module-path patterns, per-group rules, and their checks.

A rule is a dict with any of :data:`RULE_KEYS`; a key it leaves out falls back to ``to_dropit``'s
argument of the same name, and ``to_dropit``'s own ``exclude`` applies to every rule.
:func:`check_rules` validates rules without a model (configs call it on load);
:func:`assign_layers` matches them to a model.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dropit_core.layers.norm import NORM_CLASSES
from dropit_core.strategies.base import Strategy
from dropit_core.strategies.catalog import build_strategy

RULE_KEYS = ("include", "exclude", "strategy", "gamma", "relu", "norm", "pool", "options")
# relu="all": every ReLU a rule selects keeps a mask, also where a plain layer keeps its output
# (relu=True converts only those whose mask frees it: dropit_core.readers)
RELU_ALL = "all"


@dataclass(frozen=True)
class Rule:
    """One checked rule: its patterns (the call's exclude included), settings and built strategy."""

    index: int | None  # its place in ``rules``; None for to_dropit's own arguments
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    strategy: Strategy
    gamma: float
    relu: bool | str  # True, False or "all" (check_options)
    options: dict[str, Any] = field(default_factory=dict)
    norm: bool = False
    pool: bool = False

    @property
    def label(self) -> str:
        """How messages name the rule: ``DropIT rules[1]`` or ``DropIT``."""
        return "DropIT" if self.index is None else f"DropIT rules[{self.index}]"


def check_options(
    strategy: str, gamma: float, relu: bool | str, norm: bool, pool: bool, **options: Any
) -> Strategy:
    """Validate a rule's settings but its patterns (no model needed); returns the built strategy."""
    built = build_strategy(strategy, gamma, **options)
    if not (isinstance(relu, bool) or (isinstance(relu, str) and relu == RELU_ALL)):
        raise ValueError(
            f"DropIT option relu={relu!r} must be true or false, or {RELU_ALL!r} (a mask on every "
            "ReLU selected, also where a plain layer keeps its output whole)"
        )
    for name, value in (("norm", norm), ("pool", pool)):
        if not isinstance(value, bool):
            raise ValueError(f"DropIT option {name}={value!r} must be true or false")
    if norm and not built.every_element:
        raise ValueError(
            f"DropIT option norm=true packs normalisation inputs, whose backward reads every "
            f"element: it needs a strategy that keeps them all (quant), not {built.name!r}"
        )
    return built


def _patterns(label: str, kind: str, patterns: Any) -> tuple[str, ...]:
    if isinstance(patterns, str):
        raise ValueError(f"{label} {kind} must be a list of patterns, got the string {patterns!r}")
    if not isinstance(patterns, Sequence):
        raise ValueError(f"{label} {kind} must be a list of patterns, got {patterns!r}")
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"{label} {kind} pattern {pattern!r} is not a string")
    return tuple(patterns)


def check_rules(
    rules: Any,
    strategy: str = "mink",
    gamma: float = 0.8,
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = (),
    relu: bool | str = True,
    norm: bool = False,
    pool: bool = False,
    **options: Any,
) -> list[Rule]:
    """Validate per-group rules without a model (the other arguments: ``to_dropit``'s fallbacks,
    or with ``rules=None`` the one rule); return them checked, strategies built."""
    if rules is None:
        built = check_options(strategy, gamma, relu, norm, pool, **options)
        include = _patterns("DropIT", "include", include)
        exclude = _patterns("DropIT", "exclude", exclude)
        return [Rule(None, include, exclude, built, gamma, relu, dict(options), norm, pool)]
    exclude = _patterns("DropIT", "exclude", exclude)
    if isinstance(rules, (str, Mapping)) or not isinstance(rules, Sequence):
        raise ValueError(f"DropIT rules must be a list of rule dicts, got {rules!r}")
    if not rules:
        raise ValueError("DropIT rules is empty: give at least one rule, or rules=None")
    checked = []
    for i, rule in enumerate(rules):
        label = f"DropIT rules[{i}]"
        if not isinstance(rule, Mapping):
            raise ValueError(f"{label} must be a dict with keys {', '.join(RULE_KEYS)}: {rule!r}")
        for key in rule:
            if key not in RULE_KEYS:
                close = difflib.get_close_matches(str(key), RULE_KEYS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{label} has the unknown key {key!r}: allowed {', '.join(RULE_KEYS)}{hint}"
                )
        rule_options = rule.get("options", options)
        if not isinstance(rule_options, Mapping):
            raise ValueError(f"{label} options must be a dict, got {rule_options!r}")
        rule_strategy, rule_gamma = rule.get("strategy", strategy), rule.get("gamma", gamma)
        # relu, norm and pool may sit in options too, as in a config's dropit.options
        rule_options = dict(rule_options)
        flags = []
        for name, fallback in (("relu", relu), ("norm", norm), ("pool", pool)):
            if name in rule and name in rule_options:
                raise ValueError(f"{label} gives {name} twice, as a key and in options: keep one")
            flags.append(rule[name] if name in rule else rule_options.pop(name, fallback))
        rule_relu, rule_norm, rule_pool = flags
        try:
            built = check_options(rule_strategy, rule_gamma, *flags, **rule_options)
        except ValueError as err:
            # the rule's label in place of the message's own "DropIT" prefix, not before it
            raise ValueError(f"{label}: {str(err).removeprefix('DropIT ')}") from None
        own_include = _patterns(label, "include", rule.get("include", include))
        own_exclude = _patterns(label, "exclude", rule.get("exclude", ()))
        own_exclude += tuple(p for p in exclude if p not in own_exclude)
        fields = (built, rule_gamma, rule_relu, rule_options, rule_norm, rule_pool)
        checked.append(Rule(i, own_include, own_exclude, *fields))
    return checked


# The DropIT paper's exclusions on torchvision's Faster/Mask R-CNN: the stem conv (its input is
# the image) and the final predictors (class scores and box deltas, mask logits) stay exact.
# A Faster R-CNN has no mask logits: pass them with ``strict=False`` to to_dropit.
PAPER_EXCLUDE: tuple[str, ...] = (
    "backbone.body.conv1",
    "roi_heads.box_predictor.*",
    "roi_heads.mask_predictor.mask_fcn_logits",
)


# The layer types a rule converts only when one of its flags says so (the flag's name): the
# ones whose cache is not the conv/linear input cache.
GATED: dict[type, str] = {
    nn.ReLU: "relu",
    **dict.fromkeys(NORM_CLASSES, "norm"),
    nn.MaxPool2d: "pool",
}


def matches(path: str, pattern: str) -> bool:
    """Whether module ``path`` matches ``pattern``; a pattern also selects the modules below the
    one it names ("roi_heads" covers roi_heads.*)."""
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + ".*")


def check_matches(what: str, patterns: Sequence[str], paths: list[str]) -> None:
    """ValueError for the first of ``patterns`` that matches none of ``paths``, with the closest
    paths as a hint; ``what`` names the patterns (``"DropIT rules[0] include"``)."""
    for pattern in patterns:
        if not any(matches(p, pattern) for p in paths):
            close = difflib.get_close_matches(pattern, paths, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"{what} pattern {pattern!r} matches no module{hint}")


def assign_layers(
    named: list[tuple[str, nn.Module]],
    rules: list[Rule],
    exclude: Sequence[str],
    convertible: Collection[type],
    strict: bool = True,
) -> list[tuple[str, nn.Module, Rule]]:
    """(path, module, rule) for every layer of ``named`` whose type is exactly one of
    ``convertible`` that a rule selects (a ``GATED`` type only under its flag). Raises for two
    rules claiming one layer, a rule that selects no conv/linear layer, and (``strict``) a
    pattern that matches no module."""
    paths = [p for p, _ in named]
    if strict:
        for rule in rules:
            check_matches(f"{rule.label} include", rule.include, paths)
        check_matches("DropIT exclude", exclude, paths)  # the call's, checked once
        for rule in rules:
            own_exclude = [p for p in rule.exclude if p not in exclude]
            check_matches(f"{rule.label} exclude", own_exclude, paths)
    claimed: dict[str, Rule] = {}
    chosen = []
    for rule in rules:
        own = [
            (path, module)
            for path, module in named
            if type(module) in convertible
            and (type(module) not in GATED or getattr(rule, GATED[type(module)]))
            and any(matches(path, p) for p in rule.include)
            and not any(matches(path, p) for p in rule.exclude)
        ]
        # ReLUs alone save nothing (their consumers keep the tensor); norms or pools alone do
        if all(type(m) is nn.ReLU for _, m in own):
            raise ValueError(
                f"{rule.label} include={list(rule.include)} with exclude={list(rule.exclude)} "
                "selects no Conv2d/ConvTranspose2d/Linear layer"
                + (" (nor a norm or max-pool layer it converts)" if rule.norm or rule.pool else "")
            )
        for path, module in own:
            if path in claimed:
                raise ValueError(
                    f"DropIT rules[{claimed[path].index}] and rules[{rule.index}] both claim "
                    f"layer {path!r}: narrow one of them with include or exclude"
                )
            claimed[path] = rule
            chosen.append((path, module, rule))
    order = {p: i for i, p in enumerate(paths)}
    return sorted(chosen, key=lambda item: order[item[0]])

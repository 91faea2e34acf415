"""The memory methods a budget chooses among (``train.memory_budget``), each as the config
overrides that train it, and the budget's value ("22GB", "22000MB", 0.9) read as bytes or as a
fraction of the device.

The names and overrides are the accuracy study's settings (configs/study/plan.yaml), kept here
because the product does not read the study. A method sets every key of the four that choose a
method (``solver.accumulate``, ``model.activation_checkpointing`` and DropIT's ``enabled``,
``strategy``, ``options``, ``rules``), so what it trains does not depend on which method the
config itself named; every other key (``dropit.include``, ``dropit.norm``, ...) stays the
config's.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

STAGES = "[backbone.body.layer2, backbone.body.layer3, backbone.body.layer4]"  # ResNet stages 2-4
# What the baseline sets: what each other method starts from.
_PLAIN = ("solver.accumulate=1", "model.activation_checkpointing=[]", "dropit.enabled=false")


def _quant(bits: int) -> tuple[str, ...]:
    return (
        "dropit.enabled=true",
        "dropit.strategy=quant",
        f"dropit.options={{bits: {bits}}}",
        "dropit.rules=[]",
    )


@dataclass(frozen=True)
class MemoryMethod:
    """One way to train in less memory: its name, overrides, and whether its gradients are the
    baseline's (up to float summation order)."""

    name: str
    overrides: tuple[str, ...]
    exact: bool
    accumulate: int = 1  # micro-batches per step: needs a batch of at least this many images

    def config_overrides(self) -> tuple[str, ...]:
        """The overrides that train this method whatever method the config named."""
        return (*_PLAIN, *self.overrides)


METHODS: dict[str, MemoryMethod] = {
    m.name: m
    for m in (
        MemoryMethod("baseline", (), exact=True),
        # exact for frozen norms only: trainable BatchNorm normalises each micro-batch alone
        MemoryMethod("accumulate_2", ("solver.accumulate=2",), exact=True, accumulate=2),
        MemoryMethod("accumulate_4", ("solver.accumulate=4",), exact=True, accumulate=4),
        MemoryMethod(
            "checkpoint_stages", (f"model.activation_checkpointing={STAGES}",), exact=True
        ),
        MemoryMethod("quant_8bit", _quant(8), exact=False),
        MemoryMethod("quant_4bit", _quant(4), exact=False),
        MemoryMethod(
            "checkpoint_stages_quant_4bit",
            (f"model.activation_checkpointing={STAGES}", *_quant(4)),
            exact=False,
        ),
        MemoryMethod("quant_2bit", _quant(2), exact=False),
        # the paper's; not a default candidate: the study found it costs box AP on every layer
        MemoryMethod(
            "mink_0.8",
            (
                "dropit.enabled=true",
                "dropit.strategy=mink",
                "dropit.gamma=0.8",
                "dropit.options={}",
                "dropit.rules=[]",
            ),
            exact=False,
        ),
    )
}

# The exact methods and those whose AP the accuracy study kept (docs/choosing.md).
DEFAULT_CANDIDATES = (
    "baseline",
    "accumulate_2",
    "accumulate_4",
    "checkpoint_stages",
    "quant_4bit",
    "checkpoint_stages_quant_4bit",
    "quant_2bit",
)


def candidates_error(names: list[str]) -> str | None:
    """Why ``train.memory_candidates`` cannot be used (unknown or repeated names, none), or
    None."""
    if not names:
        return "train.memory_candidates is empty: list at least one method"
    for name in names:
        if name not in METHODS:
            close = difflib.get_close_matches(name, list(METHODS), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            return (
                f"train.memory_candidates: unknown method '{name}'{hint} "
                f"(known: {', '.join(METHODS)})"
            )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return f"train.memory_candidates: {', '.join(repeated)} listed more than once"
    return None


# Binary units, as nvidia-smi and torch.cuda count a card's memory ("24 GB" is 24 GiB).
_UNITS = {"": None, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    """A memory budget per process: bytes, or a fraction of the device's memory."""

    nbytes: int | None = None
    fraction: float | None = None

    def on(self, device_bytes: int) -> int:
        """The budget in bytes on a device of ``device_bytes``."""
        if self.nbytes is not None:
            return self.nbytes
        return int(self.fraction * device_bytes)


def parse_budget(value: object) -> Budget:
    """``train.memory_budget`` as a Budget: a size with a unit ("22GB", "22000 MB", "1.5TiB";
    binary units) or a fraction of the device (0.9, "90%"); ValueError says what is allowed."""
    allowed = (
        "a size with a unit (22GB, 22000MB; binary units, as torch counts a card) or a "
        "fraction of the device's memory in (0, 1] (0.9, or 90%)"
    )
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"train.memory_budget = {value!r}: expected {allowed}")
    text = str(value).strip()
    if text.endswith("%"):
        fraction = _number(text[:-1])
        fraction = None if fraction is None else fraction / 100
    elif isinstance(value, (int, float)):
        fraction = float(value)
    else:
        match = _SIZE.fullmatch(text)
        if match is None or (match.group(2) == "" and match.group(3) is None):
            fraction = _number(text)  # a bare number as text: "0.9" from an override
            if fraction is None or fraction > 1:
                raise ValueError(f"train.memory_budget = {value!r}: expected {allowed}")
        else:
            size = float(match.group(1)) * (_UNITS[match.group(2).lower()] or 1)
            if size < 2**20:
                raise ValueError(
                    f"train.memory_budget = {value!r} is less than 1 MB: expected {allowed}"
                )
            return Budget(nbytes=int(size))
    if fraction is None or not 0 < fraction <= 1:
        raise ValueError(f"train.memory_budget = {value!r}: expected {allowed}")
    return Budget(fraction=fraction)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def format_bytes(nbytes: float) -> str:
    """Bytes as GB (two decimals) from 1 GB on, else MB (one decimal); binary units."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GB"
    return f"{nbytes / 2**20:.1f} MB"

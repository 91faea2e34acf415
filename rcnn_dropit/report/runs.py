"""Read one run directory (config.yaml, eval.json, metrics.jsonl, memory.json, budget.json) into
a Run."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

METRIC_KEYS = ("AP", "AP50", "AP75", "APs", "APm", "APl")
FAMILIES = ("bbox", "segm")


class RunNotUsable(Exception):
    """A run directory that cannot be reported; the message is the reason."""


@dataclass(frozen=True)
class MemoryChoice:
    """A run's budget.json: the method train.memory_budget chose before training, and why."""

    method: str
    reason: str
    budget_mb: float | None
    margin: float | None
    device: str
    # (method, peak MB or None, why none, whether it fitted) of every candidate measured
    candidates: tuple[tuple[str, float | None, str, bool], ...]


@dataclass(frozen=True)
class Run:
    """What the report needs from one finished run."""

    path: Path
    name: str
    config: dict[str, Any]
    metrics: dict[str, dict[str, float]]  # family -> AP key -> value in [0, 1]
    num_images: int | None
    iterations: int | None
    losses: tuple[tuple[int, float], ...]  # (iteration, total loss) of train records
    images_per_sec: float | None
    saved_mb: float | None
    peak_mb: float | None  # the device's total: weights, gradients, optimizer state, activations
    notes: tuple[str, ...]  # what was missing or damaged but did not stop the run being used
    # (iteration, family -> AP) of every evaluation in metrics.jsonl, the final one included
    evals: tuple[tuple[int, dict[str, float]], ...] = ()
    # memory.json's measured step: its peak above what was held when it began (the benches' peak)
    step_peak_mb: float | None = None
    # budget.json: the memory method train.memory_budget chose before training, why, and what
    # each candidate measured (None: the run trained the method its config named)
    memory_choice: MemoryChoice | None = None

    def cfg(self, dotted: str, default: Any = None) -> Any:
        """Value at a dotted config path such as 'dropit.gamma', or default."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def dropit_enabled(self) -> bool:
        """Whether the run trained with DropIT."""
        return bool(self.cfg("dropit.enabled", False))

    @property
    def strategy(self) -> str | None:
        """DropIT strategy, None for a run without DropIT."""
        return str(self.cfg("dropit.strategy")) if self.dropit_enabled else None

    @property
    def gamma(self) -> float | None:
        """DropIT gamma (fraction dropped), None for a run without DropIT."""
        return _number(self.cfg("dropit.gamma")) if self.dropit_enabled else None

    @property
    def options(self) -> dict[str, Any]:
        """DropIT strategy options, empty for a run without DropIT."""
        opts = self.cfg("dropit.options") if self.dropit_enabled else None
        return dict(opts) if isinstance(opts, dict) else {}

    @property
    def seed(self) -> int | None:
        """Training seed (train.seed)."""
        return self.cfg("train.seed")

    def metric(self, family: str, key: str) -> float | None:
        """One AP value in [0, 1], or None when the run has none."""
        return self.metrics.get(family, {}).get(key)


def _number(value: Any) -> float | None:
    """A finite float, or None for anything else (null, NaN, strings, bools)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunNotUsable(f"{file.name} is not readable JSON ({err})") from None


def _read_metrics_jsonl(file: Path, notes: list[str]) -> list[dict[str, Any]]:
    """JSON records of metrics.jsonl; a partial last line (run killed mid-write) is ignored."""
    if not file.is_file():
        notes.append("no metrics.jsonl (no loss curve or images/s)")
        return []
    lines = [line for line in file.read_text(errors="replace").splitlines() if line.strip()]
    records, bad = [], 0
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                bad += 1
            continue
        if isinstance(record, dict):
            records.append(record)
    if bad:
        notes.append(f"metrics.jsonl: {bad} unreadable line(s) skipped")
    return records


def _read_eval(file: Path) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    if not file.is_file():
        raise RunNotUsable("no eval.json (training or final evaluation did not finish)")
    data = _read_json(file)
    if not isinstance(data, dict):
        raise RunNotUsable("eval.json is not a JSON object")
    metrics: dict[str, dict[str, float]] = {}
    for family in FAMILIES:
        block = data.get(family)
        if not isinstance(block, dict):
            continue
        # COCOeval writes -1 for an area range without ground truth: that is "no value", not 0.
        values = {k: _number(block.get(k)) for k in METRIC_KEYS}
        values = {k: v for k, v in values.items() if v is not None and v >= 0}
        if values:
            metrics[family] = values
    if not metrics:
        raise RunNotUsable("eval.json has no bbox or segm AP values")
    return metrics, data


def load_run(path: str | Path) -> Run:
    """Read a run directory; raises RunNotUsable with the reason when it cannot be reported."""
    path = Path(path)
    if not path.exists():
        raise RunNotUsable("directory does not exist")
    if not path.is_dir():
        raise RunNotUsable("not a directory")
    cfg_file = path / "config.yaml"
    if not cfg_file.is_file():
        raise RunNotUsable("no config.yaml")
    try:
        config = yaml.safe_load(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RunNotUsable(f"config.yaml is not readable YAML ({first})") from None
    if not isinstance(config, dict):
        raise RunNotUsable("config.yaml is not a mapping")
    metrics, eval_data = _read_eval(path / "eval.json")

    notes: list[str] = []
    records = _read_metrics_jsonl(path / "metrics.jsonl", notes)
    train = [r for r in records if r.get("type") == "train"]
    losses = tuple(
        (int(r["iter"]), loss)
        for r in train
        if isinstance(r.get("iter"), int) and (loss := _number(r.get("loss"))) is not None
    )
    evals = tuple(
        (int(r["iter"]), aps)
        for r in records
        if r.get("type") == "eval" and isinstance(r.get("iter"), int)
        if (aps := _ap_values(r))
    )
    speeds = [v for r in train if (v := _number(r.get("images_per_sec"))) and v > 0]
    peaks = [v for r in train if (v := _number(r.get("peak_mem_mb"))) and v > 0]

    memory: dict[str, Any] = {}
    mem_file = path / "memory.json"
    if not mem_file.is_file():
        notes.append("no memory.json (no saved-activation MB)")
    else:
        try:
            loaded = _read_json(mem_file)
        except RunNotUsable as err:
            notes.append(str(err))
        else:
            memory = loaded if isinstance(loaded, dict) else {}
    step_peak = _number(memory.get("step_peak_total_mb"))
    if step_peak is not None and step_peak > 0:
        peaks.append(step_peak)
    # The median ignores warm-up and evaluation stalls; memory.json's one-step figure is a fallback.
    ips = statistics.median(speeds) if speeds else _number(memory.get("images_per_sec"))

    choice = None
    if (path / "budget.json").is_file():
        try:
            loaded = _read_json(path / "budget.json")
        except RunNotUsable as err:
            notes.append(str(err))
        else:
            choice = _memory_choice(loaded)

    iterations = eval_data.get("iter")
    if not isinstance(iterations, int) or isinstance(iterations, bool):
        iterations = max((it for it, _ in losses), default=None)
    num_images = eval_data.get("num_images")
    return Run(
        path=path,
        name=str(config.get("name") or path.name),
        config=config,
        metrics=metrics,
        num_images=num_images if isinstance(num_images, int) else None,
        iterations=iterations,
        losses=losses,
        images_per_sec=ips,
        saved_mb=_number(memory.get("saved_mb")),
        peak_mb=max(peaks) if peaks else None,
        notes=tuple(notes),
        evals=evals,
        step_peak_mb=_number(memory.get("step_peak_mb")),
        memory_choice=choice,
    )


def _ap_values(record: dict[str, Any]) -> dict[str, float]:
    """family -> AP of one evaluation record (families without a usable AP left out)."""
    found = {}
    for family in FAMILIES:
        block = record.get(family)
        value = _number(block.get("AP")) if isinstance(block, dict) else None
        if value is not None and value >= 0:
            found[family] = value
    return found


def _memory_choice(data: Any) -> MemoryChoice | None:
    """budget.json read leniently (None when it names no method)."""
    if not isinstance(data, dict) or not isinstance(data.get("method"), str):
        return None
    candidates = tuple(
        (
            str(m.get("method")),
            _number(m.get("peak_mb")),
            str(m.get("note") or ""),
            bool(m.get("fits")),
        )
        for m in data.get("methods") or []
        if isinstance(m, dict)
    )
    return MemoryChoice(
        data["method"],
        str(data.get("reason") or ""),
        _number(data.get("budget_mb")),
        _number(data.get("margin")),
        str(data.get("device") or "-"),
        candidates,
    )

"""Rows of the report: one run each, or the runs of one setting that differ only in seed."""

from __future__ import annotations

import copy
import json
import os
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rcnn_dropit.report.runs import Run

# Keys that differ between seeds of one setting without changing the setting itself.
_PER_RUN_KEYS = (("name",), ("train", "seed"), ("train", "output_dir"))


@dataclass(frozen=True)
class Row:
    """One table row: a run, or a group of runs whose numbers are averaged."""

    label: str
    runs: tuple[Run, ...]

    @property
    def first(self) -> Run:
        """The run that stands for the setting (all members share it)."""
        return self.runs[0]

    def values(self, family: str, key: str) -> list[float]:
        """The member runs' AP values that exist, in run order."""
        return [v for r in self.runs if (v := r.metric(family, key)) is not None]

    def metric(self, family: str, key: str) -> float | None:
        """Mean AP value over the members that have it."""
        return _mean(self.values(family, key))

    @property
    def saved_mb(self) -> float | None:
        """Mean saved-activation MB."""
        return _mean([r.saved_mb for r in self.runs if r.saved_mb is not None])

    @property
    def peak_mb(self) -> float | None:
        """Mean peak memory MB, the device's total."""
        return _mean([r.peak_mb for r in self.runs if r.peak_mb is not None])

    @property
    def step_peak_mb(self) -> float | None:
        """Mean peak MB of the measured step above what was held when it began."""
        return _mean([r.step_peak_mb for r in self.runs if r.step_peak_mb is not None])

    @property
    def images_per_sec(self) -> float | None:
        """Mean training throughput."""
        return _mean([r.images_per_sec for r in self.runs if r.images_per_sec is not None])


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def setting_key(run: Run) -> str:
    """The run's config without seed, name and output folder, as canonical JSON."""
    config = copy.deepcopy(run.config)
    for path in _PER_RUN_KEYS:
        node = config
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return json.dumps(config, sort_keys=True, default=str)


def _group_label(names: list[str]) -> str:
    """Shared name of a seed group: 'mrcnn_g0.8_s1', 'mrcnn_g0.8_s2' -> 'mrcnn_g0.8'."""
    if len(set(names)) == 1:
        return names[0]
    prefix = os.path.commonprefix(names).rstrip("_-. ")
    prefix = re.sub(r"[_\-.]?(seed|s)$", "", prefix).rstrip("_-. ")
    return prefix or " / ".join(names)


def _unique(labels: list[str], runs: list[Run]) -> list[str]:
    """Labels made distinct by the run folder where two rows would read the same."""
    counts = {label: labels.count(label) for label in labels}
    return [
        f"{label} [{run.path.name}]" if counts[label] > 1 else label
        for label, run in zip(labels, runs, strict=True)
    ]


def make_rows(runs: Sequence[Run], group_seeds: bool) -> list[Row]:
    """One row per run, or with group_seeds one row per setting (first-seen order)."""
    if not group_seeds:
        members = [[run] for run in runs]
    else:
        by_key: dict[str, list[Run]] = {}
        for run in runs:
            by_key.setdefault(setting_key(run), []).append(run)
        members = list(by_key.values())
    labels = [_group_label([r.name for r in group]) for group in members]
    labels = _unique(labels, [group[0] for group in members])
    return [Row(label, tuple(group)) for label, group in zip(labels, members, strict=True)]

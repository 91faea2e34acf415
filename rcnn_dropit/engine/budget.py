"""``train.memory_budget``: before training, every process measures the candidate memory
methods on its own device (engine/probe.py), the processes agree on one table (the largest peak
and the slowest step of each method count), and the run trains with the fastest method whose
peak plus the margin fits the budget; at a step time the probe cannot tell apart from the
fastest's, an exact method wins. The choice is printed, written to budget.json and applied to
the config (so to config.yaml and the checkpoints); a resumed run reads it back and measures
nothing.

The probe leaves no state behind: each method is built afresh (the run's weights are built after
it), the random streams are restored, and the loader is not iterated (its first batch is read
from the data set by the sampler's indices).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rcnn_dropit.config import Config, with_overrides
from rcnn_dropit.data import build_train_loader
from rcnn_dropit.distributed import DistInfo, all_gather_object, run_on_main
from rcnn_dropit.engine.probe import (
    DEFAULT_STEPS,
    Probe,
    ProbeSteps,
    method_config,
    probe_batch,
    probe_method,
)
from rcnn_dropit.errors import UsageError, one_line
from rcnn_dropit.memory_methods import METHODS, format_bytes, parse_budget
from rcnn_dropit.models.build import trainable_batch_norm
from rcnn_dropit.rng import rng_preserved
from rcnn_dropit.run_dir import BUDGET_FILE, RunDir

log = logging.getLogger(__name__)  # a child of the run's logger: rank 0's console and log.txt

# Step times this close are not told apart by a few timed steps, whatever their own spread.
TIME_NOISE = 0.05


@dataclass(frozen=True)
class RankProbes:
    """What one process measured, as it sends it to the others."""

    budget_bytes: int
    probes: list[Probe]
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # of its probe batch
    error: str | None = None  # this process's probe failed: every process stops
    usage: bool = False  # ...with an error the user can fix


@dataclass(frozen=True)
class Row:
    """One method over every process: the largest peak and the slowest step count."""

    method: str
    peak_bytes: int | None
    step_s: float | None
    spread: float
    exact: bool
    fits: bool
    note: str = ""
    positives: float | None = None  # positive RoIs per image in the measured step (fewest)


@dataclass(frozen=True)
class Choice:
    """The method a budget chose, why, and the table it was chosen from."""

    method: str
    reason: str
    budget: Any  # train.memory_budget as written
    budget_bytes: int
    margin: float
    rows: tuple[Row, ...]
    device: str
    world_size: int
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # rank 0's probe batch
    probe_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """budget.json: the choice, its overrides and every method's figures."""
        return {
            "method": self.method,
            "reason": self.reason,
            "overrides": list(METHODS[self.method].config_overrides()),
            "budget": self.budget,
            "budget_mb": self.budget_bytes / 2**20,
            "margin": self.margin,
            "device": self.device,
            "world_size": self.world_size,
            "image_sizes": [list(s) for s in self.image_sizes],
            "probe_s": round(self.probe_s, 2),
            "methods": [
                {
                    "method": r.method,
                    "peak_mb": None if r.peak_bytes is None else r.peak_bytes / 2**20,
                    "step_s": r.step_s,
                    "spread": round(r.spread, 4),
                    "exact": r.exact,
                    "fits": r.fits,
                    "note": r.note,
                    "positive_rois_per_image": r.positives,
                }
                for r in self.rows
            ],
        }


def device_bytes(device: torch.device) -> int:
    """The device's memory: a GPU's total, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def is_exact(method: str, cfg: Config) -> bool:
    """Whether ``method`` trains the baseline's gradients in ``cfg``'s model: accumulation only
    where no BatchNorm trains (each micro-batch would be normalised alone)."""
    m = METHODS[method]
    return m.exact and not (m.accumulate > 1 and trainable_batch_norm(cfg.model))


def combine(reports: list[RankProbes], margin: float, cfg: Config) -> tuple[int, list[Row]]:
    """(the smallest budget, one row per method) from every process's probes: a method fits
    where its largest peak plus the margin fits the smallest budget; its step is the slowest
    process's median."""
    budget = min(r.budget_bytes for r in reports)
    rows = []
    for j, first in enumerate(reports[0].probes):
        probes = [r.probes[j] for r in reports]
        exact = is_exact(first.method, cfg)
        failed = [(rank, p) for rank, p in enumerate(probes) if not p.measured]
        if failed:  # on any process: the method cannot train the run
            rank, probe = failed[0]
            note = probe.note + (f" on rank {rank}" if len(reports) > 1 else "")
            rows.append(Row(first.method, None, None, 0.0, exact, fits=False, note=note))
            continue
        peak = max(p.peak_bytes for p in probes)
        step = max(p.step_s for p in probes)
        spread = max(p.spread for p in probes)
        fits = peak * (1 + margin) <= budget
        counted = [p.positives for p in probes if p.positives is not None]
        positives = min(counted) if counted else None
        rows.append(Row(first.method, peak, step, spread, exact, fits, positives=positives))
    return budget, rows


def choose(rows: list[Row], budget_bytes: int, margin: float, budget: Any) -> tuple[str, str]:
    """(method, why): the fastest that fits; an exact one that fits instead where its step is
    within the timing noise of the fastest's. None fits: one line naming every peak."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        peaks = ", ".join(
            f"{r.method} {format_bytes(r.peak_bytes) if r.peak_bytes is not None else r.note}"
            for r in rows
        )
        raise UsageError(
            f"train.memory_budget={budget} ({format_bytes(budget_bytes)} per process): no "
            f"method fits with the {margin:.0%} margin (peaks: {peaks}); raise the budget, "
            "lower solver.batch_size or model.max_size, or list more methods in "
            "train.memory_candidates"
        )
    fastest = min(fitting, key=lambda r: r.step_s)
    if fastest.exact:
        return fastest.method, "the fastest that fits"
    near = [
        r
        for r in fitting
        if r.exact and r.step_s <= fastest.step_s * (1 + max(TIME_NOISE, fastest.spread, r.spread))
    ]
    if not near:
        return fastest.method, "the fastest that fits"
    exact = min(near, key=lambda r: r.step_s)
    return exact.method, (
        f"exact, and its step within the probe's timing noise of the fastest that fits "
        f"({fastest.method}: {exact.step_s / fastest.step_s:.2f}x its step)"
    )


def format_table(choice: Choice) -> str:
    """The probe's table and its verdict, for the console and log.txt."""
    sizes = sorted(set(choice.image_sizes))
    shown = ", ".join(f"{h}x{w}" for h, w in sizes)
    lines = [
        f"memory budget {format_bytes(choice.budget_bytes)} per process "
        f"(train.memory_budget={choice.budget}); a method fits when its peak + "
        f"{choice.margin:.0%} does; measured on {choice.device} with "
        f"{len(choice.image_sizes)} image(s) of {shown} px per process{_positives(choice)} in "
        f"{choice.probe_s:.1f} s:",
        f"  {'method':<30} {'exact':<5} {'peak':>11} {'step':>9}  fits",
    ]
    for r in choice.rows:
        peak = format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-"
        step = f"{r.step_s:.3f} s" if r.step_s is not None else "-"
        fits = ("yes" if r.fits else "no") + (f" ({r.note})" if r.note else "")
        mark = "  <- chosen" if r.method == choice.method else ""
        exact = "yes" if r.exact else "no"
        lines.append(f"  {r.method:<30} {exact:<5} {peak:>11} {step:>9}  {fits}{mark}")
    lines.append(f"training with {choice.method}: {choice.reason}")
    return "\n".join(lines)


def out_of_memory_message(choice: Choice, device: torch.device) -> str:
    """What to say when a run whose method a budget chose runs out of memory: the budget, the
    probed peak and the peak the failing step reached."""
    row = next(r for r in choice.rows if r.method == choice.method)
    probed = format_bytes(row.peak_bytes) if row.peak_bytes is not None else "-"
    reached = ""
    if device.type == "cuda":
        reached = f"; this step had reached {format_bytes(torch.cuda.max_memory_allocated(device))}"
    return (
        f"out of memory while training with {choice.method}, which train.memory_budget="
        f"{choice.budget} chose from a probed peak of {probed} (+{choice.margin:.0%} margin, "
        f"{_positives(choice).lstrip(', ') or 'positives not counted'}){reached}: the run's "
        "steps outgrew the probe's; raise train.memory_margin or train.memory_probe_positives, "
        "or lower the budget"
    )


def _positives(choice: Choice) -> str:
    """The positive RoIs per image the probe's heads had, in words (a trained detector's)."""
    counted = [r.positives for r in choice.rows if r.positives is not None]
    return f", {min(counted):.0f} positive RoIs each" if counted else ""


def _probe_here(
    cfg: Config,
    info: DistInfo,
    train_loader,
    steps: ProbeSteps,
    measure: Callable[..., Probe],
) -> RankProbes:
    """This process's budget and probes of every candidate."""
    budget = parse_budget(cfg.train.memory_budget)
    budget_bytes = budget.on(device_bytes(info.device) if budget.nbytes is None else 0)
    batch = probe_batch(cfg, train_loader, info.device)
    probes = []
    for name in cfg.train.memory_candidates:
        need = METHODS[name].accumulate
        if need > len(batch.images):  # it would train as a smaller accumulation: not itself
            probes.append(Probe(name, note=f"needs {need} images per batch"))
            continue
        probes.append(measure(cfg, name, batch, info.device, steps, info.distributed))
    return RankProbes(budget_bytes, probes, batch.sizes)


def fit_budget(
    cfg: Config,
    info: DistInfo,
    train_loader,
    steps: ProbeSteps = DEFAULT_STEPS,
    measure: Callable[..., Probe] | None = None,
    gather: Callable[[Any], list[Any]] = all_gather_object,
) -> Choice:
    """Measure ``cfg.train.memory_candidates`` on this process and agree with the others (a
    collective: every process calls it); ``measure`` and ``gather`` stand in for the probe and
    the all-gather in tests."""
    started = time.perf_counter()
    caught: Exception | None = None
    with rng_preserved():  # the run's random streams go on as if nothing was measured
        try:
            mine = _probe_here(cfg, info, train_loader, steps, measure or probe_method)
        except Exception as err:  # told to every process, so none waits for this one
            caught = err
            mine = RankProbes(0, [], error=one_line(err), usage=isinstance(err, UsageError))
    reports = gather(mine)
    if caught is not None:
        raise caught
    for rank, report in enumerate(reports):
        if report.error is not None:
            error = UsageError if report.usage else RuntimeError
            raise error(f"the memory probe failed on rank {rank}: {report.error}")
    budget_bytes, rows = combine(reports, cfg.train.memory_margin, cfg)
    method, reason = choose(rows, budget_bytes, cfg.train.memory_margin, cfg.train.memory_budget)
    return Choice(
        method,
        reason,
        cfg.train.memory_budget,
        budget_bytes,
        cfg.train.memory_margin,
        tuple(rows),
        info.device.type,
        len(reports),
        [tuple(s) for s in reports[0].image_sizes],  # rank 0's, which writes budget.json
        time.perf_counter() - started,
    )


@dataclass
class Settled:
    """The method a run trains with: its config, the budget's fresh choice (None: none was
    made now) and the train loader the probe read (None: build one)."""

    cfg: Config
    choice: Choice | None = None
    train_loader: Any = None


def read_choice(run_dir: RunDir) -> dict | None:
    """The budget.json of a run, or None where it has none."""
    path = run_dir.root / BUDGET_FILE
    if not path.is_file():
        return None
    fix = "it names the memory method this run chose: restore it, or start anew with --overwrite"
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--resume: '{path}' is not readable ({one_line(err)}); {fix}") from None
    overrides = recorded.get("overrides") if isinstance(recorded, dict) else None
    if (
        not isinstance(recorded.get("method") if isinstance(recorded, dict) else None, str)
        or not isinstance(overrides, list)
        or not all(isinstance(o, str) for o in overrides)
    ):
        raise UsageError(f"--resume: '{path}' lacks a method or its overrides; {fix}")
    return recorded


def settle_method(cfg: Config, info: DistInfo, run_dir: RunDir, resuming: bool) -> Settled:
    """The config the run trains with: as given without a budget; a resumed run's recorded
    choice (measuring nothing); else the budget's choice, measured now (a collective)."""
    if cfg.train.memory_budget is None:
        return Settled(cfg)
    if resuming:
        recorded = run_on_main(lambda: read_choice(run_dir))
        if recorded is None:
            log.info(
                f"note: train.memory_budget: the run in '{run_dir.root}' chose no method by a "
                f"budget (it has no {BUDGET_FILE}); it trains on as configured, measuring nothing"
            )
            return Settled(cfg)
        log.info(
            f"memory budget: training on with {recorded['method']}, chosen when the run "
            f"started ({BUDGET_FILE}); nothing measured"
        )
        return Settled(with_overrides(cfg, recorded["overrides"], source=BUDGET_FILE))
    train_loader = build_train_loader(cfg, info.distributed, cfg.train.seed, info.device)
    choice = fit_budget(cfg, info, train_loader)
    log.info(format_table(choice))
    return Settled(method_config(cfg, choice.method), choice, train_loader)


def write_choice(run_dir: RunDir, choice: Choice | None) -> None:
    """budget.json, when a budget chose now (a collective: rank 0 writes)."""
    if choice is not None:
        run_dir.write_json(BUDGET_FILE, choice.as_dict())

"""The memory budget's probe on the GPU table's model and batch (``tools/gpu_checks.py budget``):
what ``train.memory_budget`` measures and chooses, against the table's rows.

The probe is the trainer's own (rcnn_dropit.engine.budget.fit_budget: each candidate built
afresh and trained a few steps, its peak over one step, start included, and its step time);
here it runs on the bench's recipe (workload.recipe_config) with the bench's batch as the run's
first batch, so that its peaks and the GPU table's measure one model on one batch. The table's
peak is taken above what the step starts with (weights and the batch; no optimizer step), the
probe's with it (weights, optimizer state, the batch, and SGD's update): what the probe held at
start (``held_mb``, counted here as PeakMeter counts it) is taken off before the two are
compared. The table's choice is the budget's own rule (budget.choose) over the table's rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dropit_core.memory import training_tensors
from instruments.measure import workload
from instruments.measure.graph_capture import bucket_batch, buckets_for, with_buckets
from rcnn_dropit.config import Config, with_overrides
from rcnn_dropit.distributed import DistInfo
from rcnn_dropit.engine.budget import Row, choose, fit_budget, is_exact

MB = 2**20


class _FirstBatch:
    """A batch sampler whose first batch is the whole stand-in data set."""

    def __init__(self, size: int) -> None:
        self.size = size

    def set_epoch(self, epoch: int) -> None:
        """The trainer's call before each epoch: one batch, whatever the epoch."""

    def __iter__(self):
        yield list(range(self.size))


class BenchLoader:
    """The bench's batch where the probe reads a training loader's first batch (its data set,
    indexed by its batch sampler's first batch): nothing else of a loader is used."""

    def __init__(self, images: list[torch.Tensor], targets: list[dict]) -> None:
        self.dataset = list(zip(images, targets, strict=True))
        self.batch_sampler = _FirstBatch(len(self.dataset))


def probe_config(images: int, image_size: int, device: str, amp: str, budget: str) -> Config:
    """The bench's recipe as a run that chooses by ``budget``: its device, precision and batch."""
    return with_overrides(
        workload.recipe_config(False, image_size),
        [
            f"train.device={torch.device(device).type}",
            f"solver.amp={amp}",
            f"solver.batch_size={images}",
            f"train.memory_budget={budget}",
        ],
        source="budget check",
    )


def held_bytes(cfg: Config, batch: Sequence) -> int:
    """What the probe's step starts with: weights and buffers, the optimizer's state (SGD's
    momentum, AdamW's two moments: one or two copies of the trainable weights) and the batch."""
    model = workload.detector(cfg)
    held = sum(t.numel() * t.element_size() for t in training_tensors(model, None, *batch))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    s = cfg.solver
    copies = 2 if s.optimizer == "adamw" else int(s.momentum > 0)
    return held + copies * trainable


def table_rows(path: Path | None) -> dict[str, Mapping[str, Any]]:
    """A GPU table's rows by setting ({} for no file: its stage did not finish)."""
    if path is None or not path.is_file():
        return {}
    return {r["setting"]: r for r in json.loads(path.read_text())["rows"]}


def table_choice(
    rows: Mapping[str, Mapping[str, Any]], n: int, held: int, cfg: Config, budget_bytes: int
) -> str | None:
    """The method the budget's rule picks from the table's rows of the probe's candidates at
    ``n`` images (their peaks plus what the probe holds at start, their rounds' spread)."""
    margin = cfg.train.memory_margin
    found = []
    for method in cfg.train.memory_candidates:
        r = rows.get(method, {})
        peak, step = r.get(f"peak_mb_{n}img"), r.get(f"step_s_{n}img")
        if peak is None or step is None:
            continue
        low, high = r.get(f"step_ratio_spread_{n}img") or (1.0, 1.0)
        ratio = r.get(f"step_ratio_{n}img") or 1.0
        total = int(peak * MB) + held
        fits = total * (1 + margin) <= budget_bytes
        found.append(Row(method, total, step, (high - low) / ratio, is_exact(method, cfg), fits))
    if not any(r.fits for r in found):
        return None
    return choose(found, budget_bytes, margin, cfg.train.memory_budget)[0]


def budget_check(
    images: int,
    image_size: int = 800,
    device: str = "cuda",
    amp: str = "fp16",
    budget: str = "16GB",
    table: Path | None = None,
    workload_name: str = workload.DEFAULT_WORKLOAD,
    size_buckets: bool = False,
) -> dict[str, Any]:
    """The probe's table, choice and wall time at ``images`` of the bench's batch
    (``workload_name``'s), each method's peak beside the GPU table's (``table``: its JSON at
    the same batch size); ``size_buckets``: the model pads to the recipe's two orientations and
    the batch is the first's, as the GPU table's rows with ``--size-buckets``."""
    cfg = probe_config(images, image_size, device, amp, budget)
    dev = torch.device(device)
    if size_buckets:
        cfg = with_buckets(cfg, image_size)
        bucket = buckets_for(image_size)[0]
        batch = bucket_batch(image_size, images, bucket, torch.device("cpu"), workload_name)
    else:
        batch = workload.make_batch(image_size, torch.device("cpu"), images, workload_name)
    held = held_bytes(cfg, batch)
    started = time.perf_counter()
    choice = fit_budget(cfg, DistInfo(0, 1, 0, dev, False), BenchLoader(*batch))
    wall = time.perf_counter() - started
    rows, probed = table_rows(table), choice.as_dict()
    # the probe's positives, as it counted them
    counted = [c for m in probed["methods"] if (c := m["positive_rois_per_image"]) is not None]
    methods = []
    for m in probed["methods"]:
        mine = m["peak_mb"]
        theirs = rows.get(m["method"], {}).get(f"peak_mb_{images}img")
        above = None if mine is None else mine - held / MB
        methods.append(
            {
                **m,
                "peak_above_start_mb": above,
                "table_peak_mb": theirs,
                "vs_table": None if above is None or not theirs else round(above / theirs, 4),
            }
        )
    return {
        **probed,
        "methods": methods,
        "images": images,
        "image_size": image_size,
        "amp": amp,
        "workload": workload_name,
        "positive_rois_per_image": min(counted) if counted else None,
        "size_buckets": [list(b) for b in cfg.model.size_buckets] or None,
        "wall_s": round(wall, 2),
        "held_mb": round(held / MB, 2),
        "table": None if table is None else table.name,
        "table_found": bool(rows),
        "table_choice": table_choice(rows, images, held, cfg, choice.budget_bytes)
        if rows
        else None,
    }

"""Training-step time of whole models from configs, side by side on one batch (a benchmark).

Used by ``tools/bench.py demo`` (``make bench-demo``): make demo's model with its DropIT section
against the same model without DropIT, and with eager packs instead of the C loops, measured in
one process, alternating, on the same images.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dropit_core import configure, pack_backend, reset_settings
from instruments.measure.allocator import training_allocator
from instruments.measure.timing import timed_rounds


def demo_rows(config: str, repeats: int) -> list[dict[str, Any]]:
    """Step time of ``config``'s model with DropIT against the same model without (baseline =
    1x). A third row packs with eager torch instead of the C loops (dropit_core.backends.native):
    what they save, in the same rounds; ``c_packs`` says which row packed with them."""
    variants = [
        ("baseline", ("dropit.enabled=false",)),
        ("dropit", ()),
        ("dropit_eager_packs", ()),
    ]
    setups = {
        "baseline": lambda: reset_settings(),
        "dropit": lambda: reset_settings(),
        "dropit_eager_packs": lambda: configure(native=False),
    }
    try:
        rows = compare_step_time(config, variants, repeats=repeats, setups=setups)
    finally:
        reset_settings()
    for row in rows:
        row["c_packs"] = row["model"] == "dropit" and pack_backend("cpu") == "native"
    return rows


def compare_step_time(
    config: str,
    variants: Sequence[tuple[str, Sequence[str]]],
    common: Sequence[str] = (),
    repeats: int = 10,
    setups: Mapping[str, Callable[[], None]] | None = None,
) -> list[dict[str, Any]]:
    """Median train-step seconds of each (label, overrides) model of ``config``; first = 1x.

    ``common`` overrides apply to every model and to the data the shared batch comes from.
    ``setups``: by label, a call made before each of that model's steps, untimed (a process-wide
    switch such as the C packs'; give every label one when any changes state).
    """
    from rcnn_dropit.config import load_config
    from rcnn_dropit.data.loader import build_train_loader, ensure_dataset
    from rcnn_dropit.data.transforms import images_to_device
    from rcnn_dropit.engine.data_position import epoch_batches
    from rcnn_dropit.models import build_model

    common = [*common, "data.num_workers=0"]
    base = load_config(config, common)
    ensure_dataset(base)
    images, targets = next(epoch_batches(build_train_loader(base, distributed=False), 0))
    images = images_to_device(images, torch.device("cpu"))
    models = []
    for label, overrides in variants:
        torch.manual_seed(0)
        model, _ = build_model(load_config(config, [*common, *overrides]))
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        models.append((label, list(overrides), model, torch.optim.SGD(params, lr=1e-4)))

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        loss = sum(model(images, targets).values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    with training_allocator(torch.device("cpu")) as allocator:
        # in rounds, one step of each model per round: noise falls on every model alike
        rounds = timed_rounds(
            [lambda m=m, o=o: step(m, o) for *_, m, o in models],
            repeats,
            warmup=2,  # untimed rounds: the allocator's first sizes, lazy inits
            before=[(setups or {}).get(label) for label, *_ in models],
        )
    times = {label: t for (label, *_), t in zip(models, rounds, strict=True)}
    first = statistics.median(times[models[0][0]])
    return [
        {
            "model": label,
            "overrides": overrides,
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "step_s": round(statistics.median(times[label]), 4),
            "step_ratio": round(statistics.median(times[label]) / first, 3),
            "images": len(images),
            "threads": torch.get_num_threads(),
            "timing_allocator": allocator,
        }
        for label, overrides, model, _ in models
    ]

"""train.memory_budget: the budget's value, the choice among measured methods (a seam stands in
for the probe where the figures must be known), ranks that disagree, an out-of-memory probe, a
real probe of a tiny model, and runs: the choice written and resumed, and a run whose budget
picks the baseline trains bit for bit as a run without one."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rcnn_dropit.checkpoint.files import load_checkpoint
from rcnn_dropit.config import load_config
from rcnn_dropit.data import build_train_loader
from rcnn_dropit.distributed import DistInfo
from rcnn_dropit.engine import budget, probe
from rcnn_dropit.engine.budget import RankProbes, choose, fit_budget
from rcnn_dropit.engine.optim import build_optimizer
from rcnn_dropit.engine.probe import Probe, ProbeSteps
from rcnn_dropit.engine.runner import train
from rcnn_dropit.engine.step import StepOptions
from rcnn_dropit.engine.trainer import Schedule, Trainer
from rcnn_dropit.errors import UsageError
from rcnn_dropit.memory_methods import METHODS, Budget, parse_budget
from rcnn_dropit.metrics_file import NullWriter
from rcnn_dropit.models import build_model
from rcnn_dropit.rng import capture_rng_state, seed_all
from tests.helpers import (
    FASTER_CFG,
    MASK_CFG,
    assert_one_line_error,
    call_tool,
    tiny_opts,
    train_killed_at,
    train_records,
)

GB = 2**30
CPU = torch.device("cpu")
SINGLE = DistInfo(0, 1, 0, CPU, distributed=False)
QUICK = ProbeSteps(warmup=1, timed=1)


def fake_measure(figures: dict[str, tuple[float, float]]):
    """A probe that reports ``figures[method]`` = (peak GB, step s), measuring nothing."""

    def measure(cfg, method, batch, device, steps, ddp) -> Probe:
        peak, step = figures[method]
        return Probe(method, int(peak * GB), step)

    return measure


def cfg_and_loader(root: Path, *extra: str):
    """A tiny Faster R-CNN config with ``extra`` and its training loader."""
    cfg = load_config(FASTER_CFG, tiny_opts(root, *extra))
    return cfg, build_train_loader(cfg, False, cfg.train.seed)


# ---- the budget's value ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "nbytes", "fraction"),
    [
        ("22GB", 22 * GB, None),
        ("22000 MB", 22000 * 2**20, None),
        ("1.5TiB", int(1.5 * 2**40), None),
        (0.9, None, 0.9),
        ("0.9", None, 0.9),
        ("90%", None, 0.9),
        (1, None, 1.0),
    ],
)
def test_a_budget_is_a_size_with_a_unit_or_a_fraction_of_the_device(value, nbytes, fraction):
    assert parse_budget(value) == Budget(nbytes, fraction)
    assert parse_budget(value).on(100 * GB) == (nbytes if nbytes else int(fraction * 100 * GB))


@pytest.mark.parametrize("value", ["22", 22000, 0, "1.5", "150%", "22 parsecs", "10KB", True])
def test_a_budget_without_a_unit_or_beyond_the_device_is_refused(value) -> None:
    with pytest.raises(ValueError, match="expected a size with a unit"):
        parse_budget(value)


def test_the_config_names_a_bad_budget_or_candidate_in_one_message() -> None:
    with pytest.raises(UsageError, match=r"train.memory_budget = '22 parsecs'"):
        load_config(MASK_CFG, ["train.memory_budget=22 parsecs"])
    with pytest.raises(UsageError, match=r"unknown method 'quant4'; did you mean 'quant_4bit'\?"):
        load_config(MASK_CFG, ["train.memory_candidates=[baseline, quant4]"])
    cfg = load_config(MASK_CFG, ["train.memory_budget=22GB"])
    assert cfg.train.memory_budget == "22GB" and cfg.train.memory_candidates[0] == "baseline"
    assert "mink_0.8" in METHODS and "mink_0.8" not in cfg.train.memory_candidates


# ---- the choice ------------------------------------------------------------------------------

FIGURES = {  # (peak GB, step s): each method lower and slower than the one before
    "baseline": (10.0, 1.00),
    "accumulate_2": (6.0, 1.15),
    "checkpoint_stages": (7.0, 1.30),
    "quant_4bit": (5.0, 1.40),
}


@pytest.mark.parametrize(
    ("budget_gb", "chosen"),
    [
        (12.0, "baseline"),  # 11 GB with the 10% margin fits
        (10.5, "accumulate_2"),  # between the baseline's peak and its peak + margin: not it
        (6.0, "quant_4bit"),  # below accumulate_2's 6.6 with the margin
    ],
)
def test_a_budget_between_two_peaks_chooses_the_fastest_method_that_fits(
    tiny_shapes, budget_gb, chosen
) -> None:
    cfg, loader = cfg_and_loader(
        tiny_shapes,
        f"train.memory_budget={budget_gb}GB",
        f"train.memory_candidates=[{', '.join(FIGURES)}]",
    )
    choice = fit_budget(cfg, SINGLE, loader, QUICK, measure=fake_measure(FIGURES))
    assert choice.method == chosen
    assert [r.fits for r in choice.rows] == [
        FIGURES[r.method][0] * 1.1 <= budget_gb for r in choice.rows
    ]
    record = choice.as_dict()
    assert record["method"] == chosen and record["budget_mb"] == budget_gb * 1024
    assert record["overrides"] == list(METHODS[chosen].config_overrides())
    assert record["image_sizes"] == [[64, 64], [64, 64]]  # the batch at model.max_size
    table = budget.format_table(choice)
    assert f"training with {chosen}: the fastest that fits" in table
    assert re.search(r"accumulate_2 +no ", table)  # trainable BatchNorm: not exact


def row(method: str, step: float, exact: bool, spread: float = 0.0) -> budget.Row:
    return budget.Row(method, GB, step, spread, exact, fits=True)


def test_an_exact_method_wins_when_its_step_is_within_the_timing_noise() -> None:
    rows = [row("quant_4bit", 1.00, False), row("checkpoint_stages", 1.04, True)]
    method, why = choose(rows, 2 * GB, 0.1, "2GB")
    assert method == "checkpoint_stages" and "within the probe's timing noise" in why
    rows = [row("quant_4bit", 1.00, False), row("checkpoint_stages", 1.20, True)]
    assert choose(rows, 2 * GB, 0.1, "2GB")[0] == "quant_4bit"
    # a noisy probe widens what counts as the same time
    rows = [row("quant_4bit", 1.00, False, spread=0.3), row("checkpoint_stages", 1.20, True)]
    assert choose(rows, 2 * GB, 0.1, "2GB")[0] == "checkpoint_stages"


def test_a_budget_below_every_peak_stops_with_one_line_naming_each_peak(tiny_shapes) -> None:
    figures = {**FIGURES, "quant_2bit": (4.0, 1.2)}
    cfg, loader = cfg_and_loader(
        tiny_shapes,
        "train.memory_budget=3GB",
        "train.memory_candidates=[baseline, accumulate_2, accumulate_4, quant_2bit]",
    )
    with pytest.raises(UsageError) as info:
        fit_budget(cfg, SINGLE, loader, QUICK, measure=fake_measure(figures))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("train.memory_budget=3GB (3.00 GB per process): no method fits")
    for part in ("baseline 10.00 GB", "accumulate_2 6.00 GB", "quant_2bit 4.00 GB"):
        assert part in message
    assert "accumulate_4 needs 4 images per batch" in message  # a batch of 2 cannot split in 4


def test_the_train_tool_stops_with_that_line_and_leaves_nothing(
    tmp_path, tiny_shapes, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(budget, "probe_method", fake_measure(FIGURES))
    run = tmp_path / "run"
    opts = tiny_opts(tiny_shapes, "train.memory_budget=1GB", "train.memory_candidates=[baseline]")
    args = ["--config", str(FASTER_CFG), "--output-dir", str(run), "--opts", *opts]
    proc = call_tool("train.py", *args, capsys=capsys)
    assert_one_line_error(proc, "no method fits", "baseline 10.00 GB")
    assert not run.exists()


# ---- ranks -----------------------------------------------------------------------------------


def test_ranks_that_measure_differently_take_the_same_choice(tiny_shapes) -> None:
    # rank 1's images hold more objects, say: its baseline peaks higher. Alone, rank 0 would
    # choose the baseline; together the largest peak counts and both choose accumulation.
    cfg, loader = cfg_and_loader(
        tiny_shapes, "train.memory_budget=10GB", "train.memory_candidates=[baseline, accumulate_2]"
    )
    figures = [
        {"baseline": (8.0, 1.0), "accumulate_2": (5.0, 1.2)},
        {"baseline": (9.5, 1.0), "accumulate_2": (5.5, 1.3)},
    ]
    infos = [DistInfo(rank, 2, rank, CPU, distributed=True) for rank in (0, 1)]
    alone = fit_budget(cfg, infos[0], loader, QUICK, fake_measure(figures[0]), lambda m: [m])
    assert alone.method == "baseline"

    sent: list[RankProbes | None] = [None, None]

    def gather_as(rank: int):
        def gather(mine: RankProbes) -> list[RankProbes]:
            sent[rank] = mine
            other = 1 - rank
            if sent[other] is None:  # the other rank's report, as it will send it
                peers = fake_measure(figures[other])
                probes = [peers(cfg, p.method, None, CPU, QUICK, True) for p in mine.probes]
                sent[other] = RankProbes(mine.budget_bytes, probes, [(64, 64)])
            return list(sent)

        return gather

    choices = [
        fit_budget(cfg, infos[rank], loader, QUICK, fake_measure(figures[rank]), gather_as(rank))
        for rank in (0, 1)
    ]
    assert [c.method for c in choices] == ["accumulate_2", "accumulate_2"]
    baseline = choices[0].rows[0]
    assert baseline.peak_bytes == int(9.5 * GB) and not baseline.fits
    assert choices[0].rows[1].step_s == 1.3  # the slower rank paces the step


def test_a_probe_that_fails_on_one_rank_stops_every_rank(tiny_shapes) -> None:
    cfg, loader = cfg_and_loader(
        tiny_shapes, "train.memory_budget=10GB", "train.memory_candidates=[baseline]"
    )
    failed = RankProbes(0, [], error="KeyError: 'loss_mask'")
    with pytest.raises(RuntimeError, match="memory probe failed on rank 1: KeyError"):
        fit_budget(cfg, SINGLE, loader, QUICK, fake_measure(FIGURES), lambda m: [m, failed])


# ---- the probe -------------------------------------------------------------------------------


def test_the_probe_leaves_the_random_streams_as_they_were(tiny_shapes) -> None:
    cfg, loader = cfg_and_loader(
        tiny_shapes, "train.memory_budget=10GB", "train.memory_candidates=[baseline]"
    )

    def drawing(cfg, method, batch, device, steps, ddp) -> Probe:
        torch.rand(3), random.random(), np.random.rand()  # as building a model does
        return Probe(method, GB, 1.0)

    before = capture_rng_state()
    fit_budget(cfg, SINGLE, loader, QUICK, measure=drawing)
    after = capture_rng_state()
    assert torch.equal(before["torch"], after["torch"])
    assert before["python"] == after["python"]
    assert torch.equal(before["numpy"][1], after["numpy"][1])


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"),
    ],
)
def test_a_probe_out_of_memory_is_recorded_as_not_fitting(tiny_shapes, monkeypatch, error):
    cfg, loader = cfg_and_loader(tiny_shapes)
    batch = probe.probe_batch(cfg, loader, CPU)

    def build_too_large(cfg, sync_bn=False):
        raise error

    monkeypatch.setattr(probe, "build_model", build_too_large)
    assert probe.probe_method(cfg, "quant_4bit", batch, CPU, QUICK) == Probe(
        "quant_4bit", note="out of memory"
    )
    monkeypatch.setattr(probe, "build_model", lambda cfg, sync_bn=False: {}["bug"])
    with pytest.raises(KeyError):  # anything else is a bug, not a method that does not fit
        probe.probe_method(cfg, "quant_4bit", batch, CPU, QUICK)


def test_the_probe_batch_is_the_first_batch_at_the_largest_size(tiny_shapes) -> None:
    cfg, loader = cfg_and_loader(tiny_shapes, "model.min_size=96", "model.max_size=160")
    images, targets = probe.first_batch(loader)
    batch = probe.probe_batch(cfg, loader, CPU)
    for image, small, large, size in zip(images, targets, batch.targets, batch.sizes, strict=True):
        h, w = image.shape[-2:]
        assert size == ((96, 160) if w >= h else (160, 96))  # each in its own orientation
        scale = torch.tensor([size[1] / w, size[0] / h] * 2)
        assert torch.allclose(large["boxes"], small["boxes"] * scale)
        assert large["masks"].shape[-2:] == size and large["masks"].dtype == torch.uint8
        assert torch.equal(large["labels"], small["labels"])
    # the loader itself was not iterated: its own generator drew nothing
    fresh = build_train_loader(cfg, False, cfg.train.seed)
    assert torch.equal(loader.generator.get_state(), fresh.generator.get_state())


@pytest.mark.slow
def test_a_real_probe_of_a_tiny_model_measures_every_method(tiny_shapes) -> None:
    cfg, loader = cfg_and_loader(
        tiny_shapes,
        "train.memory_budget=64GB",
        "train.memory_candidates=[baseline, quant_4bit]",
        # without weight decay SGD's update makes no copy of the gradients: at 64 px that copy,
        # the same for every method, would be the step's peak instead of the backward's
        "solver.weight_decay=0",
    )
    choice = fit_budget(cfg, SINGLE, loader, QUICK)
    base, quant = choice.rows
    assert all(r.fits and r.step_s > 0 for r in choice.rows)
    # weights, their gradients and SGD's momentum are held at the peak, and the activations
    model, _ = build_model(probe.method_config(cfg, "baseline"))
    params = sum(p.numel() * 4 for p in model.parameters())
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert base.peak_bytes > params + 2 * trainable
    assert quant.peak_bytes < base.peak_bytes  # 4-bit packs of what the baseline keeps whole
    # a budget between the two peaks (with the margin) takes the one below it
    between = int((quant.peak_bytes + base.peak_bytes) / 2 * 1.1)
    rows = [dataclasses.replace(r, fits=r.peak_bytes * 1.1 <= between) for r in choice.rows]
    assert choose(rows, between, 0.1, "between")[0] == "quant_4bit"


@pytest.mark.slow  # four tiny detectors built and stepped
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_probe_steps_as_the_trainer_steps(tiny_shapes, accumulate: int) -> None:
    # one step function (engine.step.training_step): same losses, gradients and weights
    cfg, loader = cfg_and_loader(
        tiny_shapes, f"solver.accumulate={accumulate}", "solver.clip_grad_norm=1.0"
    )
    batch = probe.probe_batch(cfg, loader, torch.device("cpu"))
    options = StepOptions.from_solver(cfg.solver)
    nets = []
    for _ in range(2):
        seed_all(cfg.train.seed)
        net, _ = build_model(cfg)
        nets.append(net.train())
    opts = [build_optimizer(cfg.solver, net) for net in nets]
    sched = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda it: 1.0)
    schedule = Schedule(4, 4, 1, 0, 0, 0)
    trainer = Trainer(
        nets[0], opts[0], sched, None, None, torch.device("cpu"), options, schedule,
        NullWriter(), progress=False,
    )  # fmt: skip
    seed_all(1)  # the samplers draw: both steps from the same streams
    logged = trainer.step(batch.images, batch.targets, 1)
    seed_all(1)
    losses = probe.probe_step(nets[1], opts[1], None, options, batch, torch.device("cpu"), 1)
    assert {k: v.item() for k, v in losses.items()} == {k: logged[k] for k in losses}
    assert len(losses) == 4  # Faster R-CNN's terms
    for (name, a), b in zip(nets[0].named_parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a, b), name
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name


# ---- runs ------------------------------------------------------------------------------------


def real_probe_timed(times: dict[str, float]):
    """The real probe (so every build and step it makes happens), short, its step time set."""

    def measure(cfg, method, batch, device, steps, ddp) -> Probe:
        measured = probe.probe_method(cfg, method, batch, device, QUICK, ddp)
        return dataclasses.replace(measured, step_s=times[method])

    return measure


@pytest.mark.slow
def test_a_run_whose_budget_picks_the_baseline_trains_as_one_without_a_budget(
    tmp_path, tiny_shapes, monkeypatch
) -> None:
    opts = tiny_opts(tiny_shapes, "solver.max_iters=3", "train.keep_last=1")
    plain = train(MASK_CFG, opts, output_dir=tmp_path / "plain")
    monkeypatch.setattr(
        budget, "probe_method", real_probe_timed({"baseline": 1.0, "quant_4bit": 2.0})
    )
    chosen_opts = [
        *opts,
        "train.memory_budget=64GB",
        "train.memory_candidates=[quant_4bit, baseline]",
    ]
    chosen = train(MASK_CFG, chosen_opts, output_dir=tmp_path / "chosen")
    record = json.loads((chosen.output_dir / "budget.json").read_text())
    assert record["method"] == "baseline" and record["reason"] == "the fastest that fits"
    a, b = train_records(plain.output_dir), train_records(chosen.output_dir)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    final_a = load_checkpoint(plain.output_dir / "checkpoints/model_0000003.pth")
    final_b = load_checkpoint(chosen.output_dir / "checkpoints/model_0000003.pth")
    for key, value in final_a["model"].items():
        assert torch.equal(value, final_b["model"][key]), key
    assert plain.metrics == chosen.metrics
    log = (chosen.output_dir / "log.txt").read_text()
    assert "training with baseline: the fastest that fits" in log


@pytest.mark.slow
def test_a_budget_probed_at_the_samplers_cap_holds_when_the_positives_grow(
    tmp_path, tiny_shapes
) -> None:
    # 128 RoIs per image: up to 32 positives. The first batch's untrained RPN gives a few; as
    # the RPN learns, training's steps see more, and their peaks grow with them.
    rois = ["model.box_batch_size_per_image=128", "solver.max_iters=10"]
    opts = tiny_opts(tiny_shapes, *rois, "train.memory_budget=64GB")
    run = train(MASK_CFG, [*opts, "train.memory_candidates=[baseline]"], output_dir=tmp_path / "r")
    records = train_records(run.output_dir)
    fg = [r["num_fg_samples"] for r in records]
    assert max(fg) > 2 * fg[0]  # the positives grew past the first batch's
    (probed,) = json.loads((run.output_dir / "budget.json").read_text())["methods"]
    assert probed["positive_rois_per_image"] == 32  # the sampler's cap, as the probe proposed
    largest = max(r["peak_mem_mb"] for r in records)
    assert largest <= probed["peak_mb"]  # the same meter: training stayed under the probe
    # probed at the first batch's positives instead, the peak falls below training's
    cfg = load_config(MASK_CFG, [*tiny_opts(tiny_shapes, *rois), "train.memory_probe_positives=0"])
    loader = build_train_loader(cfg, False, cfg.train.seed)
    first = probe.probe_method(cfg, "baseline", probe.probe_batch(cfg, loader, CPU), CPU, QUICK)
    assert first.positives < 32 and first.peak_bytes / 2**20 < largest


@pytest.mark.slow
def test_a_resumed_run_trains_on_with_its_choice_without_probing(
    tmp_path, tiny_shapes, monkeypatch
) -> None:
    run = tmp_path / "run"
    figures = {"baseline": (10.0, 1.0), "accumulate_2": (6.0, 1.2)}
    monkeypatch.setattr(budget, "probe_method", fake_measure(figures))
    opts = tiny_opts(
        tiny_shapes,
        "solver.max_iters=3",
        "train.checkpoint_every_iters=2",
        "train.memory_budget=8GB",
        "train.memory_candidates=[baseline, accumulate_2]",
    )
    train_killed_at(MASK_CFG, opts, run, 3)
    written = yaml.safe_load((run / "config.yaml").read_text())
    assert written["solver"]["accumulate"] == 2 and written["train"]["memory_budget"] == "8GB"
    assert json.loads((run / "budget.json").read_text())["method"] == "accumulate_2"

    def no_probe(*args):
        raise AssertionError("a resumed run measured again")

    monkeypatch.setattr(budget, "probe_method", no_probe)
    monkeypatch.setattr(budget, "fit_budget", no_probe)
    result = train(MASK_CFG, opts, output_dir=run, resume="auto")
    assert result.iteration == 3
    final = load_checkpoint(run / "checkpoints/model_0000003.pth")
    assert final["config"]["solver"]["accumulate"] == 2
    assert yaml.safe_load((run / "config.yaml").read_text())["solver"]["accumulate"] == 2
    log = (run / "log.txt").read_text()
    assert "training on with accumulate_2, chosen when the run started" in log

"""Engine: schedules, tiny CPU trainings with real COCOeval, exact resume, output-dir and
non-finite guards."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch import nn
from tqdm import tqdm

from rcnn_dropit.checkpoint.files import load_checkpoint
from rcnn_dropit.config import load_config
from rcnn_dropit.engine import runner as runner_module
from rcnn_dropit.engine.amp import autocast, make_scaler
from rcnn_dropit.engine.optim import (
    build_optimizer_and_scheduler,
    lr_factor_fn,
    scaled_lr,
    short_of_max_iters,
)
from rcnn_dropit.engine.runner import train
from rcnn_dropit.engine.trainer import Schedule, StepOptions, Trainer, step_scheduler
from rcnn_dropit.errors import UsageError
from rcnn_dropit.metrics_file import NullWriter, read_metrics
from rcnn_dropit.provenance import source_roots
from rcnn_dropit.run_dir import RunDir, truncate_metrics
from tests.helpers import (
    FASTER_CFG,
    MASK_CFG,
    MASK_DROPIT_CFG,
    assert_one_line_error,
    call_tool,
    train_killed_at,
    train_records,
)
from tests.helpers import tiny_opts as shared_tiny_opts

LOSS_KEYS = ("loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg")


def tiny_opts(root: Path, *extra: str) -> list[str]:
    """Overrides for a seconds-long CPU run (tests/helpers.py), keeping one checkpoint."""
    return shared_tiny_opts(root, "train.keep_last=1", *extra)


def check_ap(block: dict) -> None:
    for name in ("AP", "AP50", "AP75"):
        assert isinstance(block[name], float) and 0.0 <= block[name] <= 1.0
    for name in ("APs", "APm", "APl"):  # COCOeval gives -1 where an area range has no objects
        assert block[name] == -1.0 or 0.0 <= block[name] <= 1.0


# ---- learning-rate schedule --------------------------------------------------------------


def _lrs(solver, ipe: int, total: int, n: int) -> list[float]:
    model = nn.Linear(2, 2)
    opt, sched = build_optimizer_and_scheduler(solver, model, ipe, total)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _solver(**kw) -> SimpleNamespace:
    base = dict(
        optimizer="sgd",
        lr=0.1,
        momentum=0.9,
        weight_decay=0.0,
        batch_size=2,
        auto_scale_lr=False,
        reference_batch=16,
        scheduler="multistep",
        lr_steps=[2, 3],
        lr_decay=0.1,
        warmup_iters=4,
        warmup_factor=0.001,
    )
    return SimpleNamespace(**{**base, **kw})


def test_multistep_with_warmup() -> None:
    lrs = _lrs(_solver(), ipe=5, total=20, n=20)
    assert lrs[0] == pytest.approx(0.1 * 0.001)  # warmup starts at lr * warmup_factor
    assert lrs[2] == pytest.approx(0.1 * (0.001 * 0.5 + 0.5))  # linear half-way
    assert lrs[4] == pytest.approx(0.1)  # warmup over after 4 iterations
    assert lrs[9] == pytest.approx(0.1)  # last iteration of epoch 2 (0-based epoch 1)
    assert lrs[10] == pytest.approx(0.01)  # first iteration of 0-based epoch 2: first drop
    assert lrs[15] == pytest.approx(0.001)  # second drop at epoch 3
    assert lrs[19] == pytest.approx(0.001)


def test_cosine_reaches_zero_and_adamw() -> None:
    solver = _solver(scheduler="cosine", warmup_iters=0, optimizer="adamw")
    fn = lr_factor_fn("cosine", total_iters=10)
    assert fn(0) == 1.0 and fn(5) == pytest.approx(0.5) and fn(10) == pytest.approx(0.0)
    lrs = _lrs(solver, ipe=5, total=10, n=10)
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[-1] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 9 / 10)))


def test_auto_scale_lr() -> None:
    solver = _solver(auto_scale_lr=True, batch_size=2, reference_batch=16)
    assert scaled_lr(solver, world_size=8) == pytest.approx(0.1)
    assert scaled_lr(solver, world_size=2) == pytest.approx(0.025)
    assert scaled_lr(_solver(), world_size=8) == pytest.approx(0.1)


# ---- tiny trainings ------------------------------------------------------------------------


@pytest.mark.slow
def test_train_maskrcnn_dropit_two_iterations(tmp_path, tiny_shapes) -> None:
    run = tmp_path / "run"
    result = train(
        MASK_DROPIT_CFG,
        tiny_opts(tiny_shapes, "solver.max_iters=2", "train.measure_memory=true"),
        output_dir=run,
    )
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "eval.json",
        "memory.json",
        "coco_results_bbox.json",
        "coco_results_segm.json",
        "checkpoints/last_checkpoint",
        "checkpoints/model_0000002.pth",
    ):
        assert (run / name).is_file(), name
    final = json.loads((run / "eval.json").read_text())
    assert final["iter"] == 2 and final["num_images"] == 4
    check_ap(final["bbox"])
    check_ap(final["segm"])
    assert result.metrics["bbox"] == final["bbox"]
    records = train_records(run)
    assert [r["iter"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["loss"] == pytest.approx(sum(r[k] for k in (*LOSS_KEYS, "loss_mask")))
        assert r["images_per_sec"] > 0 and r["peak_mem_mb"] > 0 and r["epoch"] == 1
        # the box sampler's picks per image: the ground truth at least, at most 32 (tiny_opts)
        assert r["num_fg_samples"] >= 1 and r["num_fg_samples"] + r["num_bg_samples"] <= 32
    assert records[0]["lr"] == pytest.approx(0.03 * 0.001)  # demo lr, warmup start
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r["type"] == "eval"]
    assert [e["iter"] for e in evals] == [2]
    memory = json.loads((run / "memory.json").read_text())
    assert memory["images_per_sec"] > 0
    # PeakMeter's figures (torch's CPU allocations here): the step's own above its start, the
    # total with it, and the largest peak the training logged, the same meter's
    assert memory["memory_source"] == "cpu" and memory["peak_phase"] in ("forward", "backward")
    total = memory["held_at_start_mb"] + memory["step_peak_mb"]
    assert memory["step_peak_total_mb"] == pytest.approx(total)
    assert memory["train_peak_mb"] == max(r["peak_mem_mb"] for r in records)
    # the weights and the batch at least: a peak of tensors, not of the process (RSS)
    assert memory["held_at_start_mb"] > 1 and memory["step_peak_total_mb"] < 500
    assert memory["saved_mb"] > 0 and memory["by_type"]["Conv2d"] > 0
    assert memory["saved_mb"] == pytest.approx(memory["converted_mb"] + memory["unconverted_mb"])
    assert memory["converted_mb"] > 0
    assert memory["dropit"]["setting"] == "DropIT mink(gamma=0.8)"
    (rule,) = memory["dropit"]["rules"]
    assert (rule["strategy"], rule["gamma"], rule["include"]) == ("mink", 0.8, ["*"])
    # the same step without DropIT keeps more: the ratio is what the demo's last line shows
    assert memory["saved_mb_without_dropit"] > 1.5 * memory["saved_mb"]
    ratio = memory["saved_mb"] / memory["saved_mb_without_dropit"]
    assert memory["saved_ratio"] == pytest.approx(ratio, abs=1e-4)
    saved = yaml.safe_load((run / "config.yaml").read_text())["dropit"]
    assert saved["enabled"] is True and saved["strategy"] == "mink"
    state = load_checkpoint(run / "checkpoints/model_0000002.pth")
    assert (state["version"], state["iteration"], state["iters_per_epoch"]) == (2, 2, 4)
    assert state["loop"] == {
        "log_window": {"count": 0, "losses": {}, "time": 0.0, "data_time": 0.0},
        "skipped_steps": 0,
    }
    assert not any(k.startswith("module.") for k in state["model"])
    log = (run / "log.txt").read_text()  # the console lines, also in the run's log file
    assert "INFO training maskrcnn for 2 iterations (4 per epoch, 1 process(es) on cpu)" in log
    assert "INFO final evaluation (4 images)" in log
    code = next(line for line in log.splitlines() if "INFO code: rcnn_dropit" in line)
    assert f" from '{source_roots()[0]}' (" in code and f"torch {torch.__version__}" in code
    positives = memory["positive_rois_per_image"]  # the trained model's heads, counted
    assert 1 <= positives <= 8  # tiny_opts: 32 RoIs per image, at most a quarter positive
    summary = (
        f"DropIT mink(gamma=0.8); activations kept for backward in one step (the trained "
        f"model's, {positives:.0f} positive RoIs per image): {memory['saved_mb']:.1f} MB, "
        f"{memory['saved_mb_without_dropit']:.1f} MB without DropIT "
        f"({memory['saved_ratio']:.2f}x)"
    )
    assert summary in log


@pytest.mark.parametrize(
    ("opts", "line"),
    [
        (["dropit.enabled=false"], "DropIT off"),
        (["dropit.enabled=true", "dropit.gamma=0.9"], "DropIT mink(gamma=0.9)"),
        # quant does not use gamma, so the line does not show it
        (["dropit.strategy=quant", "dropit.options={bits: 2}"], "DropIT quant(bits=2, group=256)"),
        (
            [
                "dropit.rules=[{include: [backbone.*], strategy: mink},"
                " {include: [rpn.*, roi_heads.*], strategy: quant, options: {bits: 4}}]"
            ],
            "DropIT mink(gamma=0.8) on backbone.*; quant(bits=4, group=256) on rpn.*, roi_heads.*",
        ),
    ],
)
def test_the_run_names_its_dropit_setting(opts: list[str], line: str) -> None:
    from rcnn_dropit.engine.memory_report import dropit_setting

    assert dropit_setting(load_config(MASK_DROPIT_CFG, opts).dropit) == line


@pytest.fixture(scope="module")
def faster_straight(tmp_path_factory, tiny_shapes) -> Path:
    """Faster R-CNN trained 4 iterations (one epoch of 8 images) without interruption."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(FASTER_CFG, tiny_opts(tiny_shapes, "solver.max_iters=4"), output_dir=run)
    return run


@pytest.mark.slow
def test_train_fasterrcnn_eval(faster_straight) -> None:
    final = json.loads((faster_straight / "eval.json").read_text())
    assert set(final) == {"bbox", "num_images", "iter"}
    assert final["num_images"] == 4 and final["iter"] == 4
    check_ap(final["bbox"])
    assert not (faster_straight / "coco_results_segm.json").exists()
    assert [r["iter"] for r in train_records(faster_straight)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_matches_uninterrupted(tmp_path, tiny_shapes, faster_straight) -> None:
    run = tmp_path / "run"
    opts = tiny_opts(tiny_shapes, "solver.max_iters=4", "train.checkpoint_every_iters=2")
    train_killed_at(FASTER_CFG, opts, run, 3)  # killed mid-epoch, after the checkpoint at 2
    assert [r["iter"] for r in train_records(run)] == [1, 2]
    with open(run / "metrics.jsonl", "a") as f:  # a record the killed run wrote past its checkpoint
        f.write(json.dumps({"type": "train", "iter": 3, "loss": 0.0}) + "\n")

    train(FASTER_CFG, opts, output_dir=run, resume="auto")

    straight = load_checkpoint(faster_straight / "checkpoints/model_0000004.pth")
    resumed = load_checkpoint(run / "checkpoints/model_0000004.pth")
    assert straight["model"].keys() == resumed["model"].keys()
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    a, b = train_records(faster_straight), train_records(run)
    assert [r["iter"] for r in b] == [1, 2, 3, 4]  # nothing duplicated
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "lr", *LOSS_KEYS):
            assert ra[key] == rb[key], (ra["iter"], key)
    assert (
        json.loads((run / "eval.json").read_text())["bbox"]
        == json.loads((faster_straight / "eval.json").read_text())["bbox"]
    )
    # each start records the code it ran (a resume may run other code than the start did)
    assert (run / "log.txt").read_text().count("INFO code: rcnn_dropit") == 2


@pytest.mark.slow
def test_resume_redoes_an_unfinished_evaluation(tmp_path, tiny_shapes, faster_straight) -> None:
    run = tmp_path / "run"
    shutil.copytree(faster_straight, run)
    (run / "eval.json").unlink()
    kept = [r for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    opts = tiny_opts(tiny_shapes, "solver.max_iters=4")
    result = train(FASTER_CFG, opts, output_dir=run, resume="auto")  # killed while evaluating
    assert result.iteration == 4 and (run / "eval.json").is_file()
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["type"], r["iter"]) for r in records][-2:] == [("train", 4), ("eval", 4)]
    assert records[-1]["bbox"] == json.loads((faster_straight / "eval.json").read_text())["bbox"]


@pytest.mark.slow
def test_resuming_a_finished_run_evaluates_nothing_again(
    tmp_path, tiny_shapes, faster_straight, monkeypatch
) -> None:
    run = tmp_path / "run"
    shutil.copytree(faster_straight, run)
    before = (run / "metrics.jsonl").read_text()
    monkeypatch.setattr(Trainer, "run_eval", lambda self, it: pytest.fail(f"evaluated {it}"))
    result = train(
        FASTER_CFG, tiny_opts(tiny_shapes, "solver.max_iters=4"), output_dir=run, resume="auto"
    )
    assert result.iteration == 4
    assert (run / "metrics.jsonl").read_text() == before  # no second eval record
    final = json.loads((faster_straight / "eval.json").read_text())
    assert result.metrics["bbox"] == final["bbox"]
    assert json.loads((run / "eval.json").read_text()) == final


# ---- guards ----------------------------------------------------------------------------------


def test_used_output_dir_is_refused(tmp_path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="is not empty; pass --resume auto .* --overwrite"):
        RunDir(run).check(resume=None, overwrite=False)
    RunDir(run).check(resume="auto", overwrite=False)  # resuming is allowed
    RunDir(run).check(resume=None, overwrite=True)
    # only our files set aside (until the new run can stand alone)
    assert sorted(p.name for p in run.iterdir()) == [".replaced", "notes.txt"]
    RunDir(tmp_path / "new").check(resume=None, overwrite=False)


@pytest.mark.slow  # a training run
def test_overwrite_replaces_the_old_run_once_the_new_one_finishes(tmp_path, tiny_shapes) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints/model_0000009.pth").write_bytes(b"old weights")
    (run / "eval.json").write_text('{"old": true}')
    (run / "notes.txt").write_text("mine")
    opts = tiny_opts(tiny_shapes, "solver.max_iters=1")
    train(MASK_CFG, opts, output_dir=run, overwrite=True)
    assert not (run / ".replaced").exists()  # gone with the new run's success
    assert "old" not in json.loads((run / "eval.json").read_text())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "last_checkpoint",
        "model_0000001.pth",
    ]
    assert (run / "notes.txt").read_text() == "mine"


@pytest.mark.slow  # a training run
def test_resume_auto_starts_over_a_run_stopped_before_its_first_checkpoint(
    tmp_path, tiny_shapes
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.txt").write_text("preempted at iteration 3\n")
    (run / "metrics.jsonl").write_text('{"type": "train", "iter": 3}\n')
    train(MASK_CFG, tiny_opts(tiny_shapes, "solver.max_iters=1"), output_dir=run, resume="auto")
    assert [r["iter"] for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"] == [1]
    assert "no checkpoint in" in (run / "log.txt").read_text()  # said where it is read later
    assert (run / "eval.json").is_file() and not (run / ".replaced").exists()


def test_train_refuses_used_output_dir(tmp_path, tiny_shapes) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="not empty"):
        train(MASK_CFG, tiny_opts(tiny_shapes, "solver.max_iters=1"), output_dir=run)
    assert (run / "metrics.jsonl").read_text() == "{}\n"


def test_a_bug_shows_its_traceback_and_log_txt_keeps_it(tmp_path, tiny_shapes, monkeypatch, capsys):
    # Not a usage error: the console gets the traceback, the run folder stays, and its log.txt
    # holds the whole traceback for whoever looks later.
    def broken(self, start_iter=0, rng_state=None):
        return {}["loss_mask"]

    monkeypatch.setattr(Trainer, "train", broken)
    run = tmp_path / "run"
    args = ["--config", str(FASTER_CFG), "--output-dir", str(run)]
    proc = call_tool("train.py", *args, "--opts", *tiny_opts(tiny_shapes), capsys=capsys)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and proc.stderr.rstrip().endswith("KeyError: 'loss_mask'")
    log = (run / "log.txt").read_text()
    assert "ERROR error: 'loss_mask'" in log and "Traceback" in log and ", in broken" in log


def test_a_usage_error_is_one_line_with_nothing_left_behind(tmp_path, tiny_shapes, capsys):
    run = tmp_path / "run"
    opts = [*tiny_opts(tiny_shapes), "dropit.enabled=true", "dropit.exclude=[roi_heads.nothing]"]
    args = ["--config", str(FASTER_CFG), "--output-dir", str(run), "--opts", *opts]
    proc = call_tool("train.py", *args, capsys=capsys)
    assert_one_line_error(proc, "exclude pattern 'roi_heads.nothing' matches no module")
    assert not run.exists()


def test_nonfinite_loss_stops_with_terms(tmp_path, tiny_shapes, monkeypatch) -> None:
    real_build = runner_module.build_model

    def build_nan_model(cfg, sync_bn=False):
        model, record = real_build(cfg, sync_bn)
        forward = model.forward

        def nan_forward(images, targets=None):
            out = forward(images, targets)
            if model.training:
                out["loss_box_reg"] = out["loss_box_reg"] * float("nan")
            return out

        model.forward = nan_forward
        return model, record

    monkeypatch.setattr(runner_module, "build_model", build_nan_model)
    with pytest.raises(FloatingPointError) as info:
        train(FASTER_CFG, tiny_opts(tiny_shapes, "solver.max_iters=2"), output_dir=tmp_path / "r")
    message = str(info.value)
    assert "iteration 1" in message and "loss_box_reg=nan" in message
    assert "loss_classifier=" in message and "solver.nonfinite=skip" in message


def test_train_checks_the_data_set_once(tmp_path, tiny_shapes, monkeypatch) -> None:
    from rcnn_dropit.data import loader as loader_module

    calls = []
    real = runner_module.ensure_dataset
    monkeypatch.setattr(runner_module, "ensure_dataset", lambda cfg: calls.append(1) or real(cfg))
    monkeypatch.setattr(loader_module, "ensure_dataset", lambda cfg: calls.append("loader"))
    # stop right after the loaders are built: the rest of a run does not touch the data set
    monkeypatch.setattr(runner_module, "total_iterations", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train(FASTER_CFG, tiny_opts(tiny_shapes, "solver.max_iters=1"), output_dir=tmp_path / "r")
    assert calls == [1]
    assert not (tmp_path / "r").exists()  # nothing written before the run starts


@pytest.mark.parametrize(
    ("epochs", "ipe", "max_iters", "says"),
    [
        (100, 95, 9600, "stops at 9500; solver.epochs=102 or more trains 9600"),
        (100, 95, 9500, None),  # exactly what the epochs hold
        (100, 95, 4800, None),  # max_iters caps, as documented
        (2, 10, None, None),
        (1, 3, 4, "solver.epochs 1 x 3 iterations per epoch: training stops at 3"),
    ],
)
def test_a_max_iters_beyond_the_epochs_is_named(epochs, ipe, max_iters, says) -> None:
    message = short_of_max_iters(epochs, ipe, max_iters)
    if says is None:
        assert message is None
    else:
        assert says in message and f"solver.max_iters {max_iters} is more than" in message


def test_train_warns_when_the_epochs_end_before_max_iters(
    tmp_path, tiny_shapes, monkeypatch, capsys
) -> None:
    # stop right after the schedule is worked out: the warning comes before any training
    monkeypatch.setattr(runner_module, "build_optimizer_and_scheduler", lambda *a, **k: 1 / 0)
    opts = tiny_opts(tiny_shapes, "solver.max_iters=100000")
    with pytest.raises(ZeroDivisionError):
        train(FASTER_CFG, [*opts, "solver.epochs=1"], output_dir=tmp_path / "r")
    said = capsys.readouterr()
    err = said.out + said.err  # the console; the run failed before a checkpoint: no folder
    assert "solver.max_iters 100000 is more than solver.epochs 1 x" in err
    assert "solver.epochs=" in err and "or more trains 100000" in err


class _ToyDetector(nn.Module):
    """Returns a loss dict like torchvision detectors; NaN on chosen calls."""

    def __init__(self, nan_calls: set[int]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.calls = 0
        self.nan_calls = nan_calls

    def forward(self, images, targets):
        self.calls += 1
        loss = (self.w**2).sum()
        if self.calls in self.nan_calls:
            loss = loss * float("nan")
        return {"loss_classifier": loss, "loss_box_reg": loss * 0.5}


def _toy_trainer(nonfinite: str, nan_calls: set[int], scaler=None) -> Trainer:
    options = StepOptions(batch_size=1, nonfinite=nonfinite, clip_grad_norm=1.0)
    model = _ToyDetector(nan_calls)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    schedule = Schedule(4, 4, 1, 0, 0, 0)
    return Trainer(
        model, opt, sched, scaler, None, torch.device("cpu"), options, schedule, NullWriter(),
        progress=False,
    )  # fmt: skip


def test_eval_every_iters_checkpoints_then_evaluates() -> None:
    schedule = Schedule(10, 40, 5, 0, 0, 0, eval_every_iters=15)
    evals = [i for i in range(1, 41) if schedule.should_eval(i)]
    ckpts = [i for i in range(1, 41) if schedule.should_checkpoint(i)]
    assert evals == [15, 30, 40]
    assert ckpts == evals  # every evaluation has the checkpoint of the weights it scores
    assert [i for i in range(1, 41) if Schedule(10, 40, 5, 2, 0, 0).should_eval(i)] == [20, 40]


def test_nonfinite_skip_leaves_weights_and_counts() -> None:
    trainer = _toy_trainer("skip", nan_calls={2})
    trainer.step([], [], 1)
    after_first = trainer.model.w.detach().clone()
    logged = trainer.step([], [], 2)
    assert math.isnan(logged["loss"]) and trainer.skipped_steps == 1
    assert torch.equal(trainer.model.w.detach(), after_first)  # no update from the NaN step
    assert trainer.scheduler.last_epoch == 2  # the schedule still follows iterations
    trainer.step([], [], 3)
    assert not torch.equal(trainer.model.w.detach(), after_first)


def test_scaled_step_clips_true_gradients() -> None:
    # GradScaler("cpu") runs the same code path as the CUDA fp16 scaler used in training.
    trainer = _toy_trainer("stop", nan_calls=set(), scaler=torch.amp.GradScaler("cpu"))
    before = trainer.model.w.detach().clone()
    trainer.step([], [], 1)
    # d/dw of 1.5 * |w|^2 at w=1 is 3 per element; clipped to norm 1 before the lr 0.1 step
    expected = before - 0.1 * torch.full((2,), 1 / math.sqrt(2))
    assert torch.allclose(trainer.model.w.detach(), expected, atol=1e-5)
    assert trainer.scaler.get_scale() == 65536.0


def test_truncate_metrics(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"type": "train", "iter": i} for i in (1, 2, 3)] + [{"type": "eval", "iter": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"type": "tr')
    assert truncate_metrics(path, 2) == 2
    assert [r["iter"] for r in read_metrics(path)] == [1, 2]


# ---- peak memory per logging window ---------------------------------------------------------


class _ListWriter:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def test_peak_mem_mb_is_the_logged_steps_peak_and_covers_only_its_window() -> None:
    trainer = _toy_trainer("stop", nan_calls=set())
    trainer.writer = _ListWriter()
    real_forward = trainer.model.forward

    def forward_with_a_big_transient(images, targets):
        if trainer.model.calls == 0:  # first window only: 400 MB made, then freed
            torch.ones(100 * 2**20).sum()
        return real_forward(images, targets)

    trainer.model.forward = forward_with_a_big_transient
    bar = tqdm(disable=True)
    for iteration in (1, 2):
        trainer.window.add(trainer._step_in_window([], [], iteration), 0.1, 0.0)
        trainer._log(iteration, bar)
    first, second = (r["peak_mem_mb"] for r in trainer.writer.records)
    # PeakMeter's peak (torch's CPU allocations, exact): the transient, plus the toy's bytes
    assert 400 <= first < 401 and second < 1  # the second window no longer reports the first's
    assert trainer.largest_peak_mb == first


# ---- fp16 skipped steps ----------------------------------------------------------------------


def test_skipped_scaled_step_still_steps_the_schedule_without_torchs_warning() -> None:
    # A first scale of 2**127 overflows the scaled loss: GradScaler skips the optimizer step,
    # exactly what fp16 training does in its first iterations.
    trainer = _toy_trainer("stop", set(), scaler=torch.amp.GradScaler("cpu", init_scale=2.0**127))
    before = trainer.model.w.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.step([], [], 1)
    assert torch.equal(trainer.model.w.detach(), before)  # the optimizer step was skipped
    assert trainer.scaler.get_scale() == 2.0**126 and trainer.scheduler.last_epoch == 1
    assert [str(w.message) for w in caught] == []


def test_step_scheduler_silences_only_the_scheduler_order_warning() -> None:
    def fresh():
        opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh().step()  # torch warns: the optimizer never stepped
        order_warnings = len(caught)
        scheduler = fresh()
        real_step = scheduler.step

        def step_and_warn():
            warnings.warn("another warning", UserWarning, stacklevel=1)
            real_step()

        scheduler.step = step_and_warn
        step_scheduler(scheduler)
    assert order_warnings == 1 and "before `optimizer.step()`" in str(caught[0].message)
    assert [str(w.message) for w in caught[1:]] == ["another warning"]
    assert scheduler.last_epoch == 1


# ---- mixed precision -------------------------------------------------------------------------


@pytest.mark.parametrize("amp, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_runs_the_forward_in_the_solver_amp_dtype(amp: str, dtype: torch.dtype) -> None:
    layer = nn.Linear(4, 3)
    with autocast(amp, torch.device("cpu")):
        assert layer(torch.ones(2, 4)).dtype == dtype
    with autocast("none", torch.device("cpu")):
        assert layer(torch.ones(2, 4)).dtype == torch.float32


def test_amp_values_are_checked_and_fp16_needs_cuda() -> None:
    with pytest.raises(UsageError, match="amp='fp8' is invalid: allowed fp16, bf16 or none"):
        autocast("fp8", torch.device("cpu"))
    with pytest.raises(UsageError, match="fp16 needs a CUDA device"):
        make_scaler("fp16", torch.device("cpu"))
    assert make_scaler("bf16", torch.device("cpu")) is None

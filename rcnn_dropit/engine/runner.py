"""Run setup for training and testing: output dir, seeding, model/data/optimizer, DDP, resume."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from rcnn_dropit.checkpoint import (
    check_model_compat,
    find_last_checkpoint,
    resolve_resume,
)
from rcnn_dropit.config import Config, dump_config, load_config
from rcnn_dropit.data import build_train_loader, build_val_loader, ensure_dataset
from rcnn_dropit.distributed import (
    DistInfo,
    cleanup,
    init_distributed,
    is_main_process,
    run_on_main,
)
from rcnn_dropit.engine.evaluator_loop import evaluate, iou_types_for
from rcnn_dropit.engine.memory_report import write_memory_report
from rcnn_dropit.engine.optim import build_optimizer_and_scheduler, total_iterations
from rcnn_dropit.engine.rank_state import load_on_every_rank, rng_state_for_rank
from rcnn_dropit.engine.trainer import Schedule, Trainer
from rcnn_dropit.evaluation import format_metrics_table
from rcnn_dropit.logging_utils import MetricsWriter, NullWriter, read_metrics, truncate_metrics
from rcnn_dropit.models import build_model

# What a run writes; --overwrite removes exactly these, never anything else in the folder.
RUN_ARTIFACTS = (
    "config.yaml",
    "metrics.jsonl",
    "metrics.jsonl.tmp",
    "checkpoints",
    "coco_results_bbox.json",
    "coco_results_segm.json",
    "eval.json",
    "memory.json",
)


def say(message: str) -> None:
    """Print a line on rank 0 (through tqdm so progress bars stay intact)."""
    if is_main_process():
        tqdm.write(message)


def resolve_output_dir(cfg: Config, output_dir: str | Path | None = None) -> Path:
    """--output-dir, else train.output_dir, else outputs/<name> (name defaults to the stem)."""
    if output_dir:
        return Path(output_dir)
    if cfg.train.output_dir:
        return Path(cfg.train.output_dir)
    return Path("outputs") / (cfg.name or "run")


def check_output_dir(out: Path, resume: str | None, overwrite: bool, clear: bool = True) -> None:
    """Refuse to mix a new run into a used folder; --overwrite clears our own files first
    (unless clear=False: check only, so nothing is lost if a later check fails)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"output dir '{out}' exists and is not a folder")
    if resume is not None or not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ValueError(
            f"output dir '{out}' is not empty; pass --resume auto to continue that run, "
            "--overwrite to replace it, or --output-dir to choose another folder"
        )
    if clear:
        remove_run_artifacts(out)


def remove_run_artifacts(out: Path) -> None:
    """Delete the files a run writes (RUN_ARTIFACTS) from out, nothing else."""
    for name in RUN_ARTIFACTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def seed_all(seed: int) -> None:
    """Seed python, numpy (if present) and torch generators."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def prepare_model(cfg: Config, info: DistInfo) -> tuple[nn.Module, nn.Module]:
    """(model to train, plain model): DropIT-converted, on device, SyncBN and DDP as configured."""
    net, _record = build_model(cfg)
    if cfg.train.sync_bn and info.distributed:
        if cfg.model.norm != "bn":
            say("note: train.sync_bn ignored: model.norm is frozen_bn (nothing to synchronise)")
        elif info.device.type != "cuda":
            say("note: train.sync_bn ignored: SyncBatchNorm needs CUDA devices")
        else:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net.to(info.device)
    if not info.distributed:
        return net, net
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(net, device_ids=device_ids), net


def make_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler | None:
    """GradScaler for fp16 on CUDA; bf16 and fp32 need none."""
    if amp != "fp16":
        return None
    if device.type != "cuda":
        raise ValueError("solver.amp: fp16 needs a CUDA device; use bf16 or none on CPU")
    return torch.amp.GradScaler("cuda")


def restore_training_state(
    state: dict,
    path: Path,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
    iters_per_epoch: int,
) -> None:
    """Load weights, optimizer, scheduler and scaler from a checkpoint (RNG comes later)."""
    lacking = [k for k in ("model", "optimizer", "scheduler", "iteration", "rng") if k not in state]
    if lacking:
        raise ValueError(
            f"--resume: '{path}' is not a training checkpoint (it lacks {', '.join(lacking)}); "
            "to start from its weights use model.weights=PATH without --resume"
        )
    try:
        check_model_compat(net, state["model"])
    except ValueError as err:
        raise ValueError(f"--resume: checkpoint '{path}': {err}") from None
    done = state.get("sampler", {}).get("iters_per_epoch", iters_per_epoch)
    if done != iters_per_epoch:
        raise ValueError(
            f"--resume: checkpoint '{path}' was written with {done} iterations per epoch, "
            f"this run has {iters_per_epoch} (batch size, world size or dataset changed)"
        )
    net.load_state_dict(state["model"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except ValueError as err:  # e.g. other trainable layers: parameter groups differ
        raise ValueError(
            f"--resume: checkpoint '{path}': its optimizer state does not fit this run ({err})"
        ) from None
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    say(f"resumed from '{path}' at iteration {state['iteration']}")


def say_dropped(dataset: object, split: str) -> None:
    """Tell the user how many images and boxes the data set left out, if any."""
    stats = getattr(dataset, "stats", {})
    parts = []
    if stats.get("skipped_missing_images"):
        parts.append(f"skipped {stats['skipped_missing_images']} missing or unreadable images")
    if stats.get("degenerate_boxes"):
        parts.append(f"dropped {stats['degenerate_boxes']} boxes with non-positive width or height")
    if parts:
        say(f"note: data ({split}): {'; '.join(parts)}")


@dataclass
class TrainResult:
    """What a finished training run produced."""

    output_dir: Path
    metrics: dict
    iteration: int


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def train(
    config: str | Path,
    overrides: Sequence[str] = (),
    resume: str | None = None,
    output_dir: str | Path | None = None,
    overwrite: bool = False,
) -> TrainResult:
    """Train per config (single process or under torchrun), evaluate, write the run directory."""
    cfg = load_config(config, overrides)
    info = init_distributed(cfg.train.device)
    out = resolve_output_dir(cfg, output_dir)
    created = not out.exists()
    try:
        return _train(cfg, info, resume, output_dir, overwrite)
    except (ValueError, FileNotFoundError):
        if created and is_main_process():
            discard_unfinished_run(out)
        raise
    finally:
        cleanup()


def discard_unfinished_run(out: Path) -> None:
    """Remove a run folder this invocation made if it holds no checkpoint yet.

    A bad input found only once training runs (e.g. an unreadable image) then leaves no
    half-made run directory behind.
    """
    if not out.is_dir() or find_last_checkpoint(out / "checkpoints") is not None:
        return
    remove_run_artifacts(out)
    if not any(out.iterdir()):
        out.rmdir()


def _train(
    cfg: Config,
    info: DistInfo,
    resume: str | None,
    output_dir: str | Path | None,
    overwrite: bool,
) -> TrainResult:
    out = resolve_output_dir(cfg, output_dir)
    scaler = make_scaler(cfg.solver.amp, info.device)
    # Everything a user can get wrong (data, model, checkpoint) is checked before the run
    # directory is touched, so a rejected run leaves no half-made folder behind.
    run_on_main(lambda: check_output_dir(out, resume, overwrite, clear=False))
    ckpt_path = run_on_main(lambda: resolve_resume(resume, out / "checkpoints"))
    if resume is not None and ckpt_path is None:
        say(f"note: no checkpoint in '{out / 'checkpoints'}'; starting from scratch")
    run_on_main(lambda: ensure_dataset(cfg))

    seed_all(cfg.train.seed)  # same initial weights on every rank
    model, net = prepare_model(cfg, info)
    seed_all(cfg.train.seed + info.rank)  # different augmentation/sampling noise per rank
    train_loader = build_train_loader(cfg, info.distributed, cfg.train.seed, info.device)
    val_loader = build_val_loader(cfg, info.distributed, info.device)
    say_dropped(train_loader.dataset, "train")
    say_dropped(val_loader.dataset, "val")
    ipe = len(train_loader.batch_sampler)
    if ipe == 0:
        raise ValueError(f"data: the training set of '{cfg.data.root}' yields no batches")
    total = total_iterations(cfg.solver.epochs, ipe, cfg.solver.max_iters)
    optimizer, scheduler = build_optimizer_and_scheduler(
        cfg.solver, model, ipe, total, world_size=info.world_size
    )

    state = None
    if ckpt_path is not None:
        state = load_on_every_rank(ckpt_path)
        restore_training_state(state, ckpt_path, net, optimizer, scheduler, scaler, ipe)

    def setup_dir() -> None:
        check_output_dir(out, resume, overwrite)  # --overwrite clears only now
        try:
            out.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, out / "config.yaml")
        except OSError as err:  # e.g. a file where a parent folder should be, no permission
            raise ValueError(
                f"output dir '{out}' cannot be written ({err.strerror or err}); "
                "choose another with --output-dir"
            ) from None

    run_on_main(setup_dir)

    start_iter = int(state["iteration"]) if state is not None else 0
    rng_state = rng_state_for_rank(state, info.rank, info.world_size) if state is not None else None
    if resume is not None:  # drop what the new run will redo
        run_on_main(lambda: truncate_metrics(out / "metrics.jsonl", start_iter))
    # A run killed while evaluating after its checkpoint: do that evaluation first.
    eval_missing = run_on_main(
        lambda: (
            start_iter > 0
            and not any(
                r.get("type") == "eval" and r.get("iter") == start_iter
                for r in read_metrics(out / "metrics.jsonl")
            )
        )
    )
    writer = run_on_main(lambda: MetricsWriter(out / "metrics.jsonl"), share=False) or NullWriter()

    def on_eval(iteration: int, metrics: dict) -> None:
        if iteration != total:  # the final table is printed once, below
            say(f"evaluation at iteration {iteration}:\n{format_metrics_table(metrics)}")

    schedule = Schedule(
        iters_per_epoch=ipe,
        total_iters=total,
        log_every=cfg.train.log_every,
        eval_every=cfg.train.eval_every,
        checkpoint_every=cfg.train.checkpoint_every,
        checkpoint_every_iters=cfg.train.checkpoint_every_iters,
    )
    trainer = Trainer(
        cfg,
        model,
        optimizer,
        scheduler,
        scaler,
        train_loader,
        val_loader,
        info.device,
        out,
        writer,
        schedule,
        iou_types_for(cfg.model.arch),
        on_eval=on_eval,
    )
    if state is not None:
        trainer.load_state(state)
    say(
        f"training {cfg.model.arch} for {total} iterations ({ipe} per epoch, "
        f"{info.world_size} process(es) on {info.device.type}) into '{out}'"
    )
    try:
        if eval_missing and schedule.should_eval(start_iter):
            trainer.run_eval(start_iter)
        trainer.train(start_iter, rng_state)
        metrics = trainer.last_eval
        if metrics is None or trainer.last_eval_iter != total:
            # e.g. resumed from the final checkpoint: its evaluation may never have finished
            metrics = trainer.run_eval(total)
        if cfg.train.measure_memory:
            write_memory_report(cfg, net, train_loader, info.device, trainer.images_per_sec, out)
    finally:
        writer.close()
    run_on_main(lambda: _write_json(out / "eval.json", {**metrics, "iter": total}))
    say(f"final evaluation ({metrics['num_images']} images):\n{format_metrics_table(metrics)}")
    return TrainResult(out, metrics, total)


def test(
    config: str | Path,
    checkpoint: str | Path,
    output_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> dict:
    """Evaluate a checkpoint's weights on the validation set; writes eval.json and COCO results."""
    cfg = load_config(config, overrides)
    info = init_distributed(cfg.train.device)
    try:
        ckpt = Path(checkpoint)

        def check_checkpoint() -> None:
            if not ckpt.is_file():
                raise FileNotFoundError(f"--checkpoint: file '{ckpt}' does not exist")

        run_on_main(check_checkpoint)  # rank 0 decides, so no rank fails alone
        out = Path(output_dir) if output_dir else resolve_output_dir(cfg) / "test"
        run_on_main(lambda: ensure_dataset(cfg))
        net, _record = build_model(cfg)
        state = load_on_every_rank(ckpt)
        weights = state["model"] if isinstance(state, dict) and "model" in state else state
        load_model_weights(net, weights, ckpt)
        net.to(info.device)
        val_loader = build_val_loader(cfg, info.distributed, info.device)
        # made only once the checkpoint and the data are known to be good
        run_on_main(lambda: out.mkdir(parents=True, exist_ok=True))
        metrics = evaluate(net, val_loader, info.device, iou_types_for(cfg.model.arch), out)
        iteration = state.get("iteration") if isinstance(state, dict) else None
        record = {**metrics, "iter": iteration, "checkpoint": str(ckpt)}
        run_on_main(lambda: _write_json(out / "eval.json", record))
        say(f"evaluation of '{ckpt}' ({metrics['num_images']} images):")
        say(format_metrics_table(metrics))
        return metrics
    finally:
        cleanup()


def load_model_weights(net: nn.Module, weights: dict, path: Path) -> None:
    """Load a checkpoint's model weights, failing with one message naming what does not fit."""
    try:
        check_model_compat(net, weights)
    except ValueError as err:
        raise ValueError(f"--checkpoint '{path}': {err}") from None
    net.load_state_dict(weights)

"""train() and test(): config -> built parts -> resume -> run, into a run directory."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from dropit_core import pack_backend
from rcnn_dropit.checkpoint.checkpointer import (
    Checkpointer,
    ResumePoint,
    format_version,
    load_on_every_rank,
    model_weights,
)
from rcnn_dropit.checkpoint.files import find_last_checkpoint, resolve_resume
from rcnn_dropit.config import Config, config_yaml, load_config
from rcnn_dropit.data import build_train_loader, build_val_loader, ensure_dataset
from rcnn_dropit.distributed import (
    DistInfo,
    cleanup,
    init_distributed,
    main_only,
    run_on_main,
)
from rcnn_dropit.engine.amp import make_scaler
from rcnn_dropit.engine.budget import out_of_memory_message, settle_method, write_choice
from rcnn_dropit.engine.compiling import compile_model
from rcnn_dropit.engine.determinism import deterministic_algorithms, set_cublas_workspace
from rcnn_dropit.engine.evaluator_loop import evaluate, iou_types_for
from rcnn_dropit.engine.memory_report import dropit_summary, measure_memory
from rcnn_dropit.engine.optim import (
    build_optimizer_and_scheduler,
    short_of_max_iters,
    total_iterations,
)
from rcnn_dropit.engine.trainer import Schedule, StepOptions, Trainer
from rcnn_dropit.errors import UsageError, one_line, require_path
from rcnn_dropit.evaluation import format_metrics_table
from rcnn_dropit.models import build_model
from rcnn_dropit.models.buckets import size_buckets
from rcnn_dropit.models.build import trainable_batch_norm
from rcnn_dropit.models.weights import check_model_compat
from rcnn_dropit.provenance import describe_code
from rcnn_dropit.rng import seed_all
from rcnn_dropit.run_dir import RunDir
from rcnn_dropit.tensorboard import require_tensorboard

log = logging.getLogger(__name__)  # a child of LOGGER_NAME: the run directory's handlers


def say(message: str) -> None:
    """A line for the user: rank 0's console (through tqdm, so progress bars stay intact) and
    log.txt, once the run's logging is started."""
    log.info(message)


def log_error(err: BaseException) -> None:
    """A failure into log.txt (other ranks: their log files) with its traceback, once the run
    folder exists; the console's line or traceback is the tool's (rcnn_dropit.cli.run_cli)."""
    log.error(f"error: {one_line(err)}", exc_info=err, extra={"file_only": True})


def resolve_output_dir(cfg: Config, output_dir: str | Path | None = None) -> Path:
    """--output-dir, else train.output_dir, else outputs/<name> (name defaults to the stem)."""
    if output_dir:
        return Path(output_dir)
    if cfg.train.output_dir:
        return Path(cfg.train.output_dir)
    return Path("outputs") / (cfg.name or "run")


def prepare_model(cfg: Config, info: DistInfo) -> tuple[nn.Module, nn.Module]:
    """(model to train, plain model): DropIT-converted, on device, SyncBN and DDP as configured."""
    sync_bn = False
    if cfg.train.sync_bn and info.distributed:
        if not trainable_batch_norm(cfg.model):
            say(
                f"note: train.sync_bn ignored: no BatchNorm trains (model.norm is "
                f"{cfg.model.norm}, heads {cfg.model.heads}): nothing to synchronise"
            )
        elif info.device.type != "cuda":
            say("note: train.sync_bn ignored: SyncBatchNorm needs CUDA devices")
        else:
            sync_bn = True
    net, _record = build_model(cfg, sync_bn=sync_bn)
    if cfg.solver.accumulate > 1 and any(isinstance(m, _BatchNorm) for m in net.modules()):
        micro = cfg.solver.batch_size / cfg.solver.accumulate
        say(
            f"note: solver.accumulate={cfg.solver.accumulate} with trainable BatchNorm: each "
            f"micro-batch of ~{micro:g} image(s) is normalised with its own statistics, so "
            "training differs from one batch of solver.batch_size (exact with model.norm=frozen_bn)"
        )
    net.to(info.device)
    # in place: the same parameters and state_dict
    compile_model(net, cfg.train.compile, cfg.train.compile_backend, cfg.train.compile_mode)
    if not info.distributed:
        return net, net
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(net, device_ids=device_ids), net


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


@dataclass
class Parts:
    """Everything a training run is made of, built once from the config."""

    model: nn.Module  # what trains: the DDP wrapper when distributed
    net: nn.Module  # the plain model inside it (checkpoints, evaluation, memory report)
    train_loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    schedule: Schedule
    checkpointer: Checkpointer


def train(
    config: str | Path,
    overrides: Sequence[str] = (),
    resume: str | None = None,
    output_dir: str | Path | None = None,
    overwrite: bool = False,
) -> TrainResult:
    """Train per config (single process or under torchrun), evaluate, write the run directory."""
    cfg = load_config(config, overrides)
    if cfg.train.deterministic:  # before CUDA starts: cuBLAS sizes its workspace from it once
        set_cublas_workspace()
    info = init_distributed(cfg.train.device)
    run_dir = RunDir(resolve_output_dir(cfg, output_dir))
    created = not run_dir.root.exists()
    run_dir.start_logging()
    try:
        with deterministic_algorithms(cfg.train.deterministic):
            result = _train(cfg, info, run_dir, resume, overwrite)
    except Exception as err:
        log_error(err)
        usage = isinstance(err, UsageError)
        main_only(lambda: settle_failed_run(run_dir, created, usage))
        raise
    finally:
        run_dir.stop_logging()
        cleanup()
    return result


def settle_failed_run(run_dir: RunDir, created: bool, usage: bool) -> None:
    """What a failed run leaves: nothing of itself, when a bad input (found only once training
    runs, e.g. an unreadable image) stopped it before its first checkpoint, and the run an
    --overwrite set out to replace put back; after a checkpoint, the new run, to resume. A bug
    before the first checkpoint leaves its files (log.txt holds the traceback) and the replaced
    run where it is, and says where."""
    out = run_dir.root
    if not out.is_dir():
        return
    if find_last_checkpoint(run_dir.checkpoints) is not None:
        run_dir.drop_replaced()
        return
    if not usage:
        if run_dir.replaced.is_dir():
            say(f"note: the run this one was to replace is kept in '{run_dir.replaced}'")
        return
    if run_dir.restore_replaced():
        say(f"note: '{out}' holds the run it held before, untouched")
        return
    if created:
        run_dir.remove_artifacts()
        if not any(out.iterdir()):
            out.rmdir()


def _train(
    cfg: Config, info: DistInfo, run_dir: RunDir, resume: str | None, overwrite: bool
) -> TrainResult:
    # Everything a user can get wrong (data, model, checkpoint) is checked before the run
    # directory is touched, so a rejected run leaves no half-made folder behind.
    scaler = make_scaler(cfg.solver.amp, info.device)
    if cfg.train.tensorboard:
        require_tensorboard()  # on every rank, before anything is built or written
    ckpt_path = run_on_main(lambda: resolve_resume(resume, run_dir.checkpoints))
    if resume is not None and ckpt_path is None:
        run_on_main(lambda: _fresh_start_allowed(run_dir, overwrite))
        say(f"note: no checkpoint in '{run_dir.checkpoints}'; starting from scratch")
        if overwrite:  # over a whole run, as asked: its files set aside as a fresh start's
            resume = None
    run_on_main(lambda: run_dir.check(resume, overwrite, clear=False))
    run_on_main(lambda: ensure_dataset(cfg))
    # train.memory_budget: the method measured now, or the one a resumed run chose at its start
    settled = settle_method(cfg, info, run_dir, resuming=ckpt_path is not None)
    cfg = settled.cfg
    parts = build(cfg, info, scaler, run_dir, settled.train_loader)
    start = parts.checkpointer.load(ckpt_path) if ckpt_path is not None else None
    if start is not None:
        say(f"resumed from '{ckpt_path}' at iteration {start.iteration}")
    run_on_main(lambda: run_dir.check(resume, overwrite))  # --overwrite clears only now
    run_dir.create(config_yaml(cfg))
    write_choice(run_dir, settled.choice)
    try:
        result = run(cfg, info, parts, run_dir, start, resumed=resume is not None)
    except torch.OutOfMemoryError as err:  # a budget's choice that did not hold: say why
        if settled.choice is None:
            raise
        raise UsageError(out_of_memory_message(settled.choice, info.device)) from err
    # The new run stands alone: rank 0 drops the one it replaced while the group lives, and
    # no rank leaves before it is done.
    run_on_main(run_dir.drop_replaced)
    return result


def _fresh_start_allowed(run_dir: RunDir, overwrite: bool) -> None:
    """--resume auto found nothing to resume: starting over is right for a run stopped before its
    first checkpoint, not over a finished run or checkpoint files that cannot be read."""
    if run_dir.holds_a_run() and not overwrite:
        raise UsageError(
            f"--resume auto: output dir '{run_dir.root}' holds a run (eval.json or checkpoint "
            f"files) but no readable checkpoint in '{run_dir.checkpoints}'; pass --overwrite to "
            "replace it, or --output-dir to choose another folder"
        )


def build(cfg: Config, info: DistInfo, scaler, run_dir: RunDir, train_loader=None) -> Parts:
    """Model, loaders, optimizer, scheduler, schedule and checkpointer of a run (the training
    loader as given, when one was built already: it draws nothing from the random streams)."""
    seed_all(cfg.train.seed)  # same initial weights on every rank
    model, net = prepare_model(cfg, info)
    seed_all(cfg.train.seed + info.rank)  # different augmentation/sampling noise per rank
    if train_loader is None:
        train_loader = build_train_loader(cfg, info.distributed, cfg.train.seed, info.device)
    val_loader = build_val_loader(cfg, info.distributed, info.device)
    say_dropped(train_loader.dataset, "train")
    say_dropped(val_loader.dataset, "val")
    ipe = len(train_loader.batch_sampler)
    if ipe == 0:
        raise UsageError(f"data: the training set of '{cfg.data.root}' yields no batches")
    total = total_iterations(cfg.solver.epochs, ipe, cfg.solver.max_iters)
    short = short_of_max_iters(cfg.solver.epochs, ipe, cfg.solver.max_iters)
    if short:
        log.warning(short)
    optimizer, scheduler = build_optimizer_and_scheduler(
        cfg.solver, model, ipe, total, world_size=info.world_size
    )
    schedule = Schedule(
        iters_per_epoch=ipe,
        total_iters=total,
        log_every=cfg.train.log_every,
        eval_every=cfg.train.eval_every,
        checkpoint_every=cfg.train.checkpoint_every,
        checkpoint_every_iters=cfg.train.checkpoint_every_iters,
        eval_every_iters=cfg.train.eval_every_iters,
    )
    checkpointer = Checkpointer(
        run_dir.checkpoints,
        net,
        optimizer,
        scheduler,
        scaler,
        iters_per_epoch=ipe,
        config=cfg.to_dict(),
        keep_last=cfg.train.keep_last,
    )
    return Parts(
        model, net, train_loader, val_loader, optimizer, scheduler, scaler, schedule, checkpointer
    )


def run(
    cfg: Config,
    info: DistInfo,
    parts: Parts,
    run_dir: RunDir,
    start: ResumePoint | None,
    resumed: bool,
) -> TrainResult:
    """Train from `start` (None: from scratch) to the end, evaluate, write the results."""
    start_iter = start.iteration if start is not None else 0
    total = parts.schedule.total_iters
    iou_types = iou_types_for(cfg.model.arch)
    # A run killed while evaluating after its checkpoint: do that evaluation first.
    recorded = run_dir.eval_record(start_iter) if start_iter > 0 else None
    eval_missing = start_iter > 0 and recorded is None
    writer = run_dir.open_metrics(start_iter if resumed else None, cfg.train.tensorboard)

    def evaluate_and_write() -> dict:
        metrics, results = evaluate(
            parts.model, parts.val_loader, info.device, iou_types, progress=info.is_main
        )
        run_dir.write_coco_results(results)
        return metrics

    def on_eval(iteration: int, metrics: dict) -> None:
        if iteration != total:  # the final table is printed once, below
            say(f"evaluation at iteration {iteration}:\n{format_metrics_table(metrics)}")

    trainer = Trainer(
        parts.model,
        parts.optimizer,
        parts.scheduler,
        parts.scaler,
        parts.train_loader,
        info.device,
        StepOptions.from_solver(cfg.solver),
        parts.schedule,
        writer,
        checkpointer=parts.checkpointer,
        evaluate=evaluate_and_write,
        on_eval=on_eval,
        progress=info.is_main,
        buckets=size_buckets(parts.net),
    )
    if start is not None:
        trainer.load_loop_state(start.loop)
    k = cfg.solver.accumulate
    accumulating = f", each in {k} micro-batches" if k > 1 else ""
    say(
        f"training {cfg.model.arch} for {total} iterations "
        f"({parts.schedule.iters_per_epoch} per epoch"
        f"{accumulating}, "
        f"{info.world_size} process(es) on {info.device.type}) into '{run_dir.root}'"
    )
    if cfg.dropit.enabled and info.device.type == "cuda":  # eager packs are several x slower
        backend = pack_backend(info.device)
        say(
            f"DropIT packs on {info.device.type}: {backend}"
            + ("" if backend == "triton" else " (no triton, or DROPIT_KERNELS=eager: slower)")
        )
    if info.is_main:  # which code made this run's figures (rank 0's log.txt; git asked once)
        log.info(describe_code(), extra={"file_only": True})
    try:
        if eval_missing and parts.schedule.should_eval(start_iter):
            trainer.run_eval(start_iter)
        trainer.train(start_iter, start.rng if start is not None else None)
        metrics = trainer.last_eval if trainer.last_eval_iter == total else None
        if metrics is None and start_iter == total:  # resumed a finished run: no second record
            metrics = recorded
        if metrics is None:  # e.g. resumed from the final checkpoint before its evaluation
            metrics = trainer.run_eval(total)
        report = None
        if cfg.train.measure_memory:
            report = measure_memory(
                cfg, parts.net, parts.train_loader, info.device, trainer.images_per_sec,
                trainer.largest_peak_mb,
            )  # fmt: skip
            run_dir.write_memory(report)
            writer.write({"type": "memory", "iter": total, **report}, tensorboard_only=True)
    finally:
        writer.close()
    run_dir.write_eval(metrics, iter=total)
    say(f"final evaluation ({metrics['num_images']} images):\n{format_metrics_table(metrics)}")
    say(dropit_summary(cfg, report))
    return TrainResult(run_dir.root, metrics, total)


def test(
    config: str | Path,
    checkpoint: str | Path,
    output_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> dict:
    """Evaluate a checkpoint's weights on the validation set; writes eval.json and COCO results."""
    cfg = load_config(config, overrides)
    info = init_distributed(cfg.train.device)
    run_dir = RunDir(Path(output_dir) if output_dir else resolve_output_dir(cfg) / "test")
    created = not run_dir.root.exists()
    run_dir.start_logging()
    try:
        ckpt = Path(checkpoint)
        if not created and not run_dir.root.is_dir():
            raise UsageError(f"--output-dir '{run_dir.root}' is a file, not a folder")

        # rank 0 decides, so no rank fails alone
        run_on_main(lambda: require_path(ckpt, "file", "--checkpoint: file"))
        run_on_main(lambda: ensure_dataset(cfg))
        net, _record = build_model(cfg)
        state = load_on_every_rank(ckpt)
        format_version(state, ckpt)
        load_model_weights(net, model_weights(state), ckpt)
        net.to(info.device)
        val_loader = build_val_loader(cfg, info.distributed, info.device)
        # made only once the checkpoint and the data are known to be good
        run_on_main(lambda: run_dir.make_folder("--output-dir"))
        run_dir.attach_log()
        metrics, results = evaluate(
            net, val_loader, info.device, iou_types_for(cfg.model.arch), progress=info.is_main
        )
        run_dir.write_coco_results(results)
        run_dir.write_eval(metrics, iter=state.get("iteration"), checkpoint=str(ckpt))
        say(f"evaluation of '{ckpt}' ({metrics['num_images']} images):")
        say(format_metrics_table(metrics))
        return metrics
    except Exception as err:
        log_error(err)
        usage = isinstance(err, UsageError)  # e.g. an unreadable image: no folder left behind
        main_only(lambda: settle_failed_run(run_dir, created, usage))
        raise
    finally:
        run_dir.stop_logging()
        cleanup()


def load_model_weights(net: nn.Module, weights: dict, path: Path) -> None:
    """Load a checkpoint's model weights, failing with one message naming what does not fit."""
    try:
        check_model_compat(net, weights)
    except ValueError as err:
        raise UsageError(f"--checkpoint '{path}': {err}") from None
    net.load_state_dict(weights)

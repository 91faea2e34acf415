"""The training loop: iterations, logging, checkpoint-then-evaluate, non-finite guard."""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from dropit_core import memory
from rcnn_dropit.checkpoint.checkpointer import Checkpointer
from rcnn_dropit.data import images_to_device
from rcnn_dropit.distributed import get_rank, get_world_size, reduce_dict
from rcnn_dropit.engine.data_position import epoch_batches
from rcnn_dropit.engine.determinism import deterministic_refusal
from rcnn_dropit.engine.step import StepOptions, training_step
from rcnn_dropit.models.buckets import BucketedTransform
from rcnn_dropit.models.sampling import roi_sample_counter
from rcnn_dropit.rng import restore_rng_state, rng_preserved

log = logging.getLogger(__name__)
LOSS_KEYS_ORDER = (
    "loss_classifier",
    "loss_box_reg",
    "loss_mask",
    "loss_objectness",
    "loss_rpn_box_reg",
)


@dataclass
class Schedule:
    """Iteration accounting of a run; epochs are counted from 1 in records."""

    iters_per_epoch: int
    total_iters: int
    log_every: int
    eval_every: int
    checkpoint_every: int
    checkpoint_every_iters: int
    eval_every_iters: int = 0

    def epoch_of(self, iteration: int) -> int:
        """1-based epoch that iteration `iteration` (1-based) belongs to."""
        return (iteration - 1) // self.iters_per_epoch + 1

    def _epoch_end_every(self, iteration: int, every: int) -> bool:
        return (
            every > 0
            and iteration % self.iters_per_epoch == 0
            and (iteration // self.iters_per_epoch) % every == 0
        )

    def should_log(self, iteration: int) -> bool:
        """Log every log_every iterations, and the last one."""
        return iteration % self.log_every == 0 or iteration == self.total_iters

    def should_checkpoint(self, iteration: int) -> bool:
        """Checkpoint at epoch multiples, iteration multiples, before evaluations and at the end."""
        by_iters = self.checkpoint_every_iters > 0 and iteration % self.checkpoint_every_iters == 0
        return (
            iteration == self.total_iters
            or by_iters
            or self._epoch_end_every(iteration, self.checkpoint_every)
            or self._every_iters(iteration, self.eval_every_iters)  # checkpoint, then evaluate
        )

    def should_eval(self, iteration: int) -> bool:
        """Evaluate at eval_every epoch multiples, eval_every_iters multiples and at the end."""
        return (
            iteration == self.total_iters
            or self._epoch_end_every(iteration, self.eval_every)
            or self._every_iters(iteration, self.eval_every_iters)
        )

    @staticmethod
    def _every_iters(iteration: int, every: int) -> bool:
        return every > 0 and iteration % every == 0


@dataclass
class LogWindow:
    """Sums since the last logged step; stored in checkpoints so resumed logs match exactly."""

    count: int = 0
    losses: dict[str, float] = field(default_factory=dict)
    time: float = 0.0
    data_time: float = 0.0

    def add(self, losses: dict[str, float], step_time: float, data_time: float) -> None:
        """Accumulate one iteration."""
        self.count += 1
        for key, value in losses.items():
            self.losses[key] = self.losses.get(key, 0.0) + value
        self.time += step_time
        self.data_time += data_time

    def state_dict(self) -> dict:
        """Plain-dict form for checkpoints."""
        return {
            "count": self.count,
            "losses": dict(self.losses),
            "time": self.time,
            "data_time": self.data_time,
        }

    @classmethod
    def from_state(cls, state: dict | None) -> LogWindow:
        """Rebuild from state_dict() output (None: empty window)."""
        if not state:
            return cls()
        return cls(state["count"], dict(state["losses"]), state["time"], state["data_time"])


def move_targets(targets: list[dict], device: torch.device) -> list[dict]:
    """Targets with their tensors on `device` (image ids stay plain ints)."""
    return [
        {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in t.items()}
        for t in targets
    ]


def _ordered(keys) -> list[str]:
    known = [k for k in LOSS_KEYS_ORDER if k in keys]
    return known + sorted(k for k in keys if k not in LOSS_KEYS_ORDER)


def reduce_losses(loss_dict: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean of each loss term over ranks (NaN anywhere stays NaN) as Python floats."""
    reduced = reduce_dict({k: v.detach().float() for k, v in loss_dict.items()})
    keys = _ordered(reduced)
    # one host copy for all terms (a sync per term would stall a GPU five times per step)
    return dict(zip(keys, torch.stack([reduced[k] for k in keys]).tolist(), strict=True))


# torch's warning when the scheduler steps in an iteration whose optimizer step was skipped
# (fp16 GradScaler on inf/NaN gradients, or solver.nonfinite=skip).
_SCHEDULER_FIRST = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the per-iteration lr schedule, silencing only torch's "scheduler before optimizer"
    warning: the schedule follows iterations on purpose, whether or not the optimizer stepped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SCHEDULER_FIRST, category=UserWarning)
        scheduler.step()


def nonfinite_message(iteration: int, losses: dict[str, float]) -> str:
    """Message naming the iteration and every loss term with its value."""
    terms = ", ".join(f"{k}={v:.6g}" for k, v in losses.items())
    return (
        f"non-finite loss at iteration {iteration}: {terms} "
        "(solver.nonfinite=stop; lower solver.lr, set solver.clip_grad_norm, "
        "or set solver.nonfinite=skip to skip such steps)"
    )


class Trainer:
    """Runs iterations [start, total) with logging, checkpoints and evaluation.

    It receives built parts: the (DDP) model, optimizer, scheduler, scaler, the training loader,
    the checkpointer, `evaluate` (runs the validation set, returns metrics) and `writer` (takes
    the metrics records); it decides when, they decide how.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler | None,
        train_loader,
        device: torch.device,
        options: StepOptions,
        schedule: Schedule,
        writer,
        checkpointer: Checkpointer | None = None,
        evaluate: Callable[[], dict] | None = None,
        on_eval: Callable[[int, dict], None] | None = None,
        progress: bool = True,
        buckets: BucketedTransform | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.train_loader = train_loader
        self.device = device
        self.options = options
        self.schedule = schedule
        self.writer = writer
        self.checkpointer = checkpointer
        self.evaluate = evaluate
        self.on_eval = on_eval
        self.progress = progress
        self.window = LogWindow()
        self.peaks = memory.WindowPeak(device)
        self.largest_peak_mb: float | None = None  # of this process's records, for memory.json
        self.skipped_steps = 0
        self.train_time = 0.0
        self.train_images = 0
        self.last_eval: dict | None = None
        self.last_lr = optimizer.param_groups[0]["lr"]
        self.last_eval_iter: int | None = None
        # model.size_buckets: the transform that counts this rank's batches no bucket held,
        # and all ranks' count up to the last record or checkpoint
        self.buckets = buckets
        self.unbucketed_batches = 0
        self._unbucketed_seen = 0

    # ---- one step -------------------------------------------------------------------------
    def step(self, images: list[torch.Tensor], targets: list[dict], iteration: int) -> dict:
        """engine.step.training_step with the run's bookkeeping around it: the losses averaged
        over ranks for the non-finite guard and the log, the lr this iteration used, the
        schedule stepped whether the optimizer stepped or not."""
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        logged: dict[str, float] = {}

        def proceed(losses: dict[str, torch.Tensor]) -> bool:
            # one small all-reduce per step, after the last backward: every rank must agree on
            # skipping or stopping (or DDP hangs), and makes the same collective calls
            reduced = reduce_losses(losses)
            logged.update(loss=sum(reduced.values()), **reduced)
            return self._finite_or_skip(logged, iteration)

        training_step(
            self.model, self.optimizer, self.scaler, images, targets, self.options, iteration,
            get_rank(), self.device, proceed,
        )  # fmt: skip
        step_scheduler(self.scheduler)  # the lr schedule follows iterations, skipped or not
        return logged

    def _step_in_window(self, images: list, targets: list, iteration: int) -> dict:
        """One step, its peak counted in the log window's (measured on the CPU when logged)."""
        measure = self.schedule.should_log(iteration)
        if measure:  # PeakMeter counts the gradients as held: free them before, as step() would
            self.optimizer.zero_grad(set_to_none=True)

        def held() -> list[torch.Tensor]:
            return memory.training_tensors(self.model, self.optimizer, images, targets)

        return self.peaks.step(lambda: self.step(images, targets, iteration), held, measure)

    def _finite_or_skip(self, logged: dict[str, float], iteration: int) -> bool:
        """True for finite losses; else stop (FloatingPointError) or count a skipped step."""
        if all(math.isfinite(v) for v in logged.values()):
            return True
        if self.options.nonfinite == "stop":
            raise FloatingPointError(nonfinite_message(iteration, logged))
        self.skipped_steps += 1
        # rank 0's console and log.txt; other ranks' log files
        log.warning(
            f"warning: {nonfinite_message(iteration, logged).split(' (')[0]}; "
            f"step skipped ({self.skipped_steps} so far)"
        )
        return False

    # ---- side effects ---------------------------------------------------------------------
    def _log(self, iteration: int, bar: tqdm) -> None:
        w = self.window
        if w.count == 0:
            return
        images = self.options.batch_size * get_world_size() * w.count
        record = {
            "type": "train",
            "iter": iteration,
            "epoch": self.schedule.epoch_of(iteration),
            "lr": self.last_lr,
            **{k: v / w.count for k, v in w.losses.items()},
            "time": w.time / w.count,
            "data_time": w.data_time / w.count,
            "images_per_sec": images / w.time if w.time > 0 else 0.0,
            # of this window only: an all-time peak would show the evaluation's after the first
            # PeakMeter's peak: on CUDA over the window's steps, on the CPU its last step's
            "peak_mem_mb": self.peaks.take_mb(),
            "skipped_steps": self.skipped_steps,
        }
        if self.buckets is not None:
            record["unbucketed_batches"] = self._count_unbucketed()
        record.update(self._roi_samples())
        if record["peak_mem_mb"] is not None:
            self.largest_peak_mb = max(self.largest_peak_mb or 0.0, record["peak_mem_mb"])
        self.writer.write(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.3g}", refresh=False)
        self.window = LogWindow()

    def _roi_samples(self) -> dict[str, float]:
        """The box sampler's positive and negative RoIs per image over the window, all ranks
        (detectron2's num_fg_samples / num_bg_samples; a collective when distributed)."""
        counter = roi_sample_counter(self.model)
        if counter is None:
            return {}
        counts = dict(zip(("fg", "bg", "images"), counter.take(), strict=True))
        counts = {k: torch.tensor(float(v), device=self.device) for k, v in counts.items()}
        total = {k: v.item() for k, v in reduce_dict(counts, average=False).items()}
        if not total["images"]:
            return {}
        return {f"num_{k}_samples": total[k] / total["images"] for k in ("fg", "bg")}

    def _count_unbucketed(self) -> int:
        """All ranks' batches that no size bucket held so far (a collective when distributed:
        every rank calls it, at each record and checkpoint)."""
        if self.buckets is None:
            return 0
        mine = self.buckets.unbucketed - self._unbucketed_seen
        self._unbucketed_seen = self.buckets.unbucketed
        count = torch.tensor(float(mine), device=self.device)
        new = int(reduce_dict({"unbucketed": count}, average=False)["unbucketed"].item())
        if new:
            last = self.buckets.last_unbucketed
            size = f" (this rank's last: {last[0]}x{last[1]})" if last else ""
            log.warning(
                f"warning: {new} more batch(es) fit no bucket of model.size_buckets "
                f"{[list(b) for b in self.buckets.buckets]}{size}: padded as torchvision pads "
                "them (unbucketed_batches in metrics.jsonl)"
            )
        self.unbucketed_batches += new
        return self.unbucketed_batches

    def loop_state(self) -> dict:
        """The loop's own bookkeeping, for checkpoints: resumed logs then match exactly."""
        loop = {"log_window": self.window.state_dict(), "skipped_steps": self.skipped_steps}
        if self.buckets is not None:
            loop["unbucketed_batches"] = self._count_unbucketed()
        return loop

    def load_loop_state(self, loop: dict) -> None:
        """Restore what loop_state() returned."""
        self.window = LogWindow.from_state(loop.get("log_window"))
        self.skipped_steps = int(loop.get("skipped_steps", 0))
        self.unbucketed_batches = int(loop.get("unbucketed_batches", 0))
        self._unbucketed_seen = self.buckets.unbucketed if self.buckets is not None else 0

    def save(self, iteration: int) -> None:
        """Checkpoint through the checkpointer (a collective: every rank calls it)."""
        if self.checkpointer is not None:
            self.checkpointer.save(iteration, self.loop_state())

    def run_eval(self, iteration: int) -> dict:
        """Evaluate without disturbing the training RNG streams, then record the metrics."""
        with rng_preserved():  # eval draws random numbers (loader seeds); keep resume exact
            metrics = self.evaluate()
        self.writer.write(
            {
                "type": "eval",
                "iter": iteration,
                "epoch": self.schedule.epoch_of(iteration),
                **metrics,
            }
        )
        self.last_eval, self.last_eval_iter = metrics, iteration
        if self.on_eval is not None:
            self.on_eval(iteration, metrics)
        return metrics

    # ---- the loop -------------------------------------------------------------------------
    def _batches(self, start: int, rng_state: dict | None) -> Iterator[tuple[int, list, list]]:
        """Yield (iteration, images, targets) for iterations start+1..total, epoch by epoch."""
        ipe = self.schedule.iters_per_epoch
        iteration = start
        while iteration < self.schedule.total_iters:
            epoch_index = iteration // ipe
            batches = epoch_batches(self.train_loader, epoch_index, iteration - epoch_index * ipe)
            if rng_state is not None:
                # Restore only now: preparing the epoch above must not shift the streams.
                restore_rng_state(rng_state)
                rng_state = None
            for images, targets in batches:
                iteration += 1
                yield iteration, images, targets
                if iteration >= self.schedule.total_iters or iteration % ipe == 0:
                    break
            else:
                raise RuntimeError(
                    f"train loader ended after iteration {iteration}, expected "
                    f"{ipe} batches per epoch"
                )

    def train(self, start_iter: int = 0, rng_state: dict | None = None) -> dict | None:
        """Train from `start_iter` to the end; returns the metrics of the last evaluation."""
        schedule = self.schedule
        self.model.train()
        bar = tqdm(
            total=schedule.total_iters,
            initial=start_iter,
            desc="train",
            disable=not self.progress,
            dynamic_ncols=True,
        )
        batch_images = self.options.batch_size * get_world_size()
        try:
            t_prev = time.perf_counter()
            for iteration, images, targets in self._batches(start_iter, rng_state):
                t_data = time.perf_counter()
                images = images_to_device(images, self.device)
                targets = move_targets(targets, self.device)
                losses = self._step_in_window(images, targets, iteration)
                t_end = time.perf_counter()
                self.window.add(losses, t_end - t_prev, t_data - t_prev)
                self.train_time += t_end - t_prev
                self.train_images += batch_images
                bar.update(1)
                if schedule.should_log(iteration):
                    self._log(iteration, bar)
                if schedule.should_checkpoint(iteration):
                    self.save(iteration)  # checkpoint first, so a crash in eval loses nothing
                if schedule.should_eval(iteration):
                    self.run_eval(iteration)
                    self.peaks.restart()  # evaluation's memory is not a training step's
                    self.model.train()
                t_prev = time.perf_counter()
        except RuntimeError as err:  # the one place a train.deterministic refusal becomes a line
            refusal = deterministic_refusal(err)
            if refusal is None:
                raise
            raise refusal from err
        finally:
            bar.close()
        return self.last_eval

    @property
    def images_per_sec(self) -> float:
        """Training throughput over this process's iterations (all ranks' images)."""
        return self.train_images / self.train_time if self.train_time > 0 else 0.0

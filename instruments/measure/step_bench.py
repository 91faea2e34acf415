"""DropIT benchmark on Mask R-CNN R50-FPN: saved-activation bytes, real memory, time, gradients.

Each setting (config overrides, as the accuracy study's plan writes them; a variant such as
``mink:0.8`` is one) is compared with the baseline in one process: memory first, above each
model's own starting allocation (dropit_core.memory.PeakMeter); then the weight gradients against
the exact ones (grad_fidelity); timings last, in alternating rounds so that a shared machine's
noise cancels out (:func:`alternating_rounds`, :func:`round_summary`). docs/benchmark.md says
what each column of a row means.
"""

from __future__ import annotations

import functools
import itertools
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dropit_core import from_dropit, is_dropit
from dropit_core.memory import measure_step
from instruments.measure import graph_capture
from instruments.measure.allocator import training_allocator
from instruments.measure.cuda_calls import CudaCalls, profile_cuda_calls
from instruments.measure.grad_fidelity import (
    approximated_layers,
    estimator_error,
    grad_draws,
    mean_fidelity,
    weight_grads,
)
from instruments.measure.rows import rows_with
from instruments.measure.timing import timed, timed_rounds
from instruments.measure.workload import (
    DEFAULT_WORKLOAD,
    Setting,
    Variant,
    describe,
    detector,
    draws_randomly,
    eval_step,
    make_batch,
    micro_batch_parts,
    recipe_config,
    resolve_settings,
    step_loss,
    train_step,
)
from rcnn_dropit.config import Config
from rcnn_dropit.engine.amp import check_amp
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models.sampling import roi_sample_counter

WARMUP = 2  # training steps of a model before its memory is measured


def _memory(
    model: nn.Module, batch, device: torch.device, amp: str = "none", accumulate: int = 1
) -> dict:
    """Saved bytes, live memory after the forward, and the peak of the step and where it falls.

    Every figure is taken above this model's own starting allocation (its gradients freed), so
    whatever else the process holds (the baseline, earlier variants) does not count. With
    gradient accumulation the saved bytes and live memory are the first micro-batch's, the
    peak that of the whole step (every micro-batch's forward and backward).
    """
    parts = micro_batch_parts(batch, accumulate) if accumulate > 1 else [batch]
    weights = [len(p[0]) / len(batch[0]) if accumulate > 1 else None for p in parts]

    def forward(part, weight: float | None) -> torch.Tensor:
        loss = step_loss(model, part, amp)
        return loss if weight is None else loss * weight

    forwards = [functools.partial(forward, p, w) for p, w in zip(parts, weights, strict=True)]
    counter = roi_sample_counter(model)
    if counter is not None:
        counter.take()  # the warm-up's
    step = measure_step(model, forwards, device, batch)
    positives, _negatives, images = counter.take() if counter is not None else (0, 0, 0)
    out = step.saved.as_dict()
    # what the measured step's RoI heads had: the workload's positives, as the sampler kept them
    out["positive_rois_per_image"] = positives / images if images else None
    # The rows' own names, which committed results files and their readers use: live_mb is
    # the memory live after the first forward, peak_mb the peak over the whole step, both
    # above the model's start (not the device's total, which memory.json's cuda_peak_mb is).
    out.update(
        memory_source=step.source,
        live_mb=step.live_after_forward_mb,
        peak_mb=step.step_peak_mb,
        peak_forward_mb=step.forward_peak_mb,
        peak_phase=step.peak_phase,
    )
    if step.forward_transient_mb is not None:
        out["forward_transient_mb"] = step.forward_transient_mb
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def alternating_rounds(
    steps: Sequence[Callable[[], Any]],
    rounds: int,
    per_round: int,
    device: torch.device | None = None,
    warmup: int = 1,
    timer: Callable[[Callable[[], Any]], float] | None = None,
) -> list[list[float]]:
    """Seconds of each of ``steps`` in each of ``rounds``: in round r every step function in
    turn makes ``per_round`` timed calls, and its figure for the round is their median; then
    the next round. ``warmup`` untimed rounds of one call each come first. ``timer`` times one
    call (default: wall clock, CUDA synchronised around it on ``device``).

    Several calls per turn, not one: the first call after another model's step can pay for the
    switch (the allocator's cache shaped by that model), and the median of a turn's calls keeps
    that out. Rounds, not one block per model: a drift of the machine over minutes hits every
    model's rounds alike, and the spread of the rounds' ratios shows what remains."""
    if rounds < 1 or per_round < 1:
        raise UsageError(f"rounds={rounds}, per_round={per_round}: allowed integers >= 1")
    clock = timer or (lambda fn: timed(fn, device)[1])
    for _ in range(warmup):
        for step in steps:
            step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            times[i].append(statistics.median(clock(step) for _ in range(per_round)))
    return times


def round_summary(times: Sequence[float], base: Sequence[float]) -> dict[str, Any]:
    """One setting's figures from its per-round seconds and the baseline's of the same rounds:
    the median round's seconds, the median of the per-round ratios (each round's time over the
    baseline's in that round) and their lowest and highest, and both per-round lists."""
    if len(times) != len(base) or not times:
        raise ValueError(f"{len(times)} rounds against the baseline's {len(base)}")
    ratios = [t / b for t, b in zip(times, base, strict=True)]
    return {
        "step_s": round(statistics.median(times), 4),
        "step_time_ratio": round(statistics.median(ratios), 4),
        "step_ratio_spread": [round(min(ratios), 4), round(max(ratios), 4)],
        "step_ratio_rounds": [round(r, 4) for r in ratios],
        "step_s_rounds": [round(t, 4) for t in times],
        "baseline_step_s": round(statistics.median(base), 4),
    }


def run_benchmark(
    settings: Sequence[Setting | Variant],
    scratch: bool = False,
    image_size: int = 512,
    repeats: int = 5,
    device: str = "cpu",
    rois_per_image: int = 512,
    backbone: str = "resnet50",
    amp: str = "none",
    images: int = 2,
    heads: str = "v1",
    draws: int = 8,
    profile_steps: int = 0,
    rounds: int | None = None,
    workload: str = DEFAULT_WORKLOAD,
    size_buckets: bool = False,
) -> Iterator[dict[str, Any]]:
    """Measure the baseline, then each setting; yields one result dict per row as it is done.

    Each setting is the recipe's config with its overrides (see workload), built by the
    toolkit's own builder from the same random weights. A setting whose DropIT draws random
    numbers has its weight gradient taken ``draws`` times (steps seeded 0 to draws - 1) for the
    bias (grad_fidelity.estimator_error); a deterministic one once. ``profile_steps`` > 0: after
    the timing, that many steps of each model under torch.profiler count its kernel launches
    and host syncs per step (cuda_calls; none on the CPU). ``rounds``: the steps are timed in
    that many alternating rounds of ``repeats`` steps per model (:func:`alternating_rounds`),
    each row's step figures the median over rounds with the rounds' ratios and their spread
    (:func:`round_summary`); None: ``repeats`` rounds of one step, the ratio of medians.
    ``workload`` (workload.WORKLOADS) makes the batch and the RoIs its heads see; each row
    records the positive RoIs per image its measured step had. ``size_buckets``: every model
    trains as a run with the recipe's two buckets (``model.size_buckets``, graph_capture): its
    memory and gradients on the landscape batch, its timed steps on the landscape and portrait
    batches in turn, and a compiled model's first steps in each bucket timed one by one before
    (``bucket_steps``: what they cost beyond as many steady steps; the landscape bucket's come
    after the memory steps, which compiled it, so its cold cost is the capture stage's).
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise UsageError(f"draws={draws!r} is invalid: allowed integers >= 1")
    if rounds is not None and rounds < 1:
        raise UsageError(f"rounds={rounds!r} is invalid: allowed integers >= 1")
    base_cfg = recipe_config(scratch, image_size, rois_per_image, backbone, heads)
    if size_buckets:
        base_cfg = graph_capture.with_buckets(base_cfg, image_size)
    reference, resolved = resolve_settings(settings, base_cfg)
    dev = torch.device(device)
    check_amp(amp)  # fail on a bad amp value early too
    if size_buckets:
        batches = graph_capture.bucket_batches(image_size, images, dev, workload)
    else:
        batches = [make_batch(image_size, dev, images, workload)]
    batch = batches[0]
    base = detector(base_cfg).to(dev).train()

    accumulate: dict[int, int] = {}  # id(model) -> its setting's micro-batches per step

    def step(m: nn.Module, b) -> None:
        train_step(m, b, amp, accumulate.get(id(m), 1))

    def timed_step(m: nn.Module, b) -> None:
        # A step frees the last one's gradients first; here they go at its end instead, so
        # that a dozen models do not hold a dozen sets of gradients between their turns.
        step(m, b)
        m.zero_grad(set_to_none=True)

    def evaluate(m: nn.Module, b) -> None:
        eval_step(m, b, amp)

    # The exact gradients first: that step also warms the model up (allocator, gradient
    # buffers, lazy inits), and WARMUP steps in all come before any memory is measured.
    exact = weight_grads(base, batch, amp)
    for _ in range(WARMUP - 1):
        step(base, batch)
    base_mem = _memory(base, batch, dev, amp, base_cfg.solver.accumulate)
    common = {
        "amp": amp, "device": dev.type, "images": images, "image_size": image_size,
        "workload": workload,
    }  # fmt: skip
    base_row = _row(reference, base_cfg, common, base_mem, base_mem)
    rows, models = [base_row], [base]
    if repeats <= 0:
        yield base_row
    for setting, cfg in resolved:
        model = detector(cfg).to(dev).train()
        accumulate[id(model)] = cfg.solver.accumulate
        layers = approximated_layers(model)
        count = draws if draws_randomly(cfg) else 1  # a deterministic step gives one gradient
        grads = grad_draws(model, lambda m=model: step(m, batch), count)
        first = next(grads)  # step 0's draw: the cosine and norm ratio of one training step
        fidelity = mean_fidelity(first, exact, layers)
        converted = sum(1 for n, m in model.named_modules() if is_dropit(m) and n in first)
        fidelity.update(estimator_error(itertools.chain([first], grads), exact, layers))
        del first, grads
        for _ in range(WARMUP - count):  # the draws were training steps: warm-up enough
            step(model, batch)
        mem = _memory(model, batch, dev, amp, cfg.solver.accumulate)
        row = _row(setting, cfg, common, mem, base_mem)
        row.update(fidelity, converted_layers=converted)
        model.zero_grad(set_to_none=True)
        if repeats > 0:  # timed below, once every setting's memory is measured
            rows.append(row)
            models.append(model)
            continue
        yield row  # repeats 0: memory and gradient fidelity only (exact on a busy machine)
        _release(model, dev)
    if repeats <= 0:
        return
    # Timing last: the allocator is switched for it (see instruments.measure.allocator), which would
    # disturb memory figures taken after it. Every model stays alive through it (each one's memory
    # was measured above its own start before, so holding the others costs no figure): weights
    # only, as timed_step frees each step's gradients, which is what lets rounds alternate
    # between models built once instead of rebuilding (and re-warming) one per turn.
    firsts = {}  # row index -> a compiled model's first steps per bucket
    if size_buckets:
        for i, m in enumerate(models):
            if rows[i].get("compile") not in (None, "none"):
                firsts[i] = [
                    {
                        "bucket": list(shape),
                        **graph_capture.first_steps(functools.partial(timed_step, m), b, dev),
                    }
                    for shape, b in zip(graph_capture.buckets_for(image_size), batches, strict=True)
                ]
    turns = [itertools.cycle(batches) for _ in models]  # each model's batches in turn
    step_fns = [lambda m=m, t=t: timed_step(m, next(t)) for m, t in zip(models, turns, strict=True)]
    with training_allocator(dev) as allocator:
        if rounds is None:
            steps = timed_rounds(step_fns, repeats, dev)
        else:
            steps = alternating_rounds(step_fns, rounds, repeats, dev)
        evals = timed_rounds([lambda m=m: evaluate(m, batch) for m in models], repeats, dev)
    med = statistics.median
    for i, (row, model) in enumerate(zip(rows, models, strict=True)):
        if rounds is None:
            row.update(
                step_time_ratio=round(med(steps[i]) / med(steps[0]), 4),
                step_s=round(med(steps[i]), 4),
                baseline_step_s=round(med(steps[0]), 4),
            )
        else:
            row.update(round_summary(steps[i], steps[0]), rounds=rounds, steps_per_round=repeats)
        row.update(
            eval_time_ratio=round(med(evals[i]) / med(evals[0]), 4),
            timing_allocator=allocator,
        )
        if i in firsts:  # the buckets themselves are the table header's (size_buckets)
            step_s = row.get("step_s")
            row["bucket_steps"] = [
                {**f, "capture_s": graph_capture.beyond_steady(f, step_s)} for f in firsts[i]
            ]
        if profile_steps > 0:  # untimed: the profiler slows the step it watches
            calls = profile_cuda_calls(lambda m=model: timed_step(m, batch), profile_steps, dev)
            row.update(calls.per_step(profile_steps), profiled_steps=profile_steps)
        yield row
        if i:
            _release(model, dev)


def _row(
    setting: Setting,
    cfg: Config,
    common: dict[str, Any],
    mem: dict[str, Any],
    base_mem: dict[str, Any],
) -> dict[str, Any]:
    """A row's description and memory figures (the baseline's ratios are its own, 1)."""
    ratios = {
        f"{key}_ratio": _ratio(mem[f"{key}_mb"], base_mem[f"{key}_mb"])
        for key in ("saved", "live", "peak")
    }
    return {
        "setting": setting.name,
        "variant": setting.name,  # the rows' name before settings (older JSON files)
        "overrides": list(setting.overrides),
        **describe(cfg),
        **common,
        **mem,
        **ratios,
        # the gradient columns, for the baseline empty: nothing is approximated
        **dict.fromkeys(
            ("grad_cosine", "grad_norm_ratio", "grad_bias", "grad_bias_single", "grad_bias_draws")
        ),
        "compared_layers": 0,
        "converted_layers": 0,
        # per step, with profile_steps (cuda_calls): the host's kernel launches and syncs
        **dict.fromkeys((*CudaCalls().per_step(1), "profiled_steps")),
    }


def _release(model: nn.Module, dev: torch.device) -> None:
    """Drop what a measured model holds beyond its weights, and return cached device memory."""
    model.zero_grad(set_to_none=True)
    from_dropit(model)
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def is_step_rows(data: Any) -> bool:
    """Whether parsed JSON is a ``steps --json`` file of step rows (or of memory-only rows:
    ``--repeats 0``)."""
    measured = ("step_time_ratio", "peak_mb")
    return rows_with(data, "variant") and all(any(k in r for k in measured) for r in data)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (memory: PeakMeter's, tensors' bytes)."""
    if rows and "step_time_ratio" not in rows[0]:  # --repeats 0: memory only, in MB
        cols = [
            ("variant", "setting"),
            ("saved_mb", "saved MB"),
            ("live_mb", "live MB"),
            ("peak_forward_mb", "forward peak MB"),
            ("peak_mb", "peak MB"),
            ("peak_phase", "peak in"),
            ("saved_ratio", "saved ratio"),
            ("peak_ratio", "peak ratio"),
            ("memory_source", "measured as"),
        ]
    else:
        cols = [
            ("variant", "setting"),
            ("saved_mb", "saved MB"),
            ("saved_ratio", "saved ratio"),
            ("live_ratio", "live ratio"),
            ("peak_ratio", "peak ratio"),
            ("peak_phase", "peak in"),
            ("step_time_ratio", "step time ratio"),
            ("eval_time_ratio", "eval time ratio"),
            ("grad_cosine", "grad cosine"),
            ("grad_norm_ratio", "grad norm ratio"),
            ("grad_bias", "grad bias"),
            ("grad_bias_single", "one draw"),
            ("grad_bias_draws", "draws"),
        ]

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.3f}" if isinstance(v, float) and v < 10 else (
            f"{v:.1f}" if isinstance(v, float) else str(v))  # fmt: skip

    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)

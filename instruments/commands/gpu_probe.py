"""Where one training step's host time and peak memory go, per bench setting (a diagnostic).

    python tools/gpu_probe.py --what memory --settings baseline quant_4bit --images 2 8

The bench's R50-FPN Mask R-CNN (instruments/measure/gpu_probe.py, live_probe.py); docs/gpu.md
and docs/dropit.md say what runs of it showed. Every --what but live and live-step needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

from instruments.measure import gpu_probe as probe
from instruments.measure import live_probe
from instruments.measure.workload import (
    detector,
    make_batch,
    plan_settings,
    recipe_config,
    setting_config,
    step_loss,
)
from rcnn_dropit.cli import run_cli
from rcnn_dropit.errors import UsageError


def _live(args: argparse.Namespace) -> None:
    """The forward's (``--what live``) or step's (``live-step``) live tensors at its peak, per
    setting and batch (any device)."""
    device = torch.device(args.device)
    amp = args.amp or ("fp16" if device.type == "cuda" else "none")
    base = recipe_config(False, args.image_size)
    for setting in plan_settings(args.plan, args.settings):
        model = detector(setting_config(base, setting)).to(device).train()
        for n in args.images:
            batch = make_batch(args.image_size, device, n)
            print(f"== {setting.name}, {n} images of {args.image_size} px, {device} amp {amp}")
            step_loss(model, batch, amp).backward()  # warm: lazy state, compiled packs
            model.zero_grad(set_to_none=True)
            if args.what == "live-step":
                report = live_probe.step_report(model, batch, amp)
            else:
                report = live_probe.forward_report(model, batch, amp)
            print("\n".join(report.lines(args.top)), flush=True)
        del model


def _probe(args: argparse.Namespace) -> None:
    if args.what in ("live", "live-step"):
        _live(args)
        return
    settings = plan_settings(args.plan, args.settings)  # a bad name fails on any machine
    if not torch.cuda.is_available():
        raise UsageError("gpu_probe needs a CUDA device; none is available here")
    if args.what == "launch":
        print("host microseconds per call, fastest of 5 rounds of 2000 (not synchronised)")
        for row in probe.launch_costs("cuda"):
            print(f"  {row['host_us']:8.2f}  {row['call']}")
        return
    base = recipe_config(False, 800)
    for setting in settings:
        model = detector(setting_config(base, setting)).cuda().train()
        for n in args.images:
            batch = make_batch(800, torch.device("cuda"), n)
            print(f"== {setting.name}, {n} images", flush=True)
            try:  # one part failing leaves the others' figures
                if args.what == "memory":
                    step_loss(model, batch, "fp16").backward()  # warm: lazy state, kernels
                    probe.memory(model, batch, args.top)
                else:
                    probe.python_time(model, batch, args.top)
            except Exception:  # a diagnostic: print the bug, go on to the next
                traceback.print_exc()
            sys.stdout.flush()
        del model
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """Entry point of tools/gpu_probe.py."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--settings", nargs="+", default=["baseline", "quant_4bit"])
    parser.add_argument("--plan", type=Path, default=Path("configs/study/plan.yaml"))
    parser.add_argument("--images", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--top", type=int, default=15, help="lines per list")
    parser.add_argument(
        "--what",
        choices=["memory", "python", "launch", "live", "live-step"],
        default="memory",
        help="memory: the allocator's blocks alive at a step's CUDA peak, by the frame that asked "
        "for them; python: the functions with the most time of their own (cProfile); launch: the "
        "host's cost of one launch, once; live (any device): the tensors alive at the forward's "
        "peak, by the line that made them, split into what backward keeps and the working set; "
        "live-step: the same over the whole step, the backward's by the autograd node",
    )
    parser.add_argument("--device", default="cuda", help="with --what live(-step): any device")
    parser.add_argument("--image-size", type=int, default=800, help="with --what live(-step)")
    parser.add_argument(
        "--amp",
        choices=["none", "fp16", "bf16"],
        help="with --what live(-step) (default: fp16 on CUDA, none elsewhere)",
    )
    args = parser.parse_args(argv)
    return run_cli(lambda: _probe(args))

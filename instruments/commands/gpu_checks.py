"""The open GPU questions that are not a row of the GPU table (tools/gpu_session.sh's stages):

python tools/gpu_checks.py capture --settings baseline_graphed quant_4bit_graphed --images 2 8 \
    --json capture.json     # per size bucket: the first steps (compile, CUDA graph recording)
python tools/gpu_checks.py budget --images 2 8 --budget 16GB --size-buckets \
    --against graphed_2img.json graphed_8img.json --json budget_probe.json
    # train.memory_budget's probe on the table's model and batch: its choice, wall time, peaks
python tools/gpu_checks.py pair --config configs/demo/maskrcnn_shapes_quant4.yaml --iters 30 \
    --workdir /tmp/pair --json deterministic_pair.json   # train.deterministic: two runs, one seed

Each prints its rows as JSON lines as they come and writes one JSON file with the run's
provenance (the command, commit, machine, GPU, torch, CUDA and triton versions) and its workload
(capture and budget: the bench's batch, ``--workload``; pair: the config's data), each row with
the positive RoIs per image its steps had. Defaults are a GPU's (cuda, AMP fp16, 800 px);
tools/gpu_session.sh --rehearse runs the same on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rcnn_dropit.cli import run_cli
from rcnn_dropit.errors import UsageError


def _write(path: Path | None, data: Mapping[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(data, indent=2) + "\n")


def _print(row: Mapping[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def _header(args: argparse.Namespace, **run: Any) -> dict[str, Any]:
    """The run's provenance (gpu_table.gpu_header); a missing CUDA device refused here."""
    import torch

    from instruments.measure.gpu_table import gpu_header
    from instruments.measure.methods_table import command_line

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
    return gpu_header(command_line(), args.device, args.quiet_machine, **run)


def _capture(args: argparse.Namespace) -> None:
    from instruments.measure.graph_capture import buckets_for, capture_rows
    from instruments.measure.workload import plan_settings, workload_named

    settings = plan_settings(args.plan, args.settings)  # a bad name fails before any work
    workload_named(args.workload)
    header = _header(
        args, images=args.images, image_size=args.image_size, amp=args.amp,
        buckets=[list(b) for b in buckets_for(args.image_size)], repeats=args.repeats,
        workload=args.workload,
    )  # fmt: skip
    rows = []
    for row in capture_rows(
        settings, args.images, args.image_size, args.device, args.amp, repeats=args.repeats,
        workload_name=args.workload,
    ):  # fmt: skip
        _print(row)
        rows.append(row)
        _write(args.json, {**header, "complete": False, "captures": rows})
    _write(args.json, {**header, "captures": rows})


def _budget(args: argparse.Namespace) -> None:
    from instruments.measure.budget_check import budget_check
    from instruments.measure.workload import workload_named

    workload_named(args.workload)
    against = {}
    for path in args.against or []:
        tables = json.loads(path.read_text()) if path.is_file() else {}
        for n in tables.get("images") or []:
            against[n] = path
    header = _header(
        args, image_size=args.image_size, amp=args.amp, budget=args.budget,
        workload=args.workload, size_buckets=args.size_buckets,
    )  # fmt: skip
    checks = []
    for n in args.images:
        check = budget_check(
            n, args.image_size, args.device, args.amp, args.budget, against.get(n),
            workload_name=args.workload, size_buckets=args.size_buckets,
        )  # fmt: skip
        _print({k: v for k, v in check.items() if k != "methods"})
        checks.append(check)
        _write(args.json, {**header, "checks": checks})


def _pair(args: argparse.Namespace) -> None:
    from instruments.measure.deterministic_pair import deterministic_pair, train_records

    if not Path(args.config).is_file():
        raise UsageError(f"--config: file '{args.config}' does not exist")
    header = _header(args, amp=args.amp, workload=f"the training data of {args.config}")
    pair = deterministic_pair(
        args.config, args.workdir, args.iters, args.device, args.amp, args.opts or ()
    )
    for run in pair["runs"]:  # the box sampler's positives per image, as the runs logged them
        records = train_records(args.workdir / run["name"])
        counts = [r["num_fg_samples"] for r in records if r.get("num_fg_samples") is not None]
        run["positive_rois_per_image"] = round(sum(counts) / len(counts), 2) if counts else None
        _print({k: v for k, v in run.items() if k != "losses"})
    _print({k: pair[k] for k in ("pair", "without_key", "key_step_ratio")})
    _write(args.json, {**header, **pair})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="cuda")
    common.add_argument("--amp", choices=["none", "fp16", "bf16"], default="fp16")
    common.add_argument("--json", type=Path, help="write the results to this JSON file")
    common.add_argument(
        "--quiet-machine", action="store_true", help="record that nothing else ran beside"
    )
    sized = argparse.ArgumentParser(add_help=False)
    sized.add_argument("--images", type=int, nargs="+", default=[2, 8])
    sized.add_argument("--image-size", type=int, default=800)
    sized.add_argument(
        "--workload",
        default="trained",
        help="the bench's batch and the RoIs its heads see (instruments/measure/workload.py; "
        "tools/bench.py's --workload): trained, cap or untrained (default: %(default)s)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    capture = commands.add_parser(
        "capture", parents=[common, sized], help="the graphed settings' first steps per bucket"
    )
    capture.add_argument(
        "--settings", nargs="+", default=["baseline_graphed", "quant_4bit_graphed"]
    )
    capture.add_argument("--plan", type=Path, default=Path("configs/study/plan.yaml"))
    capture.add_argument("--repeats", type=int, default=5, help="steady steps per bucket")
    budget = commands.add_parser(
        "budget", parents=[common, sized], help="train.memory_budget's probe on the table's batch"
    )
    budget.add_argument("--budget", default="16GB", help="train.memory_budget (default: 16GB)")
    budget.add_argument(
        "--size-buckets",
        action="store_true",
        help="the probe's model with the recipe's two orientations as model.size_buckets and "
        "its batch padded to the first, as the GPU table's rows with --size-buckets",
    )
    budget.add_argument(
        "--against", type=Path, nargs="+", metavar="TABLE",
        help="GPU tables (tools/bench.py --gpu-table --json) whose peaks the probe's are set "
        "beside, each at the batch sizes it measured (a missing file is passed over)",
    )  # fmt: skip
    pair = commands.add_parser(
        "pair", parents=[common], help="train.deterministic: two runs of one seed, and one without"
    )
    pair.add_argument("--config", default="configs/demo/maskrcnn_shapes_quant4.yaml")
    pair.add_argument("--iters", type=int, default=30)
    pair.add_argument("--workdir", type=Path, required=True, help="where the three runs go")
    pair.add_argument("--opts", nargs="*", help="config overrides for every run")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of tools/gpu_checks.py."""
    args = _parser().parse_args(argv)
    action = {"capture": _capture, "budget": _budget, "pair": _pair}[args.command]
    return run_cli(lambda: action(args))


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark DropIT settings against the baseline on Mask R-CNN R50-FPN; prints JSON lines.

One subcommand per bench, each with its own flags (``tools/bench.py SUBCOMMAND --help``);
docs/benchmark.md says how to run and read each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from instruments.measure.methods_table import command_line
from rcnn_dropit.cli import run_cli
from rcnn_dropit.errors import UsageError

# make demo's training config: its DropIT section against none (tools/bench.py demo)
DEMO_CONFIG = "configs/demo/maskrcnn_shapes_quant4.yaml"
DEFAULT_VARIANTS = [
    "mink:0.8",
    "parallel_mink:0.8",
    "random:0.8",
    "threshold:0.8",
    "mink:0.9",
    "mink:0.9:values=int8",
]


def restart_measuring() -> None:
    """Start this command again with ``MALLOC_MMAP_THRESHOLD_=65536`` unless it is set: large
    blocks are then mmapped from the OS and go back to it when freed, so RSS tracks live
    tensors. The same command line (script, console script or ``-m`` module) runs again."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def cli() -> int:
    """Entry point of ``tools/bench.py``: restart measuring, then main()."""
    restart_measuring()
    return main()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: args.run(args))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="bench", required=True, metavar="SUBCOMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], None], short: str, text: str):
        p = sub.add_parser(name, help=short, description=text)
        p.set_defaults(run=run)
        return p

    steps = command(
        "steps",
        _steps,
        "memory, gradient fidelity and step time of each setting",
        "memory, gradient fidelity and step time of the baseline and each setting, at each "
        "--images in turn",
    )
    _model_arguments(steps, images="2", repeats="timed steps per side (median)")
    steps.add_argument(
        "--methods-json",
        type=Path,
        metavar="FILE",
        help="also write the methods table's records (setting, saved_mb, ratios, cosine, "
        "norm_ratio, bias, ..., and the command, commit, machine, threads, quiet)",
    )

    table = command(
        "gpu-table",
        _gpu_table,
        "the GPU table: steps, peaks and the largest batch per setting",
        "one row per setting with the step time, peak, launches and host syncs per step at "
        "each --images, and the largest batch within --max-batch MB up to --batch-limit "
        "images; --json writes it with the GPU's name and the torch, CUDA and triton versions "
        "(make bench-gpu: docs/results/gpu_<gpu>_<date>/bench_gpu.json)",
    )
    _model_arguments(table, images="2 8", repeats="timed steps per setting in each of --rounds")
    _search_arguments(table)

    markdown = command(
        "markdown",
        _markdown,
        "the Markdown table of a file the benches wrote",
        "print the Markdown table of a steps --methods-json file, of a gpu-table --json file, "
        "or of the rows another subcommand wrote with --json (as that run printed them)",
    )
    markdown.add_argument("file", type=Path, metavar="FILE")
    markdown.add_argument(
        "--into",
        type=Path,
        metavar="DOC",
        help="write the table into DOC between the markers of its generated block",
    )
    markdown.add_argument(
        "--block",
        default="methods-bench",
        metavar="NAME",
        help="with --into: the name of DOC's generated block (default: %(default)s)",
    )
    markdown.add_argument(
        "--summary",
        action="store_true",
        help="a GPU table's one line per setting (docs/gpu.md's) instead of its table",
    )

    demo = command(
        "demo",
        _demo,
        "make demo's step with and without its DropIT section",
        "train-step time of the demo's model (CONFIG) with its DropIT section against the same "
        "model without DropIT, and with eager packs instead of the C loops, on one batch of "
        "its data",
    )
    demo.add_argument("config", nargs="?", default=DEMO_CONFIG, metavar="CONFIG")
    _timing_arguments(demo, repeats=5, quiet=True)

    host = command(
        "host",
        _host,
        "host time per DropIT layer, launches stubbed",
        "host microseconds and launches per DropIT layer (quant 4-bit; conv, conv + ReLU, "
        "conv + BatchNorm + ReLU with DropIT norms or saved-tensor hooks) with the Triton "
        "launches stubbed out, against the plain layers: the Python a GPU step waits on, "
        "measured on any machine",
    )
    _timing_arguments(host, repeats=5)

    live = command(
        "live",
        _live,
        "the tensors alive at a step's peak, by the line that made them",
        "the tensors alive at the forward's peak (or, with --step, the whole training step's), "
        "each by the line of code that made it (in the backward: the autograd node), split "
        "into what the backward keeps and the working set; any device",
    )
    live.add_argument("--settings", nargs="+", default=["baseline", "quant_4bit"])
    _plan_argument(live)
    _workload_argument(live)
    live.add_argument("--images", type=int, nargs="+", default=[2])
    live.add_argument("--image-size", type=int, default=800)
    live.add_argument("--step", action="store_true", help="follow the backward too")
    live.add_argument("--top", type=int, default=15, help="lines per list")
    _device_argument(live)
    live.add_argument(
        "--amp",
        choices=["none", "fp16", "bf16"],
        help="autocast dtype (default: fp16 on CUDA, none elsewhere)",
    )

    fusion = command(
        "fusion",
        _fusion,
        "compiled packs, opaque and fused: compile and step time",
        "the compiled lean ResNet-18-FPN backbone with 4-bit DropIT, its packs and ReLU masks "
        "opaque and then fused into Inductor's kernels (DROPIT_FUSE), each in a fresh process "
        "and Inductor cache: the first step's seconds (compiling), the kernels built, the "
        "median step after",
    )
    _device_argument(fusion)
    fusion.add_argument("--image-size", type=int, default=512)
    fusion.add_argument("--images", type=int, default=2)
    _timing_arguments(fusion, repeats=5, quiet=True)
    return parser


def _device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")


def _timing_arguments(p: argparse.ArgumentParser, repeats: int, quiet: bool = False) -> None:
    """--repeats (at least ``repeats``), --json, and --quiet-machine where rows record it."""
    p.add_argument(
        "--repeats",
        type=int,
        default=repeats,
        help="timed rounds (at least %(default)s)",
    )
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    if quiet:
        _quiet_argument(p)


def _quiet_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quiet-machine",
        action="store_true",
        help="record that nothing else ran on the machine (default: not quiet)",
    )


def _search_arguments(p: argparse.ArgumentParser) -> None:
    """gpu-table's own: its timing rounds and its largest-batch search."""
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="time the steps in this many alternating rounds, every setting taking --repeats "
        "steps in each; ratios are the median of the rounds' ratios, with their lowest and "
        "highest (default: %(default)s)",
    )
    p.add_argument(
        "--max-batch",
        type=float,
        default=16000.0,
        metavar="BUDGET_MB",
        help="the memory budget of the largest-batch column (default: %(default)s)",
    )
    p.add_argument(
        "--batch-limit",
        type=int,
        default=64,
        help="largest batch tried (default: %(default)s; 0: no batch search)",
    )
    p.add_argument(
        "--size-buckets",
        action="store_true",
        help="every row trains as a run with the recipe's two size buckets (model.size_buckets): "
        "landscape and portrait batches in turn, a compiled row's first steps per bucket timed",
    )


def _plan_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plan",
        type=Path,
        default=Path("configs/study/plan.yaml"),
        help="the study plan whose settings --settings names (default: %(default)s)",
    )


def _workload_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="trained",
        help="the batch and the RoIs its heads see (instruments/measure/workload.py): trained "
        "(a trained detector's positives, most of the sampler's cap), cap (the sampler's "
        "128 per image), untrained (random weights: the ground truth's 3); default: "
        "%(default)s",
    )


def _model_arguments(p: argparse.ArgumentParser, images: str, repeats: str) -> None:
    """The settings, the bench's recipe and workload, and the measuring of steps and gpu-table."""
    p.add_argument(
        "--variants",
        nargs="+",
        help=f"strategy:gamma[:key=value,...] (default, without --settings: {DEFAULT_VARIANTS})",
    )
    p.add_argument(
        "--settings",
        nargs="+",
        metavar="NAME",
        help="settings of --plan by name (its config overrides, applied to the bench's recipe), "
        "measured before any --variants",
    )
    _plan_argument(p)
    p.add_argument(
        "--draws",
        type=int,
        default=8,
        help="weight gradients averaged for the bias of a setting that draws random numbers "
        "(steps seeded 0..K-1; default: %(default)s)",
    )
    p.add_argument("--scratch", action="store_true", help="BatchNorm2d model trained from scratch")
    p.add_argument(
        "--heads",
        choices=("v1", "v2"),
        default="v1",
        help="the model's heads (model.heads): v2 puts a BatchNorm after every FPN and head "
        "conv, as torchvision's *_resnet50_fpn_v2 (default: v1)",
    )
    p.add_argument("--image-size", type=int, default=512)
    _workload_argument(p)
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help=f"{repeats}; 0: memory and gradient fidelity only, no timing (default: 5)",
    )
    _device_argument(p)
    p.add_argument(
        "--amp",
        choices=["none", "fp16", "bf16"],
        default="none",
        help="autocast dtype (default: none, fp32)",
    )
    p.add_argument(
        "--images",
        type=int,
        nargs="+",
        default=[int(n) for n in images.split()],
        help=f"images per step; several: the rows at each in turn (default: {images})",
    )
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    _quiet_argument(p)


def _settings(args: argparse.Namespace) -> list:
    """The settings the arguments name: --settings of the plan first, then --variants (the
    default variants when neither is given); a missing CUDA device is refused here."""
    from instruments.measure.workload import parse_variant, plan_settings, workload_named

    workload_named(args.workload)  # a bad name fails before minutes of model building
    if args.device.startswith("cuda") and not _cuda():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
    settings = plan_settings(args.plan, args.settings) if args.settings else []
    texts = args.variants if args.variants or args.settings else DEFAULT_VARIANTS
    return settings + [parse_variant(v).setting for v in texts or ()]


def _steps(args: argparse.Namespace) -> None:
    from instruments.measure.methods_table import method_records, provenance, write_methods_json
    from instruments.measure.step_bench import markdown_table, run_benchmark

    if args.methods_json and len(args.images) > 1:
        raise UsageError("--methods-json: one row per setting, so one --images value")
    settings = _settings(args)
    header = provenance(command_line(), args.quiet_machine, args.device)  # before minutes of work
    produced = itertools.chain.from_iterable(
        run_benchmark(
            settings, args.scratch, args.image_size, args.repeats, args.device,
            amp=args.amp, images=n, draws=args.draws, profile_steps=_profile_steps(args),
            heads=args.heads, workload=args.workload,
        )
        for n in args.images
    )  # fmt: skip
    rows = _emit(produced, args.json, markdown_table)
    if args.methods_json:
        write_methods_json(args.methods_json, method_records(rows, header))


def _profile_steps(args: argparse.Namespace) -> int:
    """Steps per setting run under torch.profiler for its launches and host syncs: 3 on a CUDA
    device, none elsewhere (the CPU has neither)."""
    return 3 if args.device.startswith("cuda") else 0


def _gpu_table(args: argparse.Namespace) -> None:
    """The GPU table: one row per setting (instruments.measure.gpu_table), printed as JSON
    lines and a table; --json writes it with the run's provenance."""
    from instruments.measure.gpu_table import gpu_header, gpu_markdown, gpu_table, write_gpu_table
    from instruments.measure.graph_capture import buckets_for

    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: allowed integers >= 1")
    settings = _settings(args)
    buckets = [list(b) for b in buckets_for(args.image_size)] if args.size_buckets else None
    run = {
        "images": args.images, "budget_mb": args.max_batch, "batch_limit": args.batch_limit,
        "repeats": args.repeats, "rounds": args.rounds if args.repeats > 0 else None,
        "profile_steps": _profile_steps(args),
        "amp": args.amp, "image_size": args.image_size, "draws": args.draws,
        "workload": args.workload,
        "size_buckets": buckets,
    }  # fmt: skip
    header = gpu_header(command_line(), args.device, args.quiet_machine, **run)
    produced = gpu_table(
        settings, args.images, args.max_batch, args.batch_limit, args.image_size, args.repeats,
        args.device, args.amp, args.draws, run["profile_steps"], args.scratch, heads=args.heads,
        rounds=args.rounds, workload=args.workload, size_buckets=args.size_buckets,
        progress=lambda row: print("measured: " + json.dumps(row), file=sys.stderr, flush=True),
        # The step columns are written before the (long) batch search; the end rewrites the file.
        on_steps=(lambda rows: write_gpu_table(args.json, {**header, "complete": False}, rows))
        if args.json and args.batch_limit > 0
        else None,
    )  # fmt: skip
    rows = _emit(produced, None, lambda rows: gpu_markdown({**header, "rows": rows}))
    if args.json:
        write_gpu_table(args.json, header, rows)


def _emit(
    produced: Iterable[dict],
    json_path: Path | None,
    table: Callable[[list[dict]], str] | None = None,
) -> list[dict]:
    """Print each row as a JSON line as it comes, then their ``table`` (when given); write them
    to json_path."""
    rows = []
    for row in produced:
        print(json.dumps(row), flush=True)
        rows.append(row)
    if table is not None:
        print()
        print(table(rows))
    if json_path:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def markdown_of(path: Path, summary: bool = False) -> str:
    """The table of a JSON file (the methods table's records, a GPU table, or the rows a
    subcommand wrote with ``--json``, as the run printed them), or a GPU table's one line per
    setting (``summary``)."""
    from instruments.measure.fusion_bench import fusion_markdown, is_fusion_rows
    from instruments.measure.gpu_table import gpu_markdown, gpu_summary, is_gpu_table
    from instruments.measure.host_bench import host_markdown, is_host_rows
    from instruments.measure.methods_table import methods_markdown, read_methods_json
    from instruments.measure.step_bench import is_step_rows, markdown_table

    try:
        data = json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        data = None  # read_methods_json says what is wrong with it
    if is_gpu_table(data):
        return gpu_summary(data) if summary else gpu_markdown(data)
    tables = {
        "fusion": (is_fusion_rows, fusion_markdown),
        "host": (is_host_rows, host_markdown),
        "steps": (is_step_rows, markdown_table),
    }
    for name, (is_rows, table) in tables.items():
        if is_rows(data):
            if summary:
                raise UsageError(
                    f"--summary: one line per method of a methods table, not {name} rows"
                )
            return table(data)
    if summary:
        raise UsageError("--summary: one line per setting of a GPU table, not of a methods table")
    return methods_markdown(read_methods_json(path))


def _markdown(args: argparse.Namespace) -> None:
    """Print :func:`markdown_of` a JSON file, or write it into a document's marked block."""
    from instruments.measure.methods_table import splice

    table = markdown_of(args.file, args.summary)
    if args.into is None:
        print(table)
        return
    if not args.into.is_file():
        raise UsageError(f"--into: file '{args.into}' does not exist")
    args.into.write_text(splice(args.into.read_text(), table, str(args.into), args.block))
    print(f"table of {args.file} written into {args.into}")


def _demo(args: argparse.Namespace) -> None:
    from instruments.measure.demo_bench import demo_rows

    rows = demo_rows(args.config, max(args.repeats, 5))
    for row in rows:
        row.update(config=args.config, quiet=args.quiet_machine, command=command_line())
    _emit(rows, args.json)


def _host(args: argparse.Namespace) -> None:
    from instruments.measure.host_bench import host_costs

    _emit(host_costs(repeats=max(args.repeats, 5)), args.json)


def _live(args: argparse.Namespace) -> None:
    import torch

    from instruments.measure import live_probe
    from instruments.measure import workload as wl
    from rcnn_dropit.models.sampling import roi_sample_counter

    wl.workload_named(args.workload)  # a bad name fails before any model, as does a setting's
    settings = wl.plan_settings(args.plan, args.settings)
    device = torch.device(args.device)
    amp = args.amp or ("fp16" if device.type == "cuda" else "none")
    base = wl.recipe_config(False, args.image_size)
    for setting in settings:
        model = wl.detector(wl.setting_config(base, setting)).to(device).train()
        counter = roi_sample_counter(model)
        for n in args.images:
            batch = wl.make_batch(args.image_size, device, n, args.workload)
            wl.step_loss(model, batch, amp).backward()  # warm: lazy state, compiled packs
            model.zero_grad(set_to_none=True)
            if counter is not None:
                counter.take()  # the warm-up's
            report = (live_probe.step_report if args.step else live_probe.forward_report)(
                model, batch, amp
            )
            positives, _, images = counter.take() if counter is not None else (0, 0, 0)
            seen = f"{positives / images:.1f} positive RoIs per image" if images else "no RoIs"
            print(
                f"== {setting.name}, {n} images of {args.image_size} px, {device} amp {amp}; "
                f"the {args.workload} workload: {seen}"
            )
            print("\n".join(report.lines(args.top)), flush=True)
        del model


def _fusion(args: argparse.Namespace) -> None:
    from instruments.measure.fusion_bench import fusion_markdown, fusion_rows

    rows = fusion_rows("resnet18", args.image_size, args.images, max(args.repeats, 1), args.device)
    for row in rows:
        row.update(quiet=args.quiet_machine, command=command_line())
    _emit(rows, args.json, fusion_markdown)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(cli())

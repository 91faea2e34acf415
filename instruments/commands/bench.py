"""Benchmark DropIT variants against the baseline on Mask R-CNN R50-FPN; prints JSON lines.

python tools/bench.py                          # COCO recipe (FrozenBN, 3 trainable stages)
python tools/bench.py --scratch                # BatchNorm2d, all stages trainable
python tools/bench.py --variants mink:0.9:values=int8 threshold:0.8 --json bench.json
python tools/bench.py --settings baseline mink_0.8 quant_4bit checkpoint_stages \
    --methods-json methods.json       # settings of the study's plan, by name (--plan)
python tools/bench.py --markdown methods.json   # the Markdown table of such a file
python tools/bench.py --device cuda --amp fp16 # GPU: allocator peaks, synchronised step times
python tools/bench.py --device cuda --amp fp16 --max-batch 16000   # largest batch in 16 GB
python tools/bench.py --gpu-table --device cuda --amp fp16 --image-size 800 --images 2 8 \
    --settings baseline quant_4bit --json bench_gpu.json   # the GPU table (make bench-gpu)
python tools/bench.py --widths                 # the narrow CPU model vs torchvision's widths
python tools/bench.py --ops                    # each pass of the pack and rebuild, one 4Mi slice
python tools/bench.py --pooler --images 2 8     # the RoI poolers under autocast: bytes and ms
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from rcnn_dropit.cli import run_cli
from rcnn_dropit.errors import UsageError

# make demo's training config: its DropIT section against none (tools/bench.py --demo)
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
    """Entry point of ``dropit-bench`` and ``tools/bench.py``: restart measuring, then main()."""
    restart_measuring()
    return main()


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run the mode they pick (markdown, widths, ops, max-batch, steps)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.into and not args.markdown:
        parser.error("--into goes with --markdown")
    if args.rounds is not None and not args.gpu_table:
        parser.error("--rounds goes with --gpu-table (the other benches time rounds of one step)")
    if args.markdown:
        return run_cli(lambda: _markdown(args.markdown, args.into, args.block, args.summary))
    if args.widths:
        return run_cli(lambda: _widths(args.widths, args.repeats, args.json))
    if args.demo:
        return run_cli(lambda: _demo(args.demo, args.repeats, args.json, args.quiet_machine))
    if args.ops:
        return run_cli(lambda: _ops(args.device, args.repeats, args.json))
    if args.host:
        return run_cli(lambda: _host(args.repeats, args.json))
    if args.pooler:
        return run_cli(lambda: _pooler(args))
    if args.fusion:
        return run_cli(lambda: _fusion(args, args.quiet_machine))
    if args.gpu_table:
        return run_cli(lambda: _gpu_table(args))
    if args.max_batch is not None:
        return run_cli(lambda: _max_batch(args))
    return run_cli(lambda: _steps(args))


def _parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        help=f"strategy:gamma[:key=value,...] (default, without --settings: {DEFAULT_VARIANTS})",
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        metavar="NAME",
        help="settings of --plan by name (its config overrides, applied to the bench's recipe), "
        "measured before any --variants",
    )
    parser.add_argument(
        "--plan",
        type=Path,
        default=Path("configs/study/plan.yaml"),
        help="the study plan whose settings --settings names (default: %(default)s)",
    )
    parser.add_argument(
        "--draws",
        type=int,
        default=8,
        help="weight gradients averaged for the bias of a setting that draws random numbers "
        "(steps seeded 0..K-1; default: %(default)s)",
    )
    parser.add_argument(
        "--scratch", action="store_true", help="BatchNorm2d model trained from scratch"
    )
    parser.add_argument(
        "--heads",
        choices=("v1", "v2"),
        default="v1",
        help="the model's heads (model.heads): v2 puts a BatchNorm after every FPN and head "
        "conv, as torchvision's *_resnet50_fpn_v2 (default: v1)",
    )
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument(
        "--workload",
        default="trained",
        help="the batch and the RoIs its heads see (instruments/measure/workload.py): trained "
        "(a trained detector's positives, most of the sampler's cap), cap (the sampler's "
        "128 per image), untrained (random weights: the ground truth's 3); default: "
        "%(default)s",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed steps per side (median; with --gpu-table: per setting in each of --rounds); "
        "0: memory and gradient fidelity only, no timing",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="with --gpu-table: time the steps in this many alternating rounds, every setting "
        "taking --repeats steps in each; ratios are the median of the rounds' ratios, with "
        "their lowest and highest (default: 5)",
    )
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument(
        "--amp",
        choices=["none", "fp16", "bf16"],
        default="none",
        help="autocast dtype (default: none, fp32)",
    )
    parser.add_argument(
        "--images",
        type=int,
        nargs="+",
        help="images per step; several: the rows at each in turn (default: 2; 2 8 with "
        "--gpu-table)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        metavar="N",
        help="steps per setting run under torch.profiler, for its kernel launches and host "
        "syncs per step (default: 3 on CUDA, 0 on the CPU, where there are none)",
    )
    parser.add_argument(
        "--gpu-table",
        action="store_true",
        help="instead: one row per setting with the step time, peak, launches and host syncs "
        "per step at each --images, and the largest batch within --max-batch MB (default 16000) "
        "up to --batch-limit images; --json writes it with the GPU's name and the torch, CUDA "
        "and triton versions (make bench-gpu: docs/results/gpu_<gpu>_<date>/bench_gpu.json)",
    )
    parser.add_argument(
        "--max-batch",
        type=float,
        metavar="BUDGET_MB",
        help="instead: the largest batch each setting trains within this memory budget (with "
        "--gpu-table: the budget of its batch column)",
    )
    parser.add_argument(
        "--batch-limit",
        type=int,
        default=64,
        help="largest batch tried (default: %(default)s; 0 with --gpu-table: no batch search)",
    )
    parser.add_argument(
        "--widths",
        nargs="?",
        const="configs/study/scratch.yaml",
        metavar="CONFIG",
        help="instead: train-step time of CONFIG's model (default: the study's narrow model) "
        "against the same model with torchvision's FPN and head widths, on one shapes batch",
    )
    parser.add_argument(
        "--demo",
        nargs="?",
        const=DEMO_CONFIG,
        metavar="CONFIG",
        help="instead: train-step time of the demo's model (CONFIG, default: %(const)s) with its "
        "DropIT section against the same model without DropIT, on one batch of its data",
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="instead: milliseconds of each pass of an element-wise pack and rebuild on one 4Mi "
        "slice (compare, bit packing, compaction, positions, gather, ReLU mask)",
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="instead: host microseconds and launches per DropIT layer (quant 4-bit; conv, "
        "conv + ReLU, conv + BatchNorm + ReLU with DropIT norms or saved-tensor hooks) with the "
        "Triton launches stubbed out, against the plain layers: the Python a GPU step waits "
        "on, measured on any machine",
    )
    parser.add_argument(
        "--pooler",
        action="store_true",
        help="instead: the RoI poolers under autocast (--amp, default fp16 on CUDA, bf16 on the "
        "CPU), torchvision's and the lean one, on a pyramid of --images batches of --image-size "
        "px: the bytes at the forward's and the backward's peak, the milliseconds of both, "
        "and whether the lean one's bits are torchvision's",
    )
    parser.add_argument(
        "--fusion",
        action="store_true",
        help="instead: the compiled lean ResNet-18-FPN backbone with 4-bit DropIT "
        "(--image-size, --images, --device), its packs and ReLU masks opaque and then fused into "
        "Inductor's kernels (DROPIT_FUSE), each in a fresh process and Inductor cache: the "
        "first step's seconds (compiling), the kernels built, the median step after",
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument(
        "--methods-json",
        type=Path,
        metavar="FILE",
        help="also write the methods table's records (setting, saved_mb, ratios, cosine, "
        "norm_ratio, bias, ..., and the command, commit, machine, threads, quiet)",
    )
    parser.add_argument(
        "--quiet-machine",
        action="store_true",
        help="record in --methods-json that nothing else ran on the machine (default: not quiet)",
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        metavar="FILE",
        help="instead: print the Markdown table of a --methods-json file, of a --gpu-table "
        "--json file, or of the rows a run wrote with --json (as that run printed them)",
    )
    parser.add_argument(
        "--into",
        type=Path,
        metavar="DOC",
        help="with --markdown: write the table into DOC between its methods-bench markers",
    )
    parser.add_argument(
        "--summary",
        action="store_true",
        help="with --markdown: one line per memory method (the README's) instead of the table",
    )
    parser.add_argument(
        "--block",
        default="methods-bench",
        metavar="NAME",
        help="with --into: the name of DOC's generated block (default: %(default)s)",
    )
    return parser


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


def _max_batch(args: argparse.Namespace) -> None:
    """The largest batch of the baseline and each setting within --max-batch MB."""
    from instruments.measure.max_batch import largest_batches
    from instruments.measure.step_bench import markdown_table

    if args.methods_json:
        raise UsageError("--methods-json: the methods table comes from step rows, not --max-batch")
    produced = largest_batches(
        _settings(args), args.max_batch, args.batch_limit, args.scratch, args.image_size,
        args.device, amp=args.amp, heads=args.heads, workload=args.workload,
    )  # fmt: skip
    _emit(produced, args.json, markdown_table)


def _steps(args: argparse.Namespace) -> None:
    """Memory, gradient fidelity and step time of the baseline and each setting, at each
    --images in turn."""
    from instruments.measure.methods_table import method_records, provenance, write_methods_json
    from instruments.measure.step_bench import markdown_table, run_benchmark

    images = args.images or [2]
    if args.methods_json and len(images) > 1:
        raise UsageError("--methods-json: one row per setting, so one --images value")
    settings = _settings(args)
    header = provenance(_command_line(), args.quiet_machine, args.device)  # before minutes of work
    produced = itertools.chain.from_iterable(
        run_benchmark(
            settings, args.scratch, args.image_size, args.repeats, args.device,
            amp=args.amp, images=n, draws=args.draws, profile_steps=_profile_steps(args),
            heads=args.heads, workload=args.workload,
        )
        for n in images
    )  # fmt: skip
    rows = _emit(produced, args.json, markdown_table)
    if args.methods_json:
        write_methods_json(args.methods_json, method_records(rows, header))


def _profile_steps(args: argparse.Namespace) -> int:
    """--profile-steps, by default 3 on a CUDA device and 0 elsewhere."""
    if args.profile_steps is not None:
        if args.profile_steps < 0:
            raise UsageError(f"--profile-steps {args.profile_steps}: allowed integers >= 0")
        return args.profile_steps
    return 3 if args.device.startswith("cuda") else 0


def _gpu_table(args: argparse.Namespace) -> None:
    """The GPU table: one row per setting (instruments.measure.gpu_table), printed as JSON
    lines and a table; --json writes it with the run's provenance."""
    from instruments.measure.gpu_table import gpu_header, gpu_markdown, gpu_table, write_gpu_table

    if args.methods_json:
        raise UsageError("--methods-json goes with step rows, not --gpu-table")
    images = args.images or [2, 8]
    budget = 16000.0 if args.max_batch is None else args.max_batch
    rounds = 5 if args.rounds is None else args.rounds
    if rounds < 1:
        raise UsageError(f"--rounds {rounds}: allowed integers >= 1")
    settings = _settings(args)
    run = {
        "images": images, "budget_mb": budget, "batch_limit": args.batch_limit,
        "repeats": args.repeats, "rounds": rounds if args.repeats > 0 else None,
        "profile_steps": _profile_steps(args),
        "amp": args.amp, "image_size": args.image_size, "draws": args.draws,
        "workload": args.workload,
    }  # fmt: skip
    header = gpu_header(_command_line(), args.device, args.quiet_machine, **run)
    produced = gpu_table(
        settings, images, budget, args.batch_limit, args.image_size, args.repeats, args.device,
        args.amp, args.draws, run["profile_steps"], args.scratch, heads=args.heads, rounds=rounds,
        workload=args.workload,
        progress=lambda row: print("measured: " + json.dumps(row), file=sys.stderr, flush=True),
        # The step columns are written before the (long) batch search; the end rewrites the file.
        on_steps=(lambda rows: write_gpu_table(args.json, {**header, "complete": False}, rows))
        if args.json and args.batch_limit > 0
        else None,
    )  # fmt: skip
    rows = []
    for row in produced:
        print(json.dumps(row), flush=True)
        rows.append(row)
    print()
    print(gpu_markdown({**header, "rows": rows}))
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


def _command_line() -> str:
    """This command as typed from the checkout (``python tools/bench.py ...``)."""
    script = sys.argv[0]
    if os.path.isabs(script) and Path(script).is_relative_to(Path.cwd()):
        script = os.path.relpath(script)
    return shlex.join(["python", script, *sys.argv[1:]])


def markdown_of(path: Path, summary: bool = False) -> str:
    """The table of a JSON file (the methods table's records, a GPU table, or the rows of
    ``--json``, as the run printed them), or its one line per method (``summary``)."""
    from instruments.measure.fusion_bench import fusion_markdown, is_fusion_rows
    from instruments.measure.gpu_table import gpu_markdown, gpu_summary, is_gpu_table
    from instruments.measure.host_bench import host_markdown, is_host_rows
    from instruments.measure.methods_table import (
        methods_markdown,
        methods_summary,
        read_methods_json,
    )
    from instruments.measure.pooler_bench import is_pooler_rows, pooler_markdown
    from instruments.measure.step_bench import is_step_rows, markdown_table

    try:
        data = json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        data = None  # read_methods_json says what is wrong with it
    if is_gpu_table(data):
        table = gpu_summary(data) if summary else gpu_markdown(data)
    elif is_fusion_rows(data):
        if summary:
            raise UsageError("--summary: one line per method of a methods table, not --fusion rows")
        table = fusion_markdown(data)
    elif is_host_rows(data):
        if summary:
            raise UsageError("--summary: one line per method of a methods table, not --host rows")
        table = host_markdown(data)
    elif is_pooler_rows(data):
        if summary:
            raise UsageError("--summary: one line per method of a methods table, not --pooler rows")
        table = pooler_markdown(data)
    elif is_step_rows(data):
        if summary:
            raise UsageError("--summary: one line per method of a methods table, not --json rows")
        table = markdown_table(data)
    else:
        records = read_methods_json(path)
        table = methods_summary(records) if summary else methods_markdown(records)
    return table


def _markdown(
    path: Path, into: Path | None, block: str = "methods-bench", summary: bool = False
) -> None:
    """Print :func:`markdown_of` a JSON file, or write it into a document's marked block."""
    from instruments.measure.methods_table import splice

    table = markdown_of(path, summary)
    if into is None:
        print(table)
        return
    if not into.is_file():
        raise UsageError(f"--into: file '{into}' does not exist")
    into.write_text(splice(into.read_text(), table, str(into), block))
    print(f"table of {path} written into {into}")


def _widths(config: str, repeats: int, out: Path | None) -> None:
    """Step time of a config's model vs torchvision's widths: JSON lines (ratio, first = 1x)."""
    from instruments.measure.width_bench import TORCHVISION_WIDTHS, compare_step_time

    variants = [("torchvision widths", TORCHVISION_WIDTHS), (config, ())]
    rows = compare_step_time(config, variants, repeats=max(repeats, 5))
    _emit(rows, out)


def _demo(config: str, repeats: int, out: Path | None, quiet: bool) -> None:
    """Step time of the demo with DropIT against the demo without: JSON lines (baseline = 1x).
    A third row packs with eager torch instead of the C loops (dropit_core.backends.native): what
    they save, in the same rounds."""
    from dropit_core import configure, pack_backend, reset_settings
    from instruments.measure.width_bench import compare_step_time

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
        rows = compare_step_time(config, variants, repeats=max(repeats, 5), setups=setups)
    finally:
        reset_settings()
    for row in rows:
        row["c_packs"] = row["model"] == "dropit" and pack_backend("cpu") == "native"
    for row in rows:
        row.update(config=config, quiet=quiet, command=_command_line())
    _emit(rows, out)


def _ops(device: str, repeats: int, out: Path | None) -> None:
    """Per-pass costs of the element-wise ops on one slice: JSON lines."""
    from instruments.measure.op_bench import op_costs

    rows = op_costs(repeats=max(repeats, 5), device=device)
    _emit(rows, out)


def _host(repeats: int, out: Path | None) -> None:
    """Host microseconds and launches per DropIT layer with the launches stubbed: JSON lines."""
    from instruments.measure.host_bench import host_costs

    rows = host_costs(repeats=max(repeats, 5))
    _emit(rows, out)


def _pooler(args: argparse.Namespace) -> None:
    """The RoI poolers under autocast, torchvision's and the lean one: JSON lines."""
    from instruments.measure.pooler_bench import pooler_costs, pooler_markdown

    rows = pooler_costs(
        images=tuple(args.images or (2, 8)),
        image_size=args.image_size,
        device=args.device,
        amp=None if args.amp == "none" else args.amp,
        repeats=max(args.repeats, 3),
    )
    _emit(rows, args.json, pooler_markdown)


def _fusion(args: argparse.Namespace, quiet: bool) -> None:
    """Compile and step time of the compiled backbone, packs opaque and fused: JSON lines."""
    from instruments.measure.fusion_bench import fusion_markdown, fusion_rows

    images = args.images[0] if args.images else 2
    rows = fusion_rows("resnet18", args.image_size, images, max(args.repeats, 1), args.device)
    for row in rows:
        row.update(quiet=quiet, command=_command_line())
    _emit(rows, args.json, fusion_markdown)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(cli())

"""Writes README.md of this folder from the bench files beside it (and ../bench_demo_cpu.json).

python docs/results/host_ab_layout/make_readme.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
META = json.loads((HERE / "meta.json").read_text())  # the commits compared, the date, the machine


def _load(name: str | Path) -> list[dict]:
    return json.loads((HERE / name).read_text())


def _host_table() -> list[str]:
    rounds = sorted({int(p.stem.rsplit("_", 1)[1]) for p in HERE.glob("host_*_*.json")})
    head = " | ".join(f"before {r} | after {r}" for r in rounds)
    lines = [f"| stack | DropIT on | {head} |", "|---|---|" + "---:|" * (2 * len(rounds))]
    sides = {(s, r): {(x["stack"], x["dropit"]): x for x in _load(f"host_{s}_{r}.json")}
             for s in ("before", "after") for r in rounds}  # fmt: skip
    for key in sides["before", rounds[0]]:
        cells = []
        for r in rounds:
            for side in ("before", "after"):
                row = sides[side, r].get(key)
                cells.append("-" if row is None else f"{row['dropit_us'] / row['plain_us']:.2f}x")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return lines


def _plain_spread() -> str:
    """How far the plain conv stack's unit moved between the processes: the host's noise."""
    plain = [r["plain_us"] for r in _load("host_processes.json") if r["stack"] == "conv"]
    return f"the plain conv unit took {min(plain):.1f}-{max(plain):.1f} µs from process to process"


def _processes_table() -> list[str]:
    """Median (range) of each side's ratios over the processes of host_processes.json."""
    rows = _load("host_processes.json")
    lines = [
        "| stack | side | processes | median | range | each, in order |",
        "|---|---|---:|---:|---:|---|",
    ]
    for stack in dict.fromkeys(r["stack"] for r in rows):
        for side in ("before", "after"):
            ratios = [
                r["dropit_us"] / r["plain_us"]
                for r in rows
                if (r["stack"], r["side"]) == (stack, side)
            ]
            each = ", ".join(f"{x:.2f}" for x in ratios)
            lines.append(
                f"| {stack} | {side} | {len(ratios)} | {statistics.median(ratios):.2f}x "
                f"| {min(ratios):.2f}-{max(ratios):.2f}x | {each} |"
            )
    return lines


def _step800_table() -> list[str]:
    lines = [
        "| setting | before: step s | after: step s | before: over baseline "
        "| after: over baseline |",
        "|---|---:|---:|---:|---:|",
    ]
    before = {r["setting"]: r for r in _load("step800_before.json")}
    for row in _load("step800_after.json"):
        b = before[row["setting"]]
        lines.append(
            f"| {row['setting']} | {b['step_s']:.2f} | {row['step_s']:.2f} "
            f"| {b['step_time_ratio']:.3f}x | {row['step_time_ratio']:.3f}x |"
        )
    return lines


def _demo_table() -> list[str]:
    rounds = sorted({int(p.stem.rsplit("_", 1)[1]) for p in HERE.glob("demo_*_*.json")})
    head = " | ".join(f"before {r} | after {r}" for r in rounds)
    lines = [f"| model | {head} | canonical run |", "|---|" + "---:|" * (2 * len(rounds) + 1)]
    canonical = {r["model"]: r for r in _load(HERE.parent / "bench_demo_cpu.json")}
    runs = {(s, r): {x["model"]: x for x in _load(f"demo_{s}_{r}.json")}
            for s in ("before", "after") for r in rounds}  # fmt: skip
    for model in canonical:
        cells = [
            f"{runs[s, r][model]['step_ratio']:.3f}x" for r in rounds for s in ("before", "after")
        ]
        cells.append(f"{canonical[model]['step_ratio']:.3f}x")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines + [
        "",
        f"The canonical run: `{canonical['dropit']['command']}`, at {META['after']}.",
    ]


def _noise() -> str:
    """The spread of a row DropIT's code does not touch, as the rounds' noise gauge."""
    row = ("conv+relu", "bare Function")
    ratios = [
        f"{r['dropit_us'] / r['plain_us']:.2f}x"
        for p in sorted(HERE.glob("host_*_*.json"))
        for r in _load(p.name)
        if (r["stack"], r["dropit"]) == row
    ]
    return (
        f"The `{row[0]}` `{row[1]}` row runs no DropIT code, so its spread is the rounds' noise: "
        + ", ".join(ratios)
        + " (files in name order: after 1, after 2, before 1, before 2)."
    )


def _working_set() -> list[str]:
    """The probe's peak lines per setting, before and after (forward_probe_<side>.txt)."""
    lines = ["| setting | side | forward peak, MB | working set, MB |", "|---|---|---:|---:|"]
    for side in ("before", "after"):
        setting = None
        for line in (HERE / f"forward_probe_{side}.txt").read_text().splitlines():
            if line.startswith("== "):
                setting = line[3:].split(",")[0]
            elif line.startswith("forward peak "):
                peak = line.split()[2]
            elif "working set (freed before the end)" in line:
                ws = line.rsplit(")", 1)[1].split()[0]
                lines.append(f"| {setting} | {side} | {peak} | {ws} |")
    return lines


def main() -> None:
    before, after = META["before"], META["after"]
    lines = [
        "# dropit_core before and after issue 57 (one home per idea): host, demo and 800 px steps",
        "",
        f"Before: {before} (the commit before issue 57's work). After: {after}. Each commit in a",
        "worktree with its own code on the path (`PYTHONPATH=<worktree>`), on "
        f"{META['machine']}, {META['date']}, nothing else of ours running; {_plain_spread()}.",
        "",
        "## Host time per DropIT layer",
        "",
        "`make bench-host`'s rows (the GPU path with its Triton launches stubbed, on the CPU; the",
        "fastest of 31 rounds per row), before and after alternating, twice:",
        "",
        "```bash",
        "PYTHONPATH=. python tools/bench.py --host --repeats 31 --json <file>",
        "```",
        "",
        "DropIT's time over the plain stack's, timed in the same run; the issue's target is 1.6x",
        "for the `layers` rows:",
        "",
        *_host_table(),
        "",
        _noise(),
        "",
        "One process's ratio moves by a tenth or more on this machine, so the two `layers` rows",
        "were also timed in many short processes, before and after alternating (each the fastest",
        "of 21 rounds of 50 steps; host_processes.json):",
        "",
        "```bash",
        "python docs/results/host_ab_layout/processes.py <worktree of the before commit> \\",
        "    --rounds 8",
        "```",
        "",
        *_processes_table(),
        "",
        "## The 800 px CPU recipe step",
        "",
        "```bash",
        "PYTHONPATH=. python tools/bench.py --settings baseline quant_4bit --image-size 800 \\",
        "    --images 2 --repeats 3 --draws 1 --json <file>",
        "```",
        "",
        "Median step of 3 (2 images of 800 px, fp32, the COCO recipe's model), once per commit,",
        "and each setting's step over the baseline's of the same run (the machine's speed moves",
        "between runs, and one 3-step run per commit cannot tell a few percent from noise: host",
        "savings of microseconds per layer do not make seconds of an 800 px step):",
        "",
        *_step800_table(),
        "",
        "## The forward's working set (memory, not time)",
        "",
        "```bash",
        "python tools/gpu_probe.py --what live --device cpu --images 2 --top 12 \\",
        "    --settings baseline quant_4bit",
        "```",
        "",
        "The forward's peak and the part of it freed before the forward ended, 2 images of",
        "800 px, fp32 (forward_probe_before.txt, forward_probe_after.txt):",
        "",
        *_working_set(),
        "",
        "## The demo's step (the issue's target: DropIT at most 1.15x the baseline)",
        "",
        "`python tools/bench.py --demo --repeats 20 --quiet-machine`, each commit twice,",
        "alternating (`demo_<side>_<round>.json`), then the canonical run",
        "([../bench_demo_cpu.json](../bench_demo_cpu.json)); each model's step over the",
        "baseline's of the same run:",
        "",
        *_demo_table(),
        "",
    ]
    (HERE / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

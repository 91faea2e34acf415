"""Writes README.md of this folder from the bench files beside it (and ../bench_demo_cpu.json).

python docs/results/host_ab_layout/make_readme.py
"""

from __future__ import annotations

import json
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


def _step800_table() -> list[str]:
    lines = ["| setting | before: step s | after: step s | after / before |", "|---|---:|---:|---:|"]
    before = {r["setting"]: r for r in _load("step800_before.json")}
    after = {r["setting"]: r for r in _load("step800_after.json")}
    for name, row in after.items():
        b, a = before[name]["step_s"], row["step_s"]
        lines.append(f"| {name} | {b:.2f} | {a:.2f} | {a / b:.3f} |")
    return lines


def _demo_table() -> list[str]:
    rows = _load(HERE.parent / "bench_demo_cpu.json")
    lines = ["| model | step s | over the baseline |", "|---|---:|---:|"]
    lines += [f"| {r['model']} | {r['step_s']:.4f} | {r['step_ratio']:.3f}x |" for r in rows]
    return lines + ["", f"Command: `{rows[0]['command']}` (quiet: {rows[0]['quiet']})."]


def main() -> None:
    before, after = META["before"], META["after"]
    lines = [
        "# dropit_core before and after issue 57 (one home per idea): host, demo and 800 px steps",
        "",
        f"Before: {before} (the commit before issue 57's work). After: {after}. Each commit in a",
        "worktree with its own code on the path (`PYTHONPATH=<worktree>`), on "
        f"{META['machine']}, {META['date']}, nothing else running.",
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
        "## The 800 px CPU recipe step",
        "",
        "```bash",
        "PYTHONPATH=. python tools/bench.py --settings baseline quant_4bit --image-size 800 \\",
        "    --images 2 --repeats 3 --draws 1 --json <file>",
        "```",
        "",
        "Median step of 3 (2 images of 800 px, fp32, the COCO recipe's model), once per commit:",
        "",
        *_step800_table(),
        "",
        "## The demo's step (after only; the issue's target: DropIT at most 1.15x the baseline)",
        "",
        "From [../bench_demo_cpu.json](../bench_demo_cpu.json):",
        "",
        *_demo_table(),
        "",
    ]
    (HERE / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

"""Write docs/results/step_peak_bf16_cpu/README.md from the JSON and logs beside it (no figure
typed)."""

import json
import re
from pathlib import Path

D = Path(__file__).resolve().parent
RUNS = [("before", "6769af8"), ("after", "710c1c7")]


def rows(name: str) -> dict[str, dict]:
    return {r["setting"]: r for r in json.loads((D / name).read_text())}


def probe(name: str) -> dict[str, str]:
    """Each setting's first line: the step peak, its phase, and the op and line at it."""
    text = (D / name).read_text()
    return dict(re.findall(r"^== (\S+), .*\n(step peak .*)$", text, flags=re.M))


bench = {run: rows(f"methods_{run}.json") for run, _ in RUNS}
table = [
    "| setting | step peak MB, before | after | peak ratio, before | after | forward peak MB, "
    "before | after | peak in, before | after |",
    "|---|---:|---:|---:|---:|---:|---:|---|---|",
]
for setting, b in bench["before"].items():
    a = bench["after"][setting]
    table.append(
        f"| {setting} | {b['peak_mb']:.1f} | {a['peak_mb']:.1f} | {b['peak_ratio']:.3f} | "
        f"{a['peak_ratio']:.3f} | {b['forward_peak_mb']:.1f} | {a['forward_peak_mb']:.1f} | "
        f"{b['peak_phase']} | {a['peak_phase']} |"
    )
rerun = rows("methods_after_rerun.json")
again = ", ".join(
    f"`{name}` {r['peak_mb']:.1f} MB ({r['peak_ratio']:.3f})" for name, r in rerun.items()
)
table.append(
    f"\nThe after run again, at {next(iter(rerun.values()))['commit'][:7]} (the step probe's "
    f"refusal added, no model code changed; `methods_after_rerun.json`): {again}."
)
peaks = []
for run, commit in RUNS:
    for setting, line in probe(f"probe_live_step_{run}.log").items():
        peaks.append(f"- {run} ({commit}), `{setting}`: {line}")

head = f"""# A step's peak under bf16 at 8 images (CPU): where it was, and the chunked rebuild

The GPU table's targets for issue 39 are set at 8 images of 800 px under AMP; no GPU has been
lent since the H200 lease of 2026-11-28 (before the lean RoI pooler), so this CPU run is their
proxy: the R50-FPN COCO recipe, 8 images of 800 px,
bf16 autocast, RSS that follows live memory (the bench's `MALLOC_MMAP_THRESHOLD_=65536`), one
training step after a warm one, memory only. Before: commit {RUNS[0][1]}; after: {RUNS[1][1]}
(a DropIT conv's split backward rebuilds a quant pack an image at a time, and the CPU's
bf16 rebuild goes a slice at a time instead of through a whole fp32 map). Other work ran on
the machine beside both runs: RSS moves no byte with load. Written by `make_readme.py` from
`methods_<run>.json` (and `bench_<run>.json`, the bench's rows), made by

```bash
python tools/bench.py --amp bf16 --image-size 800 --images 8 --settings baseline quant_4bit \\
    checkpoint_stages checkpoint_stages_quant_4bit --draws 1 --repeats 0 \\
    --json bench_<run>.json --methods-json methods_<run>.json
```

"""
middle = """
Where each step's peak was, from the step probe (`probe_live_step_<run>.log`, the tensors alive
at the step's peak by the line, or in the backward the autograd node, that made them):

```bash
python tools/gpu_probe.py --what live-step --device cpu --amp bf16 --images 8 --image-size 800 \\
    --top 25 --settings quant_4bit checkpoint_stages_quant_4bit baseline
```

"""
timing = [
    "| run | baseline step s | quant_4bit step s | quant_4bit / baseline |",
    "|---|---:|---:|---:|",
]
for run, commit in (("before", RUNS[0][1]), ("after", "a8d4c32")):
    for round_ in (1, 2):
        r = rows(f"fp32_time_{run}_{round_}.json")
        timing.append(
            f"| {run} ({commit}), round {round_} | {r['baseline']['step_s']:.2f} | "
            f"{r['quant_4bit']['step_s']:.2f} | {r['quant_4bit']['step_ratio']:.3f} |"
        )
ab_words = (D / "ab_split_backward.log").read_text().split()  # by part <s> whole <s>
ab = f"{float(ab_words[2]):.3f} s rebuilt by image, {float(ab_words[4]):.3f} s whole"
speed = f"""
## Time, fp32 (quiet: nothing else ran)

The COCO recipe in fp32 at 2 images of 800 px, in checkouts of {RUNS[0][1]} and a8d4c32 (the
change and these docs), alternating, twice (`fp32_time_<run>_<round>.json`):

```bash
python tools/bench.py --image-size 800 --settings baseline quant_4bit --draws 1 --repeats 5 \\
    --quiet-machine --json ... --methods-json fp32_time_<run>_<round>.json
```

"""
ab_text = f"""
In both rounds the 4-bit step's ratio was higher after than before, but the baseline, which
runs none of the changed code, was slower in the later checkout too, so these ratios do not
isolate the change. The changed backward alone, both ways in one process, alternating
(`ab_split_backward.py`, its output in `ab_split_backward.log`), one backward of one P2-level
conv, medians of 8: {ab}.
The peaks of this recipe did not move: its step peak is not at a split conv's rebuild (the
files' `peak_mb`).
"""

tail = """
The "before" probe ran at 11235c6, which adds the step probe to 6769af8 and changes no model
code. Read the probe's backward with one caveat: under its dispatch mode autograd sums two
gradients of one tensor out of place (the mode holds a Python reference to each tensor, and
autograd adds in place only into a tensor nothing else references; without the mode the same
sum is an `add_`, checked with the profiler), so a backward peak the probe puts at an `add`
counts one gradient more than the step holds. The RSS figures above are the step's own, with
the kernels' scratch that the probe does not see. After the change, both DropIT settings'
peaks are at the RPN head's P2 level, where its two predictors' input gradients (one P2 map
each) meet the gradient the RoI poolers gave P2.
"""
(D / "README.md").write_text(
    head
    + "\n".join(table)
    + "\n"
    + middle
    + "\n".join(peaks)
    + "\n"
    + tail
    + speed
    + "\n".join(timing)
    + "\n"
    + ab_text
)

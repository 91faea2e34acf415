"""Write docs/results/rpn_head_grad/README.md from the JSON and logs beside it (no figure
typed): `python docs/results/rpn_head_grad/make_readme.py`."""

import json
import re
from pathlib import Path

D = Path(__file__).resolve().parent
# (name, methods file, what the commit changed)
RUNS = [
    ("before", D.parent / "archive/step_peak_bf16_cpu/methods_after.json", "the chunked rebuild"),
    ("rpn", D / "methods_rpn_head.json", "the RPN head's map gradient made once"),
    (
        "pooled",
        D / "methods_pooled.json",
        "and the RoI poolers' pyramid gradient made once: tried, then reverted (20b0228)",
    ),
]


def rows(path: Path) -> dict[str, dict]:
    return {r["setting"]: r for r in json.loads(path.read_text())}


def probe(name: str) -> dict[str, str]:
    """Each setting's first line: the step peak, its phase, and the op and line at it."""
    text = (D / name).read_text()
    return dict(re.findall(r"^== (\S+), .*\n(step peak .*)$", text, flags=re.M))


bench = {name: rows(path) for name, path, _ in RUNS}
commits = {name: next(iter(r.values()))["commit"][:7] for name, r in bench.items()}
table = [
    "| setting | "
    + " | ".join(f"peak MB, {n}" for n, _, _ in RUNS)
    + " | "
    + " | ".join(f"ratio, {n}" for n, _, _ in RUNS)
    + " | peak in |",
    "|---|" + "---:|" * (2 * len(RUNS)) + "---|",
]
for setting in bench["before"]:
    runs = [bench[n][setting] for n, _, _ in RUNS]
    phases = sorted({r["peak_phase"] for r in runs})
    table.append(
        f"| {setting} | "
        + " | ".join(f"{r['peak_mb']:.1f}" for r in runs)
        + " | "
        + " | ".join(f"{r['peak_ratio']:.3f}" for r in runs)
        + f" | {', '.join(phases)} |"
    )
runs_text = "\n".join(
    f"- `{name}`: commit {commits[name]}, {what} (`{path.relative_to(D.parent)}`)"
    for name, path, what in RUNS
)
quiet = {name: next(iter(r.values()))["quiet"] for name, r in bench.items()}
peaks = []
for name in ("rpn", "pooled"):
    log = D / f"probe_live_step_{name}.log"
    if log.is_file():
        for setting, line in probe(log.name).items():
            peaks.append(f"- {name} ({commits[name]}), `{setting}`: {line}")
ab = (D / "ab_rpn_head.log").read_text().strip()
# "<model> <way> step <s> s (median of n), peak <MB> MB of tensors", per model and way
ab_rows = {
    (m, w): (float(t), float(p))
    for m, w, t, p in re.findall(r"^(\S+)\s+(once|summed)\s+step (\S+) s .*peak (\S+) MB", ab, re.M)
}
ab_words = "; ".join(
    f"{m}: step {ab_rows[m, 'once'][0] / ab_rows[m, 'summed'][0]:.3f}x of the old way's, "
    f"peak {ab_rows[m, 'once'][1] - ab_rows[m, 'summed'][1]:+.1f} MB"
    for m in dict.fromkeys(m for m, _ in ab_rows)
)

text = f"""# Gradients made once: the RPN head's map and the poolers' pyramid (CPU, bf16)

Issue 39's GPU targets are set at 8 images of 800 px under AMP; no GPU was lent, so this is
their CPU proxy, as in
[../archive/step_peak_bf16_cpu/](../archive/step_peak_bf16_cpu/README.md): the R50-FPN COCO
recipe, 8 images of 800 px, bf16 autocast, RSS that follows live memory, one training step
after a warm one, memory only. Each run is

```bash
python tools/bench.py --amp bf16 --image-size 800 --images 8 --settings baseline quant_4bit \\
    checkpoint_stages checkpoint_stages_quant_4bit --draws 1 --repeats 0 \\
    --json ... --methods-json <the file named below>
```

{runs_text}

Machine quiet in each run: {", ".join(f"{n} {'yes' if q else 'no'}" for n, q in quiet.items())}
(RSS moves no byte with load). Written by `make_readme.py` from those files.

{chr(10).join(table)}

Where each step's peak was, from the step probe at the commit of the run (its log beside this
file, `probe_live_step_<run>.log`; read an `add` in the backward as one gradient fewer than the
probe counts: under its dispatch mode autograd sums out of place):

```bash
python tools/gpu_probe.py --what live-step --device cpu --amp bf16 --images 8 --image-size 800 \\
    --top 25 --settings quant_4bit checkpoint_stages_quant_4bit
```

{chr(10).join(peaks)}

Before `rpn`, both DropIT settings' peaks were at the RPN head's P2 level, where its two
predictors each made a whole input gradient that autograd then summed
([../archive/step_peak_bf16_cpu/probe_live_step_after.log](../archive/step_peak_bf16_cpu/probe_live_step_after.log)).
`rpn` makes that gradient once, an image at a time: both DropIT settings' step peaks fell, the
others' did not move. The probe then put the peak in the RoI poolers' backward, where the box
and the mask pooler each make a whole pyramid of gradients that autograd then sums
(`probe_live_step_rpn.log`), but at an `add`, which it counts one gradient too many. `pooled`
made that pyramid once (the last pooler adding its share into the first's); its step peaks did
not move (the table), and its probe shows why: the step's peak is then later, in the backward
of the RPN head's ReLU at P2 (`probe_live_step_pooled.log`: the poolers' gradient of P2, the
RPN map's gradient and the ReLU's input gradient, one P2 map each), a moment the poolers'
change does not touch, so it was the peak at `rpn` too once the probe's `add` is counted
right. A cut that lowers no peak was not worth its code, so `pooled` was reverted; the code at
`rpn` is what the toolkit runs.

## Time

The RPN head's step alone (its conv and predictors over P2-P6), at the COCO recipe's 2 images
of 800 px in fp32, its map gradient made once (`once`) and the old way (`summed`), alternating
in one process (`PYTHONPATH=. python docs/results/rpn_head_grad/ab_rpn_head.py --images 2`, at
20b0228; nothing else ran). The peak is of torch's allocations over the head's step (the
profiler's), not RSS:

```
{ab}
```

Made once against the old way: {ab_words}. At 2 images in fp32 the two whole gradients were
not this head's peak. The map's gradient is now made before the predictors' weight gradients
(autograd runs the node that makes it first; each DropIT predictor used to make its weight
gradient, rebuilding its input an image at a time, before its input gradient), so it is alive
while they rebuild: the likeliest owner of the DropIT head's difference, not traced further.
"""
fp32 = rows(D / "fp32_methods.json")
BEFORE = D.parent / "archive/step_peak_bf16_cpu"
fp32_before = [rows(BEFORE / f"fp32_time_after_{i}.json") for i in (1, 2)]
span = {
    s: " and ".join(f"{r[s]['peak_mb']:.1f}" for r in fp32_before)
    for s in ("baseline", "quant_4bit")
}
text += f"""
## The COCO recipe in fp32 (quiet)

Issue 39's CPU targets are set in fp32 at 2 images of 800 px. At {fp32["baseline"]["commit"][:7]}
(`python tools/bench.py --image-size 800 --settings baseline quant_4bit --draws 1 --repeats 3
--quiet-machine`, `fp32_methods.json`, `fp32_bench.json`): `baseline` peak
{fp32["baseline"]["peak_mb"]:.1f} MB, `quant_4bit` {fp32["quant_4bit"]["peak_mb"]:.1f} MB
({fp32["quant_4bit"]["peak_ratio"]:.3f}x), step {fp32["quant_4bit"]["step_ratio"]:.3f}x of the
baseline's; the last runs before the change (a8d4c32, two rounds,
`../archive/step_peak_bf16_cpu/fp32_time_after_<round>.json`): `baseline` {span["baseline"]} MB,
`quant_4bit` {span["quant_4bit"]} MB.
"""
(D / "README.md").write_text(text)

"""Write docs/results/pooler_cpu_bf16/README.md from the probe logs beside it (no figure typed)."""

import re
from pathlib import Path

D = Path(__file__).resolve().parent


def peaks(name: str) -> dict[str, str]:
    text = (D / name).read_text()
    return dict(re.findall(r"^== (\S+), .*\nforward peak ([\d.]+) MB", text, flags=re.M))


cols = [
    ("2 images, 5606795", "probe_live_5606795.log"),
    ("2 images, 9aab9d7", "probe_live_9aab9d7.log"),
    ("2 images, b664efa", "probe_live_b664efa.log"),
    ("8 images, 5606795", "probe_live8_5606795.log"),
    ("8 images, b664efa", "probe_live8_b664efa.log"),
    ("8 images, 9ad0e59", "probe_live8_9ad0e59.log"),
]
data = [peaks(f) for _, f in cols]
rows = ["| setting | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
for setting in data[0]:
    rows.append(f"| {setting} | " + " | ".join(f"{d[setting]} MB" for d in data) + " |")
head = """# The RoI pooler's fp32 copy under autocast, before and after (CPU, bf16)

The forward's live tensors at its peak, by the line that made them, on this 2-core CPU under
bf16 autocast (the R50-FPN COCO recipe, images of 800 px), at these commits: 5606795
(torchvision's pooling: `roi_align` casts each whole level to fp32), 9aab9d7 (the first lean
pooler, db7df9e: a few images at a time, a split of each level) and b664efa (the lean pooler as
one autograd Function, 9985b18, which also holds no level's pooled maps apart from the result);
at 8 images also 9ad0e59 (the RPN head lets each level's conv map go after its predictors).
The probe counts each tensor as it is made and freed: load beside it moves no byte. Each file
is the probe's output as printed (the profiler's own USDT and device lines dropped), from

```bash
python tools/gpu_probe.py --what live --device cpu --amp bf16 --images 2 --image-size 800 \\
    --top 8 --settings baseline quant_4bit checkpoint_stages_quant_4bit   # and --images 8
```

run in a checkout of each commit (`probe_live_<commit>.log`: 2 images; `probe_live8_<commit>.log`:
8 images). The forward peak of each setting as the files give it (this table is written from
them by `make_readme.py` beside them, not typed):

"""
tail = """
The probe counts the forward only; the whole step's peak (the backward's too) is the GPU
table's and the bench's. At 8 images the peak of the DropIT settings is no longer at the
pooler: at b664efa it was in the RPN head at P3, the P2 map of the head still held by its loop
(`probe_live8_b664efa.log`); with that map let go (9ad0e59) it is in the RoI heads
(`probe_live8_9ad0e59.log`).
"""
(D / "README.md").write_text(head + "\n".join(rows) + "\n" + tail)

"""Writes README.md of this folder from the bench files beside it (bench_<N>mib.json).

python docs/results/chunk_bytes/make_readme.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHOSEN = 64  # dropit_core.layers.functions.CHUNK_BYTES, in MiB


def main() -> None:
    runs = {}
    for path in HERE.glob("bench_*mib.json"):
        mib = int(re.fullmatch(r"bench_(\d+)mib\.json", path.name).group(1))
        runs[mib] = {row["setting"]: row for row in json.loads(path.read_text())}
    sizes = sorted(runs)
    settings = [s for s in ("quant_4bit", "checkpoint_stages_quant_4bit") if s in runs[sizes[0]]]
    base = runs[sizes[0]]
    lines = [
        "# The backward's chunks by bytes: what each CHUNK_BYTES costs in peak",
        "",
        "A split conv backward (inputs of `SPLIT_BYTES`, 8 MiB, or more) makes its weight",
        "gradient over chunks of images, each at most `CHUNK_BYTES` of input and at least one",
        "image (`dropit_core.layers.functions.images_per_chunk`). Before issue 58 a chunk was",
        "`SPLIT_BYTES`, one image at the 800 px recipe's larger maps: a layer's calls grew with",
        "the batch. The step peak of the GPU table's setting on the CPU (8 images of 800 px, bf16,",
        "memory only) for each candidate, measured one after another in one process by",
        "`PYTHONPATH=. python docs/results/chunk_bytes/ab_chunk_bytes.py "
        + " ".join(str(s) for s in sizes)
        + " 32 128` (log: `ab_chunk_bytes.log`; stopped during 32 MiB, as 64 MiB already cost",
        "nothing), 2026-12-02; machine not quiet (other work beside it: memory figures only).",
        "Peak in MB (RSS) and against the 8 MiB chunk:",
        "",
        "| CHUNK_BYTES | " + " | ".join(f"{s} peak MB" for s in settings) + " |",
        "|---|" + "---:|" * len(settings),
    ]
    for mib in sizes:
        cells = []
        for s in settings:
            row = runs[mib].get(s)
            if row is None:
                cells.append("not measured")
                continue
            change = row["peak_mb"] / base[s]["peak_mb"] - 1
            cells.append(f"{row['peak_mb']:.1f} ({change:+.2%})")
        chosen = " (chosen)" if mib == CHOSEN else ""
        lines.append(f"| {mib} MiB{chosen} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The issue allows +2%. The chosen budget is the accelerators' (`CHUNK_BYTES`): there a",
        "map of up to 64 MiB per batch is one call at 2 and at 8 images, and a larger map takes as",
        "many images a chunk as 64 MiB holds. The CPU keeps 8 MiB chunks (a call costs nothing",
        "there beside its work), so the committed CPU runs, the study's and the demo's, keep their",
        "sums bit for bit; these CPU runs set the CPU's budget to each candidate, the GPU's proxy.",
        "",
    ]
    (HERE / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

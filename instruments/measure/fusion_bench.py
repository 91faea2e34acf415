"""Compiled DropIT with its packs and ReLU masks fused into Inductor's kernels, or opaque, and
eager: what each costs to compile and to run (``tools/bench.py fusion``).

The model is what ``train.compile: backbone`` compiles (the lean ResNet-FPN with 4-bit DropIT,
dynamic shapes); each setting runs in a fresh process with an empty Inductor cache, so the first
step's seconds include the whole compile.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from instruments.measure.rows import rows_with
from rcnn_dropit.errors import UsageError

# (setting, DROPIT_FUSE, compiled): the eager model first, as the reference of every ratio.
SETTINGS = (("eager", "0", False), ("opaque", "0", True), ("fused", "1", True))


def fusion_rows(
    backbone: str = "resnet18",
    image_size: int = 128,
    images: int = 2,
    repeats: int = 5,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """One row per setting (eager, compiled with opaque packs, compiled with fused ones), each
    measured in its own process."""
    rows = []
    for name, fuse, compiled in SETTINGS:
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            env = {**os.environ, "DROPIT_FUSE": fuse, "TORCHINDUCTOR_CACHE_DIR": cache}
            args = [backbone, str(image_size), str(images), str(repeats), device, str(compiled)]
            proc = subprocess.run(
                [sys.executable, "-m", __name__, *args],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode:
                raise RuntimeError(f"fusion, setting {name}: {proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row.update(setting=name, kernels=_kernel_sources(Path(cache)))
        rows.append(row)
    return rows


def _kernel_sources(cache: Path) -> int:
    """The kernels Inductor built into ``cache``: its C++ sources (CPU) or Triton ones (GPU)."""
    return sum(1 for _ in cache.rglob("*.cpp")) + sum(
        1 for p in cache.rglob("*.py") if p.read_text(errors="ignore").count("@triton.jit")
    )


def measure(
    backbone: str,
    image_size: int,
    images: int,
    repeats: int,
    device: str = "cpu",
    compiled: bool = True,
) -> dict[str, Any]:
    """The first step (compiling included) and the median later step of the lean backbone
    with 4-bit DropIT, compiled (packs as ``DROPIT_FUSE`` says) or eager, in this process."""
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    from dropit_core import current_settings, lean_detector, set_step, to_dropit
    from rcnn_dropit.engine.compiling import compiled as as_train_compiles

    if repeats < 1:
        raise UsageError(f"--repeats {repeats}: allowed integers >= 1")
    torch.manual_seed(0)
    model = lean_detector(resnet_fpn_backbone(backbone_name=backbone, weights=None))
    to_dropit(model.to(device), strategy="quant", bits=4)
    if compiled:
        model.forward = as_train_compiles(model.forward)
    x = torch.randn(images, 3, image_size, image_size, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else lambda: None

    def step(i: int) -> float:
        start = time.perf_counter()
        set_step(model, i)
        model.zero_grad(set_to_none=True)
        maps = model(x)
        sum(m.square().mean() for m in maps.values()).backward()
        sync()
        return time.perf_counter() - start

    first = step(0)
    times = [step(i) for i in range(1, repeats + 1)]
    return {
        "compiled": compiled,
        "fuse": compiled and current_settings().fuse,
        "backbone": backbone,
        "image_size": image_size,
        "images": images,
        "first_step_s": round(first, 2),
        "step_s": round(statistics.median(times), 4),
        "repeats": repeats,
        "device": x.device.type,
        "threads": torch.get_num_threads(),
    }


def is_fusion_rows(data: Any) -> bool:
    """Whether JSON data read from a file is ``fusion`` rows."""
    return rows_with(data, "first_step_s", "kernels")


def fusion_markdown(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of ``fusion`` rows; step ratios against the first (eager) row."""
    base = rows[0]
    lines = [
        "| packs and masks | first step (compiling), s | kernels built | step, s | step ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["step_s"] / base["step_s"]
        lines.append(
            f"| {r['setting']} | {r['first_step_s']:.1f} | {r['kernels']} | "
            f"{r['step_s']:.3f} | {ratio:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # one setting, in the process fusion_rows started
    name, size, count, reps = sys.argv[1], *map(int, sys.argv[2:5])
    print(json.dumps(measure(name, size, count, reps, sys.argv[5], sys.argv[6] == "True")))

"""Config overrides shared by the tests that train for real: seconds-long CPU runs on a tiny
generated shapes set (64 px images, ResNet-18 from the demo configs)."""

from __future__ import annotations

from pathlib import Path


def tiny_opts(root: Path, *extra: str, num_val: int = 4, batch_size: int = 2) -> list[str]:
    """Overrides for 8 train / ``num_val`` val images of 64 px, few RoIs, logging every step."""
    return [
        f"data.root={root}",
        "data.shapes.num_train=8",
        f"data.shapes.num_val={num_val}",
        "data.shapes.image_size=64",
        "data.num_workers=0",
        "model.min_size=64",
        "model.max_size=64",
        "model.box_batch_size_per_image=32",
        "model.rpn_batch_size_per_image=32",
        "model.box_detections_per_img=20",
        f"solver.batch_size={batch_size}",
        "solver.warmup_iters=2",
        "train.device=cpu",
        "train.log_every=1",
        "train.eval_every=0",
        "train.measure_memory=false",
        *extra,
    ]

"""Helpers the tests share: paths, tiny-run options, job environments, a hand-made COCO set,
calling tools as a user would. Fixtures are in conftest.py."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from pycocotools import mask as mask_util
from pycocotools.coco import COCO

from rcnn_dropit.distributed import run_on_main
from rcnn_dropit.evaluation import COCOEvaluator
from rcnn_dropit.metrics_file import read_metrics
from rcnn_dropit.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
TRAIN_PY, TEST_PY = REPO / "tools/train.py", REPO / "tools/test.py"
FASTER_CFG = REPO / "configs/demo/fasterrcnn_shapes.yaml"
MASK_CFG = REPO / "configs/demo/maskrcnn_shapes_baseline.yaml"
MASK_DROPIT_CFG = REPO / "configs/demo/maskrcnn_shapes_g0.8.yaml"
# Launcher variables of an enclosing job must not leak into the jobs a test starts.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")


# The shapes set of tiny_opts: 8 training and (by default) 4 validation images of 64 px, the demo
# configs' 3 classes and seed 0 (conftest.py's shapes_set fixture makes it once per session).
TINY_SHAPES = {"num_train": 8, "num_val": 4, "image_size": 64, "num_classes": 3, "seed": 0}


# The tiny benches' model (tests/instruments, conftest.py's narrow_bench): the bench's recipe at
# 64 px with ResNet-18, its FPN and heads narrowed. The same code paths in a third of the time:
# at the recipe's 256 channels the mask head's 3x3 convs over 14x14 RoIs were most of every tiny
# step on 2 cores.
NARROW_BENCH = ("model.fpn_channels=64", "model.box_head_width=256", "model.mask_head_channels=64")


def tiny_opts(root: Path, *extra: str, num_val: int = 4, batch_size: int = 2) -> list[str]:
    """Overrides for a seconds-long CPU run: 8 train / ``num_val`` val shapes images of 64 px
    (generated under ``root`` on first use), ResNet-18 from the demo configs, few RoIs, logging
    every step, no evaluation before the end, no memory report."""
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


def coco_opts(root: Path, *extra: str) -> list[str]:
    """tiny_opts for a shapes set read as data.dataset=coco from ``root``: COCO 2017's layout,
    so the default paths (train2017/, annotations/instances_train2017.json, ...)."""
    return tiny_opts(
        root,
        "data.dataset=coco",
        "model.num_classes=4",
        *extra,
    )


def train_records(run: Path) -> list[dict]:
    """The training records of a run's metrics.jsonl, in order."""
    return [r for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"]


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    """Environment for a started job: this one without launcher variables, one thread each."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def torchrun(launch: list[str], script: Path, args: list[str]) -> list[str]:
    """Command line of `torchrun <launch> script args` (as `python -m torch.distributed.run`)."""
    return [sys.executable, "-m", "torch.distributed.run", *launch, str(script), *args]


def single_node(nproc: int = 2) -> list[str]:
    """torchrun options for nproc processes on this machine, on a free port."""
    return [f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]


def run_tool(script: Path, *args: str, cwd: Path, timeout: float = 300):
    """A tool as a user starts it: a fresh interpreter (slow: imports torch)."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=job_env(),
        timeout=timeout,
        check=False,
    )


def sorted_results(path: Path) -> list[str]:
    """A COCO results file's entries as sorted JSON strings (order-free comparison)."""
    return sorted(json.dumps(r, sort_keys=True) for r in json.loads(path.read_text()))


# ---- a hand-written two-image COCO set (AP values worked out by hand in test_evaluation) -----

# image id -> (height, width); objects: (image id, category id, x0, y0, x1, y1) pixel rectangles.
IMAGES = {1: (64, 64), 2: (48, 64)}
OBJECTS = [
    (1, 1, 2, 5, 12, 15),  # 10x10, small
    (1, 3, 16, 10, 56, 50),  # 40x40 = 1600, medium
    (2, 1, 30, 20, 50, 40),  # 20x20, small
    (2, 3, 2, 30, 12, 45),  # 10x15, small
]
CAT_OF_LABEL = {1: 1, 2: 3}  # contiguous model labels -> sparse COCO category ids
LABEL_OF_CAT = {c: label for label, c in CAT_OF_LABEL.items()}


def rect_mask(image_id: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
    """Binary H x W mask of a pixel rectangle."""
    mask = np.zeros(IMAGES[image_id], dtype=np.uint8)
    mask[y0:y1, x0:x1] = 1
    return mask


def make_coco_gt() -> COCO:
    """Ground truth with RLE masks so that predicted masks can match it exactly."""
    anns = []
    for ann_id, (image_id, cat, x0, y0, x1, y1) in enumerate(OBJECTS, start=1):
        rle = mask_util.encode(np.asfortranarray(rect_mask(image_id, x0, y0, x1, y1)))
        rle["counts"] = rle["counts"].decode("ascii")
        anns.append(
            {
                "id": ann_id,
                "image_id": image_id,
                "category_id": cat,
                "bbox": [x0, y0, x1 - x0, y1 - y0],
                "area": (x1 - x0) * (y1 - y0),
                "segmentation": rle,
                "iscrowd": 0,
            }
        )
    coco = COCO()
    coco.dataset = {
        "images": [{"id": i, "height": h, "width": w} for i, (h, w) in IMAGES.items()],
        "annotations": anns,
        "categories": [{"id": 1, "name": "square"}, {"id": 3, "name": "block"}],
    }
    coco.createIndex()
    return coco


def predictions(image_id: int, shift: float = 0.0) -> dict[str, torch.Tensor]:
    """torchvision-style outputs: every object of the image, moved right by shift x its width."""
    boxes, labels, masks = [], [], []
    for img, cat, x0, y0, x1, y1 in OBJECTS:
        if img != image_id:
            continue
        dx = int(round(shift * (x1 - x0)))
        boxes.append([x0 + dx, y0, x1 + dx, y1])
        labels.append(LABEL_OF_CAT[cat])
        # Probabilities 0.9 inside and 0.2 outside: the 0.5 threshold recovers the rectangle.
        masks.append(0.2 + 0.7 * rect_mask(image_id, x0 + dx, y0, x1 + dx, y1))
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32),
        "scores": torch.ones(len(boxes)),
        "labels": torch.tensor(labels, dtype=torch.int64),
        "masks": torch.tensor(np.stack(masks), dtype=torch.float32)[:, None],
    }


def call_tool(script: str, *args: str, capsys) -> subprocess.CompletedProcess:
    """The tool's main() in this process (fast); same exit code and output as run_tool."""
    spec = importlib.util.spec_from_file_location(f"tool_{script[:-3]}", REPO / "tools" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(script, code, out, err)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def evaluate_into(evaluator: COCOEvaluator, folder: Path | str | None = None) -> dict:
    """The evaluator's metrics (every rank); with ``folder``, rank 0 writes the COCO results
    there as a run directory holds them."""
    metrics, results = evaluator.evaluate_with_results()
    if folder is not None:
        run_dir = RunDir(folder)
        run_on_main(lambda: run_dir.root.mkdir(parents=True, exist_ok=True))
        run_dir.write_coco_results(results)
    return metrics


def train_killed_at(cfg: Path, opts: list[str], run: Path, iteration: int) -> None:
    """Train ``cfg`` into ``run`` as a job killed when it reaches ``iteration`` (after any
    checkpoint before it): the run's files as such a job leaves them, ready to resume."""
    import pytest

    from rcnn_dropit.engine.runner import train
    from rcnn_dropit.engine.trainer import Trainer

    real_step = Trainer.step

    def killed(self, images, targets, at):
        if at == iteration:
            raise KeyboardInterrupt
        return real_step(self, images, targets, at)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Trainer, "step", killed)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, opts, output_dir=run)

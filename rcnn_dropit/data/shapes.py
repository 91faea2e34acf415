"""Synthetic "shapes" instance-segmentation set in COCO layout, deterministic from a seed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pycocotools.mask as mask_utils
from PIL import Image

from rcnn_dropit.errors import UsageError

from .coco import mask_to_rle

CLASS_NAMES = ("circle", "square", "triangle", "ellipse", "diamond", "hexagon")
_ROUND_SHAPES = ("circle", "ellipse")  # stored as RLE; the others as polygons when fully visible
_MIN_VISIBLE = 0.6  # an occluded object keeps at least this fraction of its pixels
FORMAT_VERSION = 1
# COCO 2017's folder and file names, so that a COCO reader (this toolkit's `data.dataset: coco`
# with its default paths, torchvision's reference scripts) reads the set where it lies.
SPLIT_NAMES = {"train": "train2017", "val": "val2017"}


def split_paths(root: str | Path, split: str) -> tuple[Path, Path]:
    """(image folder, annotation file) of a shapes set's 'train' or 'val' split. A set written
    before the COCO names (train/, val/, annotations/instances_{train,val}.json) is read where
    it lies: nothing is moved or made again."""
    root = Path(root)
    name = SPLIT_NAMES[split]
    images, ann = root / name, root / "annotations" / f"instances_{name}.json"
    old_ann = root / "annotations" / f"instances_{split}.json"
    if not ann.is_file() and old_ann.is_file():
        return root / split, old_ann
    return images, ann


def make_shapes(
    root: str | Path,
    num_train: int,
    num_val: int,
    image_size: int,
    num_classes: int,
    seed: int,
    first_class: int = 0,
) -> None:
    """Write root/{train,val}2017/*.png and root/annotations/instances_{train,val}2017.json.

    The classes are CLASS_NAMES[first_class : first_class + num_classes]: a set made with another
    first_class (and seed) has other objects, e.g. to pretrain a backbone for the fine-tune study.
    """
    if not 0 <= first_class < len(CLASS_NAMES):
        raise UsageError(
            f"data.shapes.first_class: {first_class} is not in 0..{len(CLASS_NAMES) - 1}"
        )
    if not 1 <= num_classes <= len(CLASS_NAMES) - first_class:
        raise UsageError(
            f"data.shapes.num_classes: {num_classes} is not in 1..{len(CLASS_NAMES) - first_class}"
            f" (with first_class {first_class}, of {len(CLASS_NAMES)} shapes)"
        )
    if image_size < 32:
        raise UsageError(f"data.shapes.image_size: {image_size} must be >= 32")
    if num_train < 1 or num_val < 1:
        raise UsageError(
            f"data.shapes: num_train ({num_train}) and num_val ({num_val}) must be >= 1"
        )
    root = Path(root)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    params = shapes_info(num_train, num_val, image_size, num_classes, seed, first_class)
    names = CLASS_NAMES[first_class : first_class + num_classes]
    categories = [
        {"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(names)
    ]
    for split_id, (split, count) in enumerate((("train", num_train), ("val", num_val))):
        folder = root / SPLIT_NAMES[split]
        folder.mkdir(exist_ok=True)
        empty = _empty_images(count, seed, split_id)
        images, annotations = [], []
        for i in range(count):
            rng = np.random.default_rng([seed, split_id, i])
            pixels, objects = _render(rng, image_size, names, empty=i in empty)
            file_name = f"{i:06d}.png"
            Image.fromarray(pixels).save(folder / file_name, format="PNG")
            h, w = pixels.shape[:2]
            images.append({"id": i + 1, "file_name": file_name, "width": w, "height": h})
            for obj in objects:
                obj.update(id=len(annotations) + 1, image_id=i + 1)
                annotations.append(obj)
        doc = {
            "info": {"description": "rcnn_dropit synthetic shapes", "shapes": params},
            "images": images,
            "annotations": annotations,
            "categories": categories,
        }
        ann_file = root / "annotations" / f"instances_{SPLIT_NAMES[split]}.json"
        ann_file.write_text(json.dumps(doc))


def shapes_info(
    num_train: int, num_val: int, image_size: int, num_classes: int, seed: int, first_class: int = 0
) -> dict:
    """The parameters recorded in (and compared against) a generated set's annotation files."""
    info = {
        "num_train": num_train,
        "num_val": num_val,
        "image_size": image_size,
        "num_classes": num_classes,
        "seed": seed,
        "version": FORMAT_VERSION,
    }
    if first_class:  # recorded only when set, so sets made before the option still match
        info["first_class"] = first_class
    return info


def _empty_images(count: int, seed: int, split_id: int) -> set[int]:
    """About 1 in 20 images has no object, so the 'drop empty images' path is exercised."""
    if count < 4:
        return set()
    rng = np.random.default_rng([seed, split_id, 1 << 30])
    n_empty = max(1, count // 20)
    return {int(i) for i in rng.choice(count, size=n_empty, replace=False)}


def _render(
    rng: np.random.Generator, size: int, names: tuple[str, ...], empty: bool
) -> tuple[np.ndarray, list[dict]]:
    """One image (uint8 HxWx3) and its annotations without ids."""
    short = round(0.75 * size)
    w, h = [(size, size), (size, size), (size, short), (short, size)][rng.integers(4)]
    image = _background(rng, h, w)
    if empty:
        return image, []
    for _ in range(100):
        shapes = [_sample_shape(rng, h, w, names) for _ in range(rng.integers(1, 5))]
        visible = _visible_masks([s["full"] for s in shapes])
        kept = [v.sum() / s["full"].sum() for v, s in zip(visible, shapes, strict=True)]
        if min(kept) >= _MIN_VISIBLE:
            break
    else:  # crowded beyond repair: keep just the last (unoccluded) shape
        shapes, visible = shapes[-1:], visible[-1:]
    background_mean = image.reshape(-1, 3).mean(0)
    annotations = []
    for shape, vis in zip(shapes, visible, strict=True):
        color = _contrasting_color(rng, background_mean)
        noise = rng.normal(0.0, 6.0, size=(h, w, 3))
        paint = np.clip(color + noise, 0, 255).astype(np.uint8)
        image[shape["full"] > 0] = paint[shape["full"] > 0]
        annotations.append(_annotation(shape, vis))
    return image, annotations


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Random base colour, smooth blotches and pixel noise: not flat, but not shape-like."""
    base = rng.uniform(50.0, 205.0, size=3)
    blotches = _smooth_noise(rng, h, w, cells=4) * 30.0
    grain = rng.normal(0.0, 10.0, size=(h, w, 3))
    return np.clip(base + blotches + grain, 0, 255).astype(np.uint8)


def _smooth_noise(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    """Bilinear interpolation of a coarse Gaussian grid to HxWx3."""
    grid = rng.normal(size=(cells + 1, cells + 1, 3))
    ys, xs = np.linspace(0, cells, h), np.linspace(0, cells, w)
    y0 = np.minimum(ys.astype(int), cells - 1)
    x0 = np.minimum(xs.astype(int), cells - 1)
    fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    top = grid[y0][:, x0] * (1 - fx) + grid[y0][:, x0 + 1] * fx
    bottom = grid[y0 + 1][:, x0] * (1 - fx) + grid[y0 + 1][:, x0 + 1] * fx
    return top * (1 - fy) + bottom * fy


def _contrasting_color(rng: np.random.Generator, against: np.ndarray) -> np.ndarray:
    """A colour at least ~100 (RGB distance) away from the background mean."""
    for _ in range(50):
        color = rng.uniform(0.0, 255.0, size=3)
        if np.linalg.norm(color - against) >= 100.0:
            return color
    return 255.0 - against


def _sample_shape(rng: np.random.Generator, h: int, w: int, names: tuple[str, ...]) -> dict:
    """Class, geometry and full (unoccluded) mask of one object inside the image."""
    label = int(rng.integers(len(names)))
    name = names[label]
    radius = rng.uniform(0.1, 0.22) * min(h, w)
    cx = rng.uniform(radius + 1, w - radius - 1)
    cy = rng.uniform(radius + 1, h - radius - 1)
    angle = rng.uniform(0.0, 2 * math.pi)
    shape = {"category_id": label + 1, "name": name}
    if name in _ROUND_SHAPES:
        minor = radius if name == "circle" else radius * rng.uniform(0.45, 0.75)
        shape["full"] = _ellipse_mask(h, w, cx, cy, radius, minor, angle)
        shape["polygon"] = None
    else:
        if name == "square":
            corners, angle = 4, math.pi / 4  # axis-aligned
        elif name == "diamond":
            corners, angle = 4, 0.0
        else:
            corners = 3 if name == "triangle" else 6
        steps = [angle + 2 * math.pi * k / corners for k in range(corners)]
        # rounded first, so the stored polygon decodes to exactly the pixels that were painted
        poly = [
            round(v, 2)
            for t in steps
            for v in (cx + radius * math.cos(t), cy + radius * math.sin(t))
        ]
        shape["full"] = mask_utils.decode(mask_utils.frPyObjects([poly], h, w))[..., 0]
        shape["polygon"] = poly
    return shape


def _ellipse_mask(
    h: int, w: int, cx: float, cy: float, major: float, minor: float, angle: float
) -> np.ndarray:
    """Pixels whose centres fall inside a rotated ellipse."""
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    dx, dy = xs - cx, ys - cy
    u = dx * math.cos(angle) + dy * math.sin(angle)
    v = -dx * math.sin(angle) + dy * math.cos(angle)
    return ((u / major) ** 2 + (v / minor) ** 2 <= 1.0).astype(np.uint8)


def _visible_masks(full: list[np.ndarray]) -> list[np.ndarray]:
    """Later objects are painted over earlier ones: what remains of each."""
    covered = np.zeros_like(full[0], dtype=bool)
    visible = []
    for mask in reversed(full):
        visible.append((mask.astype(bool) & ~covered).astype(np.uint8))
        covered |= mask.astype(bool)
    return visible[::-1]


def _annotation(shape: dict, visible: np.ndarray) -> dict:
    """COCO annotation of the visible part: its polygon if intact (the polygon is what painted
    it, so it decodes to exactly these pixels), else uncompressed RLE, exact too. Both are what
    readers of iscrowd=0 objects accept, torchvision's reference loader included."""
    ys, xs = np.nonzero(visible)
    x0, y0 = int(xs.min()), int(ys.min())
    bbox = [x0, y0, int(xs.max()) - x0 + 1, int(ys.max()) - y0 + 1]
    if shape["polygon"] is not None and np.array_equal(visible, shape["full"]):
        segmentation = [shape["polygon"]]
    else:
        segmentation = mask_to_rle(visible)
    return {
        "category_id": shape["category_id"],
        "bbox": bbox,
        "area": int(visible.sum()),
        "iscrowd": 0,
        "segmentation": segmentation,
    }

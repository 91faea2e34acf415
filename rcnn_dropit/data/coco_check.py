"""Structure and types of a COCO instances file, checked once at load with one clear message."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, NoReturn

from rcnn_dropit.errors import UsageError

REQUIRED_TOP = ("images", "annotations", "categories")
REQUIRED_IMAGE = ("id", "file_name", "width", "height")
REQUIRED_ANN = ("id", "image_id", "category_id", "bbox")


class _Bad:
    """Raises the 'is not a COCO file' error of one file."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self, what: str) -> NoReturn:
        raise UsageError(f"{self.where} is not a COCO file: {what}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float that fits a float (a 400-digit int does not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _object_list(
    data: dict, name: str, required: tuple[str, ...], bad: _Bad, unique: bool = True
) -> list[dict]:
    items = data[name]
    if not isinstance(items, list):
        bad(f"'{name}' must be a list, got {type(items).__name__}")
    kind = name[:-1] if name != "categories" else "category"
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            bad(f"{name}[{index}] must be an object, got {_short(item)}")
        for key in required:
            if key not in item:
                bad(f"{kind} {_short(item.get('id', '?'))} lacks '{key}'")
        if not _is_int(item["id"]):
            bad(f"{name}[{index}] has id {_short(item['id'])}; ids must be integers")
    if unique:  # labels and file lookups are keyed by these ids
        counts = Counter(item["id"] for item in items)
        dup = next((i for i, n in counts.items() if n > 1), None)
        if dup is not None:
            bad(f"{kind} id {dup} appears more than once")
    return items


def _check_image(img: dict, bad: _Bad) -> None:
    if not isinstance(img["file_name"], str) or not img["file_name"]:
        bad(f"image {img['id']} has file_name {_short(img['file_name'])}; expected a file name")
    for key in ("width", "height"):
        if not _is_int(img[key]) or img[key] < 1:
            bad(f"image {img['id']} has {key} {_short(img[key])}; expected a positive integer")


def _check_segmentation(seg: Any, ann_id: int, bad: _Bad) -> None:
    if seg is None or seg == []:
        return
    if isinstance(seg, list):
        if all(isinstance(p, list) and all(_is_number(v) for v in p) for p in seg):
            return
    elif isinstance(seg, dict) and "counts" in seg and "size" in seg:
        size, counts = seg["size"], seg["counts"]
        good_size = isinstance(size, list) and len(size) == 2 and all(_is_int(v) for v in size)
        good_counts = isinstance(counts, str) or (
            isinstance(counts, list) and all(_is_int(v) and v >= 0 for v in counts)
        )
        if good_size and good_counts:
            return
    bad(
        f"annotation {ann_id} has segmentation {_short(seg)}; expected polygons (lists of "
        "numbers) or RLE {size: [h, w], counts: text or list of counts}"
    )


def _check_annotation(ann: dict, bad: _Bad) -> None:
    ann_id = ann["id"]
    for key in ("image_id", "category_id"):
        if not _is_int(ann[key]):
            bad(f"annotation {ann_id} has {key} {_short(ann[key])}; expected an integer")
    box = ann["bbox"]
    if not (isinstance(box, list) and len(box) == 4 and all(_is_number(v) for v in box)):
        bad(f"annotation {ann_id} has bbox {_short(box)}; expected 4 finite numbers [x, y, w, h]")
    if "area" in ann and not _is_number(ann["area"]):
        bad(f"annotation {ann_id} has area {_short(ann['area'])}; expected a finite number")
    if "iscrowd" in ann and ann["iscrowd"] not in (0, 1):
        bad(f"annotation {ann_id} has iscrowd {_short(ann['iscrowd'])}; expected 0 or 1")
    _check_segmentation(ann.get("segmentation"), ann_id, bad)


# pycocotools rasterises a polygon edge by edge at 5x its resolution, holding every edge point at
# once: about 115 bytes per pixel of extent (4.6 GB for a point at 4e7, measured), so a point at
# 2e8 would ask for some 23 GB. Points of a real polygon lie on their image or next to it.
FAR = 1.0  # how far beyond its image's edges, in image widths or heights, a point may lie


def far_polygon_point(polygon: list, width: int, height: int) -> tuple[float, float] | None:
    """The first point of ``polygon`` ([x1, y1, x2, y2, ...]) that lies more than ``FAR`` image
    sizes beyond the image's edges, or None."""
    xs, ys = polygon[0::2], polygon[1::2]
    low_x, high_x = -FAR * width, (1 + FAR) * width
    low_y, high_y = -FAR * height, (1 + FAR) * height
    if not ys or (low_x <= min(xs) <= max(xs) <= high_x and low_y <= min(ys) <= max(ys) <= high_y):
        return None  # the usual case, at C speed (COCO has over a million polygons)
    for x, y in zip(xs, ys, strict=False):
        if not (low_x <= x <= high_x and low_y <= y <= high_y):
            return x, y
    return None  # an odd-length list: its last x has no y, as pycocotools reads it


def _check_polygons_on_image(ann: dict, size: tuple[int, int] | None, bad: _Bad) -> None:
    seg = ann.get("segmentation")
    if not isinstance(seg, list) or size is None:
        return  # RLE carries its own size; an unknown image is reported where it is used
    for polygon in seg:
        point = far_polygon_point(polygon, *size)
        if point is not None:
            bad(
                f"annotation {ann['id']} has a polygon point {_short(point)} far outside "
                f"its image ({size[0]}x{size[1]}); expected points within one image size "
                "of it (pycocotools would need memory in proportion to the distance)"
            )


def check_coco(data: Any, where: str) -> None:
    """Raise UsageError('<where> is not a COCO file: ...') for the first bad entry of data."""
    bad = _Bad(where)
    if not isinstance(data, dict):
        bad("top level must be an object")
    for name in REQUIRED_TOP:
        if name not in data:
            bad(f"missing key '{name}'")
    images = _object_list(data, "images", REQUIRED_IMAGE, bad)
    for img in images:
        _check_image(img, bad)
    sizes = {img["id"]: (img["width"], img["height"]) for img in images}
    _object_list(data, "categories", ("id",), bad)
    for ann in _object_list(data, "annotations", REQUIRED_ANN, bad, unique=False):
        _check_annotation(ann, bad)
        _check_polygons_on_image(ann, sizes.get(ann["image_id"]), bad)

"""COCO-format instance dataset on pycocotools: boxes, labels and masks per image."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pycocotools.mask as mask_utils
import torch
from PIL import Image, UnidentifiedImageError
from pycocotools.coco import COCO
from torchvision.transforms.functional import pil_to_tensor

from rcnn_dropit.errors import MissingPathError, UsageError

from .coco_check import check_coco, far_polygon_point

Transform = Callable[[torch.Tensor, dict, random.Random], tuple[torch.Tensor, dict]]


def read_json_file(path: str | Path, key: str, noun: str = "file") -> Any:
    """A JSON file's content; a missing file or bad JSON is one message naming ``key``."""
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"{key}: {noun} '{path}' does not exist")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{key}: '{path}' is not valid JSON ({err})") from None


def load_coco_json(ann_file: str | Path, key: str = "annotation file") -> dict:
    """Read a COCO instances JSON and check the keys this package relies on."""
    data = read_json_file(ann_file, key, noun="annotation file")
    check_coco(data, f"{key}: '{Path(ann_file)}'")
    return data


def coco_from_dict(data: dict) -> COCO:
    """Build a pycocotools COCO index from an already loaded dict, without its prints."""
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def segmentation_to_mask(seg: Any, height: int, width: int) -> np.ndarray:
    """Decode a COCO segmentation (polygons, compressed or uncompressed RLE) to a uint8 HxW mask."""
    if isinstance(seg, list):
        # pycocotools reads a 4-number list as a box, and fewer than 3 points is no polygon
        polys = [p for p in seg if len(p) >= 6]
        if not polys:
            return np.zeros((height, width), dtype=np.uint8)
        for poly in polys:  # before pycocotools: its memory grows with the polygon's extent
            point = far_polygon_point(poly, width, height)
            if point is not None:
                raise ValueError(
                    f"polygon point {point} lies far outside the image ({width}x{height})"
                )
        rle = mask_utils.merge(mask_utils.frPyObjects(polys, height, width))
    elif isinstance(seg, dict) and "counts" in seg and "size" in seg:
        if list(seg["size"]) != [height, width]:
            raise ValueError(f"RLE size {seg['size']} does not match the image ({height}x{width})")
        if isinstance(seg["counts"], list):
            rle = mask_utils.frPyObjects(seg, height, width)
        else:
            rle = seg
    else:
        raise ValueError(f"unknown segmentation format {type(seg).__name__}")
    return np.ascontiguousarray(mask_utils.decode(rle), dtype=np.uint8)


def mask_to_rle(mask: np.ndarray) -> dict[str, Any]:
    """COCO's uncompressed RLE of a binary HxW mask, exact: run lengths of 0s and 1s in turn,
    column by column, starting with 0s. pycocotools' frPyObjects reads it for iscrowd=0 objects
    (as torchvision's reference loader uses it), which compressed (string) counts are not."""
    flat = np.asarray(mask, dtype=bool).ravel(order="F")
    starts = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    counts = np.diff(np.concatenate([[0], starts, [flat.size]])).tolist()
    if flat.size and flat[0]:
        counts.insert(0, 0)  # the first run counts 0s
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": [int(c) for c in counts]}


def _box_mask(box: np.ndarray, height: int, width: int) -> np.ndarray:
    """Filled-box mask for annotations that carry no segmentation."""
    mask = np.zeros((height, width), dtype=np.uint8)
    x1, y1, x2, y2 = (int(round(v)) for v in box)
    mask[y1:y2, x1:x2] = 1
    return mask


class _PackedRecords:
    """Per-image records pickled into one byte array.

    Why: a Python list of dicts is copied page by page into every forked DataLoader worker as
    refcounts and the cyclic GC touch it; one numpy buffer stays shared.
    """

    def __init__(self, records: list[dict]) -> None:
        blobs = [pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in records]
        self._offsets = np.cumsum([0] + [len(b) for b in blobs], dtype=np.int64)
        self._data = np.frombuffer(b"".join(blobs), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> dict:
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        return pickle.loads(self._data[start:end].tobytes())


class CocoDetection(torch.utils.data.Dataset):
    """Images and instance targets of one COCO split, labels remapped to 1..K.

    Items are ``(image CHW, target)``, the image uint8 as read (float in [0, 1] after a
    ``ToFloat`` transform), with target keys ``boxes`` (float32 xyxy),
    ``labels`` (int64), ``masks`` (uint8 NxHxW), ``image_id`` (int), ``area``, ``iscrowd``.
    An index may be an int or ``(index, epoch)``; random augmentation is drawn from
    ``(seed, epoch, index)`` so it does not depend on workers, processes or resuming.
    """

    def __init__(
        self,
        image_dir: str | Path,
        ann_file: str | Path,
        train: bool,
        transforms: Transform | None = None,
        skip_missing_images: bool = False,
        seed: int = 0,
        image_key: str = "image folder",
        ann_key: str = "annotation file",
    ) -> None:
        self.image_dir = Path(image_dir)
        self.ann_file = Path(ann_file)
        self.train = train
        self.transforms = transforms
        self.seed = seed
        if not self.image_dir.is_dir():
            raise MissingPathError(f"{image_key}: folder '{self.image_dir}' does not exist")
        data = load_coco_json(self.ann_file, ann_key)

        cats = sorted(data["categories"], key=lambda c: c["id"])
        self.cat_ids: list[int] = [int(c["id"]) for c in cats]
        self.class_names: list[str] = ["__background__"] + [
            str(c.get("name", c["id"])) for c in cats
        ]
        self._cat_to_label = {cid: i + 1 for i, cid in enumerate(self.cat_ids)}
        self.num_classes = len(self.cat_ids) + 1

        self.stats: dict[str, int] = {
            "images_in_file": len(data["images"]),
            "images": 0,
            "dropped_without_annotations": 0,
            "skipped_missing_images": 0,
            "annotations_used": 0,
            "crowd_annotations": 0,
            "degenerate_boxes": 0,
        }
        records = self._build_records(data, skip_missing_images)
        self.stats["images"] = len(records)
        self._records = _PackedRecords(records)
        self.image_sizes: list[tuple[int, int]] = [(r["width"], r["height"]) for r in records]
        self.image_ids: list[int] = [r["image_id"] for r in records]
        # Training never needs the index again; dropping it keeps workers small (train2017 ~1 GB).
        self._coco: COCO | None = None if train else coco_from_dict(data)

    def _build_records(self, data: dict, skip_missing: bool) -> list[dict]:
        anns_by_image: dict[int, list[dict]] = {}
        for ann in data["annotations"]:
            if ann["category_id"] not in self._cat_to_label:
                raise UsageError(
                    f"{self.ann_file}: annotation {ann['id']} has category_id "
                    f"{ann['category_id']}, which is not among the file's categories "
                    f"{self.cat_ids}"
                )
            anns_by_image.setdefault(ann["image_id"], []).append(ann)

        records = []
        missing = []
        for img in sorted(data["images"], key=lambda im: im["id"]):
            path = self.image_dir / img["file_name"]
            if not path.is_file():
                missing.append(path)
                continue
            if skip_missing and not _readable(path):
                missing.append(path)
                continue
            rec = self._image_record(img, anns_by_image.get(img["id"], []))
            if self.train and len(rec["labels"]) == 0:
                self.stats["dropped_without_annotations"] += 1
                continue
            self.stats["annotations_used"] += len(rec["labels"])
            records.append(rec)
        if missing and not skip_missing:
            raise MissingPathError(
                f"image '{missing[0]}' does not exist ({len(missing)} of "
                f"{len(data['images'])} images in '{self.ann_file}' are missing); "
                "set data.skip_missing_images=true to skip them"
            )
        self.stats["skipped_missing_images"] = len(missing)
        return records

    def _image_record(self, img: dict, anns: list[dict]) -> dict:
        width, height = int(img["width"]), int(img["height"])
        boxes, labels, areas, segs = [], [], [], []
        for ann in anns:
            if ann.get("iscrowd", 0):
                self.stats["crowd_annotations"] += 1
                continue
            x, y, w, h = (float(v) for v in ann["bbox"])
            box = [
                min(max(x, 0.0), width),
                min(max(y, 0.0), height),
                min(max(x + w, 0.0), width),
                min(max(y + h, 0.0), height),
            ]
            if not (box[2] > box[0] and box[3] > box[1]):
                self.stats["degenerate_boxes"] += 1
                continue
            boxes.append(box)
            labels.append(self._cat_to_label[ann["category_id"]])
            areas.append(float(ann.get("area", w * h)))
            segs.append(ann.get("segmentation"))
        return {
            "image_id": int(img["id"]),
            "file_name": str(img["file_name"]),
            "width": width,
            "height": height,
            "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
            "labels": np.asarray(labels, dtype=np.int64),
            "area": np.asarray(areas, dtype=np.float32),
            "segs": segs,
        }

    @property
    def coco(self) -> COCO:
        """pycocotools index of the annotation file (loaded again on demand for training sets)."""
        if self._coco is None:
            self._coco = coco_from_dict(load_coco_json(self.ann_file))
        return self._coco

    def __getstate__(self) -> dict:
        # spawned workers only need the packed records, not the pycocotools index
        state = self.__dict__.copy()
        state["_coco"] = None
        return state

    def label_to_cat_id(self, label: int) -> int:
        """COCO category id of a contiguous label (1..K)."""
        if not 1 <= int(label) <= len(self.cat_ids):
            raise ValueError(f"label {label} is out of range 1..{len(self.cat_ids)}")
        return self.cat_ids[int(label) - 1]

    def cat_id_to_label(self, cat_id: int) -> int:
        """Contiguous label (1..K) of a COCO category id."""
        if cat_id not in self._cat_to_label:
            raise ValueError(f"category id {cat_id} is not one of {self.cat_ids}")
        return self._cat_to_label[cat_id]

    def __len__(self) -> int:
        return len(self._records)

    def load_image(self, rec: dict) -> torch.Tensor:
        """Read one image as uint8 RGB CHW, with errors that name the file."""
        path = self.image_dir / rec["file_name"]
        try:
            with Image.open(path) as pil:
                image = pil_to_tensor(pil.convert("RGB"))
        except FileNotFoundError as err:
            raise MissingPathError(
                f"image '{path}' does not exist; set data.skip_missing_images=true to skip it"
            ) from err
        except (UnidentifiedImageError, OSError) as err:
            raise UsageError(f"image '{path}' cannot be read: {err}") from err
        if image.shape[1:] != (rec["height"], rec["width"]):
            raise UsageError(
                f"image '{path}' is {image.shape[2]}x{image.shape[1]} but '{self.ann_file}' "
                f"says {rec['width']}x{rec['height']}"
            )
        return image

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, dict]:
        index, epoch = key if isinstance(key, tuple) else (int(key), 0)
        rec = self._records[index]
        image = self.load_image(rec)
        h, w = rec["height"], rec["width"]
        try:
            masks = [
                _box_mask(box, h, w) if not seg else segmentation_to_mask(seg, h, w)
                for box, seg in zip(rec["boxes"], rec["segs"], strict=True)
            ]
        except (ValueError, OverflowError) as err:  # pycocotools: e.g. invalid RLE counts
            raise UsageError(
                f"{self.ann_file}: a segmentation of image {rec['image_id']} cannot be "
                f"decoded: {err}"
            ) from err
        target = {
            "boxes": torch.from_numpy(rec["boxes"]),
            "labels": torch.from_numpy(rec["labels"]),
            "masks": torch.from_numpy(np.stack(masks))
            if masks
            else torch.zeros((0, h, w), dtype=torch.uint8),
            "image_id": rec["image_id"],
            "area": torch.from_numpy(rec["area"]),
            "iscrowd": torch.zeros(len(rec["labels"]), dtype=torch.int64),
        }
        if self.transforms is not None:
            rng = random.Random(f"{self.seed}/{epoch}/{index}")
            image, target = self.transforms(image, target, rng)
        return image, target


def _readable(path: Path) -> bool:
    """Whether PIL recognises the file as an image (header only, cheap)."""
    try:
        with Image.open(path) as pil:
            pil.verify()
        return os.path.getsize(path) > 0
    except (UnidentifiedImageError, OSError, SyntaxError):
        return False

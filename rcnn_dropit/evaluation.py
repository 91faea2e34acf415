"""COCO box/mask evaluation of torchvision detection outputs, gathered over ranks."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from pycocotools import mask as mask_util
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from rcnn_dropit import distributed

log = logging.getLogger(__name__)
IOU_TYPES = ("bbox", "segm")
METRIC_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def _boxes_xywh(boxes: torch.Tensor) -> list[list[float]]:
    xywh = boxes.detach().to("cpu", torch.float64).clone()
    xywh[:, 2:] -= xywh[:, :2]
    return xywh.tolist()


def _encode_masks(masks: torch.Tensor) -> list[dict[str, Any]]:
    """RLE of (N,1,H,W) mask probabilities thresholded at 0.5 (bool masks: already binary)."""
    if masks.ndim != 4 or masks.shape[1] != 1:
        raise ValueError(f"masks must have shape (N, 1, H, W), got {tuple(masks.shape)}")
    binary = masks.detach()[:, 0]
    if binary.dtype != torch.bool:
        binary = binary > 0.5
    binary = binary.to("cpu", torch.uint8).numpy()
    # pycocotools wants H x W x N in Fortran order.
    rles = mask_util.encode(np.asfortranarray(binary.transpose(1, 2, 0)))
    for rle in rles:
        rle["counts"] = rle["counts"].decode("ascii")  # JSON needs str, not bytes
    return rles


def coco_results(
    output: dict[str, torch.Tensor],
    image_id: int,
    iou_types: Sequence[str] = IOU_TYPES,
    label_to_cat_id: Callable[[int], int] = int,
) -> dict[str, list[dict[str, Any]]]:
    """COCO results entries of one image's detections, per iou type (segm as RLE at 0.5)."""
    scores = output["scores"].detach().cpu().tolist()
    cat_ids = [label_to_cat_id(int(x)) for x in output["labels"].tolist()]
    results: dict[str, list[dict[str, Any]]] = {}
    if "bbox" in iou_types:
        results["bbox"] = [
            {"image_id": int(image_id), "category_id": c, "bbox": b, "score": s}
            for b, c, s in zip(_boxes_xywh(output["boxes"]), cat_ids, scores, strict=True)
        ]
    if "segm" in iou_types:
        if "masks" not in output:
            raise ValueError("iou type 'segm' needs 'masks' in the outputs (Mask R-CNN)")
        rles = _encode_masks(output["masks"]) if scores else []
        results["segm"] = [
            {"image_id": int(image_id), "category_id": c, "segmentation": r, "score": s}
            for r, c, s in zip(rles, cat_ids, scores, strict=True)
        ]
    return results


def _run_cocoeval(
    coco_gt: COCO, results: list[dict[str, Any]], iou_type: str, image_ids: list[int]
) -> dict[str, float]:
    if not results:
        # COCO.loadRes indexes results[0], so an empty list cannot go through COCOeval.
        log.info(f"COCO {iou_type}: no detections, all metrics are 0")
        return dict.fromkeys(METRIC_NAMES, 0.0)
    # loadRes adds keys to the dicts it gets; keep ours clean for the caller.
    coco_dt = coco_gt.loadRes([dict(r) for r in results])
    coco_eval = COCOeval(coco_gt, coco_dt, iou_type)
    coco_eval.params.imgIds = image_ids
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return {name: float(v) for name, v in zip(METRIC_NAMES, coco_eval.stats[:6], strict=True)}


class COCOEvaluator:
    """Collects detections per rank, then scores them with COCOeval on rank 0."""

    def __init__(
        self,
        coco_gt: COCO,
        iou_types: Sequence[str] = IOU_TYPES,
        label_to_cat_id: Callable[[int], int] | None = None,
    ) -> None:
        bad = [t for t in iou_types if t not in IOU_TYPES]
        if bad or not iou_types:
            raise ValueError(f"iou_types {list(iou_types)!r}: allowed are {', '.join(IOU_TYPES)}")
        self.coco_gt = coco_gt
        self.iou_types = tuple(dict.fromkeys(iou_types))
        # None: the model's labels already are COCO category ids.
        self.label_to_cat_id = label_to_cat_id if label_to_cat_id is not None else int
        self.image_ids: list[int] = []
        self.results: dict[str, list[dict[str, Any]]] = {t: [] for t in self.iou_types}

    def update(self, outputs: Sequence[dict[str, torch.Tensor]], image_ids: Sequence[int]) -> None:
        """Add the detections of a batch; image_ids[i] is the COCO id of outputs[i]."""
        if len(outputs) != len(image_ids):
            raise ValueError(f"{len(outputs)} outputs but {len(image_ids)} image ids")
        for output, raw_id in zip(outputs, image_ids, strict=True):
            image_id = int(raw_id)
            self.image_ids.append(image_id)
            for iou_type, entries in coco_results(
                output, image_id, self.iou_types, self.label_to_cat_id
            ).items():
                self.results[iou_type].extend(entries)

    def _evaluate_main(self, shards: list[dict[str, Any]]) -> tuple[dict, dict[str, list]]:
        image_ids = [i for shard in shards for i in shard["image_ids"]]
        unique = sorted(set(image_ids))
        if len(unique) != len(image_ids):
            dup = sorted(i for i, n in Counter(image_ids).items() if n > 1)
            raise RuntimeError(
                f"{len(image_ids) - len(unique)} evaluations repeat images (e.g. ids {dup[:5]}): "
                "the validation sampler must give every image to exactly one rank"
            )
        unknown = sorted(set(unique) - set(self.coco_gt.getImgIds()))
        if unknown:
            raise ValueError(f"image ids {unknown[:5]} are not in the ground-truth annotations")
        metrics: dict[str, Any] = {}
        gathered: dict[str, list] = {}
        for iou_type in self.iou_types:
            results = [r for shard in shards for r in shard["results"][iou_type]]
            gathered[iou_type] = results
            if unique:
                metrics[iou_type] = _run_cocoeval(self.coco_gt, results, iou_type, unique)
            else:
                metrics[iou_type] = dict.fromkeys(METRIC_NAMES, 0.0)
        metrics["num_images"] = len(unique)
        return metrics, gathered

    def evaluate_with_results(self) -> tuple[dict[str, Any], dict[str, list] | None]:
        """Gather all ranks' detections and score them on rank 0: (metrics on every rank,
        every rank's detections per iou type in COCO results format on rank 0, else None)."""
        shard = {"image_ids": self.image_ids, "results": self.results}
        shards = distributed.gather_object(shard, dst=0)
        outcome: dict[str, Any] = {}

        def score() -> dict[str, Any]:
            outcome["metrics"], outcome["results"] = self._evaluate_main(shards)
            return outcome["metrics"]

        # A failure on rank 0 reaches the other ranks as the same error, so none waits forever.
        metrics = distributed.run_on_main(score)
        return metrics, outcome.get("results")


def format_metrics_table(metrics: dict[str, Any]) -> str:
    """Markdown table of AP x100 (one decimal) per IoU type present in metrics."""
    lines = [
        "| type | " + " | ".join(METRIC_NAMES) + " |",
        "|---" * (len(METRIC_NAMES) + 1) + "|",
    ]
    for iou_type in IOU_TYPES:
        if iou_type not in metrics:
            continue
        # COCOeval reports -1 where no ground truth exists in an area range.
        cells = [
            f"{100 * v:.1f}" if v >= 0 else "-"
            for v in (metrics[iou_type][name] for name in METRIC_NAMES)
        ]
        lines.append(f"| {iou_type} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["COCOEvaluator", "coco_results", "format_metrics_table", "IOU_TYPES", "METRIC_NAMES"]

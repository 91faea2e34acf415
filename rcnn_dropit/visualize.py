"""Pictures of detections: boxes, masks, class names and scores over an image, and panels of them.

All box and mask drawing is torchvision's (draw_bounding_boxes, draw_segmentation_masks);
this module only chooses what to draw, in which colour, and lays pictures out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torchvision.ops import box_area
from torchvision.transforms.v2.functional import resize
from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

# 20 distinct colours (Sasha Trubetskoy's list): label k gets PALETTE[(k - 1) % 20], so a class
# has the same colour in the prediction and in the ground truth.
PALETTE: tuple[tuple[int, int, int], ...] = (
    (230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
    (145, 30, 180), (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212),
    (0, 128, 128), (220, 190, 255), (170, 110, 40), (255, 250, 200), (128, 0, 0),
    (170, 255, 195), (128, 128, 0), (255, 215, 180), (0, 0, 128), (128, 128, 128),
)  # fmt: skip
MASK_ALPHA = 0.5
BOX_WIDTH = 2
GAP = 4  # pixels between panels of a grid
BACKGROUND = 255  # grid background and caption strips: white
CAPTION_HEIGHT = 16
# A shown detection hides any other that covers it, or that it covers, by more than this fraction
# of the smaller box's area, whatever the classes.
DISPLAY_OVERLAP = 0.5


def class_color(label: int) -> tuple[int, int, int]:
    """The colour of a contiguous class label (1..K)."""
    return PALETTE[(int(label) - 1) % len(PALETTE)]


def class_name(class_names: Sequence[str], label: int) -> str:
    """Name of a label, or 'class N' when the names do not cover it."""
    label = int(label)
    return class_names[label] if 0 < label < len(class_names) else f"class {label}"


def draw_instances(
    image: torch.Tensor,
    boxes: torch.Tensor,
    labels: Sequence[int],
    captions: Sequence[str],
    masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 CHW image with boolean NxHxW masks blended in, then boxes and captions drawn over."""
    out = image
    if masks is not None:
        # one call per mask: given several, torchvision paints their overlap black
        for mask, label in zip(masks, labels, strict=True):
            if mask.any():
                out = draw_segmentation_masks(
                    out, mask, alpha=MASK_ALPHA, colors=class_color(label)
                )
    if len(boxes):
        out = draw_bounding_boxes(
            out,
            boxes,
            labels=list(captions),
            colors=[class_color(label) for label in labels],
            width=BOX_WIDTH,
            fill_labels=True,
        )
    return out


def _scaled(
    image: torch.Tensor, boxes: torch.Tensor, masks: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Image, boxes and float NxHxW masks resized by scale (masks bilinear, thresholded later)."""
    if scale == 1.0:
        return image, boxes, masks
    if scale <= 0:
        raise ValueError(f"scale: {scale} must be > 0")
    size = [max(1, round(image.shape[1] * scale)), max(1, round(image.shape[2] * scale))]
    image = resize(image, size, antialias=True)
    if masks is not None and len(masks):
        masks = F.interpolate(masks[:, None].float(), size=size, mode="bilinear")[:, 0]
    elif masks is not None:
        masks = masks.new_zeros((0, *size), dtype=torch.float32)
    return image, boxes * scale, masks


def shown_detections(
    prediction: dict[str, torch.Tensor], score_thresh: float = 0.5, overlap: float = DISPLAY_OVERLAP
) -> torch.Tensor:
    """Indices (best first) of the detections a picture shows: those scoring at least
    score_thresh, less any whose intersection with a better-scoring shown one exceeds
    ``overlap`` of the smaller box's area, whatever the classes (1 keeps them all).

    The detector suppresses duplicates per class and by IoU only, so one object often comes out
    as a stack of boxes of several classes, or as a box with smaller boxes on its parts (a low
    IoU, but one inside the other). A picture shows the best of them; COCO results (and AP) keep
    every detection.
    """
    scores = prediction["scores"]
    candidates = torch.nonzero(scores >= score_thresh).flatten()
    if overlap >= 1.0 or len(candidates) < 2:
        return candidates
    candidates = candidates[scores[candidates].argsort(descending=True, stable=True)]
    boxes = prediction["boxes"][candidates].float()
    lo = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    hi = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    inter = (hi - lo).clamp(min=0).prod(dim=2)
    area = box_area(boxes)
    cover = inter / torch.minimum(area[:, None], area[None, :]).clamp(min=1e-6)
    kept: list[int] = []
    for i in range(len(candidates)):  # greedy, best first: at most a few hundred detections
        if all(cover[i, j] <= overlap for j in kept):
            kept.append(i)
    return candidates[torch.tensor(kept)].sort().values  # in the detector's order: best first


def draw_prediction(
    image: torch.Tensor,
    prediction: dict[str, torch.Tensor],
    class_names: Sequence[str],
    score_thresh: float = 0.5,
    mask_thresh: float = 0.5,
    scale: float = 1.0,
    overlap: float = DISPLAY_OVERLAP,
) -> torch.Tensor:
    """A torchvision detector's output for one image drawn over it (uint8 CHW, scaled).

    The detections of :func:`shown_detections` are drawn; a mask pixel is the object where its
    probability exceeds mask_thresh, as in the COCO evaluation.
    """
    keep = shown_detections(prediction, score_thresh, overlap)
    boxes = prediction["boxes"][keep].float()
    labels = prediction["labels"][keep].tolist()
    scores = prediction["scores"][keep].tolist()
    masks = prediction["masks"][keep][:, 0] if "masks" in prediction else None
    image, boxes, masks = _scaled(image, boxes, masks, scale)
    captions = [
        f"{class_name(class_names, c)} {s:.2f}" for c, s in zip(labels, scores, strict=True)
    ]
    binary = masks > mask_thresh if masks is not None else None
    return draw_instances(image, boxes, labels, captions, binary)


def draw_ground_truth(
    image: torch.Tensor,
    target: dict[str, torch.Tensor],
    class_names: Sequence[str],
    scale: float = 1.0,
) -> torch.Tensor:
    """A dataset target (boxes, labels, optional masks) drawn over its image (uint8 CHW)."""
    boxes = target["boxes"].float()
    labels = target["labels"].tolist()
    masks = target["masks"].float() if "masks" in target else None
    image, boxes, masks = _scaled(image, boxes, masks, scale)
    captions = [class_name(class_names, c) for c in labels]
    binary = masks > 0.5 if masks is not None else None
    return draw_instances(image, boxes, labels, captions, binary)


def caption(width: int, text: str) -> torch.Tensor:
    """A white strip of the given width with a line of black text (uint8 CHW)."""
    strip = Image.new("RGB", (width, CAPTION_HEIGHT), (BACKGROUND,) * 3)
    ImageDraw.Draw(strip).text((4, 2), text, fill=(0, 0, 0))
    return torch.from_numpy(np.array(strip)).permute(2, 0, 1)


def grid(rows: Sequence[Sequence[torch.Tensor]], gap: int = GAP) -> torch.Tensor:
    """Pictures (uint8 CHW, any sizes) laid out in rows, top-left aligned in equal cells."""
    if not rows or not all(rows):
        raise ValueError("grid: needs at least one picture in every row")
    columns = max(len(row) for row in rows)
    cell_w = [max(row[j].shape[2] for row in rows if j < len(row)) for j in range(columns)]
    cell_h = [max(p.shape[1] for p in row) for row in rows]
    height = sum(cell_h) + gap * (len(rows) + 1)
    width = sum(cell_w) + gap * (columns + 1)
    out = torch.full((3, height, width), BACKGROUND, dtype=torch.uint8)
    y = gap
    for row, h in zip(rows, cell_h, strict=True):
        x = gap
        for picture, w in zip(row, cell_w, strict=False):
            out[:, y : y + picture.shape[1], x : x + picture.shape[2]] = picture
            x += w + gap
        y += h + gap
    return out


def prediction_vs_truth(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    left: str = "prediction",
    right: str = "ground truth",
) -> torch.Tensor:
    """One row per image, its prediction picture left of its ground-truth picture, with captions."""
    if not pairs:
        raise ValueError("prediction_vs_truth: no images to show")
    width = max(max(a.shape[2], b.shape[2]) for a, b in pairs)
    header = [caption(width, left), caption(width, right)]
    return grid([header, *[list(pair) for pair in pairs]])


def fit_scale(height: int, width: int, size: int) -> float:
    """Scale that makes the longer side of an image `size` pixels."""
    return size / max(height, width, 1)


def save_png(image: torch.Tensor, path: str | Path) -> Path:
    """Write a uint8 CHW picture as PNG (parent folders made as needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image.permute(1, 2, 0).contiguous().numpy()).save(path, format="PNG")
    return path


__all__ = [
    "DISPLAY_OVERLAP",
    "PALETTE",
    "class_color",
    "class_name",
    "draw_ground_truth",
    "draw_instances",
    "draw_prediction",
    "fit_scale",
    "grid",
    "prediction_vs_truth",
    "save_png",
    "shown_detections",
]

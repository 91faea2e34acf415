"""Inference over the validation loader, feeding the COCO evaluator."""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from rcnn_dropit.data import images_to_device
from rcnn_dropit.distributed import broadcast_buffers
from rcnn_dropit.evaluation import COCOEvaluator


def iou_types_for(arch: str) -> tuple[str, ...]:
    """COCO iou types a model architecture produces."""
    return ("bbox", "segm") if arch == "maskrcnn" else ("bbox",)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") else model


def outputs_to_host(outputs: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Detections on the CPU, masks thresholded (> 0.5, as COCO evaluation does) before the
    copy: a bool mask is a quarter of the float probabilities' bytes."""
    return [
        {k: (v > 0.5 if k == "masks" else v).to("cpu") for k, v in out.items()} for out in outputs
    ]


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    val_loader,
    device: torch.device,
    iou_types: tuple[str, ...],
    progress: bool = False,
) -> tuple[dict, dict[str, list] | None]:
    """Run the model over every validation image once: (COCO metrics on every rank, the
    detections in COCO results format per iou type on rank 0, None elsewhere).

    ``progress``: show a progress bar (pass ``DistInfo.is_main``: rank 0 owns the console).
    """
    dataset = val_loader.dataset
    evaluator = COCOEvaluator(
        dataset.coco, iou_types=iou_types, label_to_cat_id=dataset.label_to_cat_id
    )
    # Evaluate the plain module: DDP adds nothing at inference and would sync buffers per call.
    net = unwrap(model)
    broadcast_buffers(net)  # every rank evaluates exactly the weights rank 0 checkpoints
    was_training = net.training
    net.eval()
    try:
        bar = tqdm(
            val_loader,
            desc="eval",
            disable=not progress,
            dynamic_ncols=True,
            leave=False,
        )
        for images, targets in bar:
            images = images_to_device(images, device)
            outputs = net(images)
            outputs = outputs_to_host(outputs)
            evaluator.update(outputs, [int(t["image_id"]) for t in targets])
        return evaluator.evaluate_with_results()
    finally:
        net.train(was_training)

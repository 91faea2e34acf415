"""Build torchvision Faster/Mask R-CNN from a Config, then apply DropIT when enabled."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNConvFCHead, FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.rpn import RPNHead

from dropit_core import (
    DropITRecord,
    checkpoint_modules,
    compress_saved,
    dropit_record,
    to_dropit,
)
from dropit_core.detection import lean_forward
from rcnn_dropit.config import Config
from rcnn_dropit.config_schema import PAPER_EXCLUDE, ModelConfig
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models.backbone import HEAD_NORMS, build_backbone
from rcnn_dropit.models.buckets import use_size_buckets
from rcnn_dropit.models.heads import MLPHead
from rcnn_dropit.models.sampling import count_roi_samples
from rcnn_dropit.models.weights import load_state_dict_file, load_strict

_ROI_SIZE = 7  # output size of torchvision's default box MultiScaleRoIAlign
_ASPECT_RATIOS = (0.5, 1.0, 2.0)  # of every level's anchors, as torchvision's default


def build_model(cfg: Config, sync_bn: bool = False) -> tuple[nn.Module, DropITRecord]:
    """The detector of `cfg.model`, initialised per config; DropIT applied if `cfg.dropit.enabled`.

    ``sync_bn``: its BatchNorms become SyncBatchNorm first, so that DropIT converts the
    synchronised norms (converting after DropIT would put plain SyncBatchNorms in place of the
    DropIT norms). Returns (model, record): record is dropit_core's record of converted layers
    (empty without DropIT). The model is on CPU and not wrapped in DDP.
    """
    m = cfg.model
    if m.arch not in ("maskrcnn", "fasterrcnn"):  # before any weights are built or downloaded
        raise UsageError(f"model.arch: '{m.arch}' is not one of maskrcnn, fasterrcnn")
    backbone = build_backbone(
        m.backbone,
        norm=m.norm,
        trainable_layers=m.trainable_layers,
        # a full-model init overwrites the backbone, so downloading ImageNet weights is wasted
        pretrained=m.pretrained_backbone and m.weights is None,
        weights_path=m.backbone_weights if m.weights is None else None,
        fpn_channels=m.fpn_channels,
        frozen_bn=m.frozen_bn,
        fpn=m.fpn,
        fpn_norm=m.head_norm if m.heads == "v2" else None,
    )
    heads = _heads(m, backbone.out_channels)
    detector = MaskRCNN if m.arch == "maskrcnn" else FasterRCNN
    model = detector(
        backbone,
        min_size=m.min_size,
        max_size=m.max_size,
        **heads,
        box_detections_per_img=m.box_detections_per_img,
        box_batch_size_per_image=m.box_batch_size_per_image,
        rpn_batch_size_per_image=m.rpn_batch_size_per_image,
        rpn_pre_nms_top_n_train=m.rpn_pre_nms_top_n_train,
        rpn_post_nms_top_n_train=m.rpn_post_nms_top_n_train,
        rpn_pre_nms_top_n_test=m.rpn_pre_nms_top_n_test,
        rpn_post_nms_top_n_test=m.rpn_post_nms_top_n_test,
        rpn_anchor_generator=AnchorGenerator(
            tuple((size,) for size in m.anchor_sizes), (_ASPECT_RATIOS,) * len(m.anchor_sizes)
        ),
        box_score_thresh=cfg.test.score_thresh,
    )
    count_roi_samples(model)  # num_fg_samples / num_bg_samples in metrics.jsonl
    if m.forward == "lean":  # the backbone's FPN is made lean (or not) by model.fpn
        lean_forward(model, fpn=False)
    if m.size_buckets:
        use_size_buckets(model, m.size_buckets)
    if m.weights is not None:
        state = load_state_dict_file(m.weights, "model.weights")
        load_strict(model, state, "model.weights", m.weights)
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    apply_checkpointing(model, cfg)
    return apply_dropit(model, cfg)


def _heads(m: ModelConfig, channels: int) -> dict[str, nn.Module]:
    """The RPN, box and mask heads of ``model.heads`` (built here because torchvision fixes
    their widths: 1024 and 256), with ``m``'s widths.

    Built in one fixed order (box head, box predictor, then a Mask R-CNN's mask head and
    predictor, nothing more) because each draws its initial weights from the global generator:
    a seed gives the weights it gave the runs committed under docs/results.
    """
    width = m.mask_head_channels
    norm = HEAD_NORMS[m.head_norm] if m.heads == "v2" else None
    heads: dict[str, nn.Module] = {}
    if norm is not None:  # torchvision's *_resnet50_fpn_v2, its norm from model.head_norm
        heads["rpn_head"] = RPNHead(channels, len(_ASPECT_RATIOS), conv_depth=2)
        heads["box_head"] = FastRCNNConvFCHead(
            (channels, _ROI_SIZE, _ROI_SIZE), [channels] * 4, [m.box_head_width], norm
        )
    else:
        heads["box_head"] = MLPHead(channels * _ROI_SIZE**2, m.box_head_width)
    heads["box_predictor"] = FastRCNNPredictor(m.box_head_width, m.num_classes)
    if m.arch == "maskrcnn":
        convs = [width] * m.mask_head_convs
        heads["mask_head"] = MaskRCNNHeads(channels, convs, dilation=1, norm_layer=norm)
        heads["mask_predictor"] = MaskRCNNPredictor(width, width, m.num_classes)
    return heads


def trainable_batch_norm(m: ModelConfig) -> bool:
    """Whether the model of ``m`` has BatchNorms that train (what SyncBatchNorm synchronises)."""
    return m.norm == "bn" or (m.heads == "v2" and m.head_norm == "bn")


def apply_checkpointing(model: nn.Module, cfg: Config) -> list[str]:
    """Recompute the modules of `cfg.model.activation_checkpointing` in backward (in place)."""
    patterns = cfg.model.activation_checkpointing
    if not patterns:
        return []
    try:
        return checkpoint_modules(model, patterns)
    except ValueError as err:  # a pattern that matches no module of this model
        raise UsageError(f"model.activation_checkpointing: {err}") from err


def paper_exclude(model: nn.Module) -> list[str]:
    """The DropIT paper's exclusions (config_schema.PAPER_EXCLUDE) that name modules of ``model``:
    the stem conv, the box predictor and, on a Mask R-CNN, the mask logits.

    For ``to_dropit(model, exclude=paper_exclude(model))`` on either detector: to_dropit rejects
    a pattern that matches nothing, and a Faster R-CNN has no mask branch.
    """
    paths = [name for name, _ in model.named_modules() if name]
    return [pattern for pattern in PAPER_EXCLUDE if fnmatch.filter(paths, pattern)]


def fitting_exclude(model: nn.Module, exclude: Sequence[str]) -> tuple[str, ...]:
    """``exclude`` without the paper's exclusions that ``model`` lacks (the shared default names
    the mask logits, which a Faster R-CNN does not have); other patterns stay as given."""
    lacking = set(PAPER_EXCLUDE) - set(paper_exclude(model))
    return tuple(p for p in exclude if p not in lacking)


def apply_dropit(model: nn.Module, cfg: Config) -> tuple[nn.Module, DropITRecord]:
    """Convert layers to DropIT per `cfg.dropit` (in place); an empty record when disabled.
    With `dropit.saved_bits`, every training forward also compresses what it saves otherwise."""
    d = cfg.dropit
    if d.saved_bits:
        compress_saved(model, bits=d.saved_bits)
    if not d.enabled:
        return model, DropITRecord()

    exclude = fitting_exclude(model, d.exclude)
    try:
        to_dropit(
            model,
            strategy=d.strategy,
            gamma=d.gamma,
            include=tuple(d.include),
            exclude=exclude,
            rules=d.rules or None,
            norm=d.norm,
            pool=d.pool,
            **d.options,
        )
    except ValueError as err:  # dropit_core's: a pattern, strategy or option of cfg.dropit
        raise UsageError(str(err)) from err
    return model, dropit_record(model)

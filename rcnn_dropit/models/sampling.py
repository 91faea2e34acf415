"""How many RoIs the box head's sampler picks per image, positive and negative: the figure that
sets the RoI heads' memory (the mask head keeps ~1.7 MB per positive RoI in fp32 at 800 px), and
that detectron2 logs as ``roi_head/num_fg_samples`` and ``num_bg_samples``. An untrained
detector's heads see only the ground-truth boxes as positives; a trained one's sampler fills up
to a quarter of ``box_batch_size_per_image`` with them.

A step measured before training (the memory budget's probe, the benches) can give its heads a
trained detector's positives: :func:`propose_around` puts jitter in the targets, and
:func:`join_proposals_around`, a forward hook on the RPN, joins the boxes it makes around each
object to the RPN's proposals, as a trained RPN proposes them (and where torchvision joins the
ground truth).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

# torchvision's RoIHeads sampler: at most this share of a batch's RoIs is positive
POSITIVE_FRACTION = 0.25
# A trained RPN's proposal around an object: centre and size jittered by this fraction (one
# standard deviation); most keep an IoU above 0.5 with their object, the sampler's positives.
JITTER = 0.08


class RoISampleCounter:
    """torchvision's ``BalancedPositiveNegativeSampler`` of ``roi_heads``, counting what it
    picks. The counts add up on the sampler's device, so a training step makes no host sync;
    :meth:`take` reads them (once per log record)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.sums: Tensor | None = None  # positives, negatives, images since the last take()

    def __getattr__(self, name: str):
        # what the wrapped sampler says of itself (batch_size_per_image, positive_fraction);
        # before __init__ (a copy being made) there is no sampler: no such attribute
        sampler = self.__dict__.get("sampler")
        if sampler is None:
            raise AttributeError(name)
        return getattr(sampler, name)

    def __call__(self, matched_idxs: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        pos, neg = self.sampler(matched_idxs)
        if pos:
            pairs = zip(pos, neg, strict=True)
            counts = torch.stack([torch.stack([p.sum(), n.sum()]) for p, n in pairs])
            step = torch.cat([counts.sum(0), counts.new_tensor([len(pos)])])
            self.sums = step if self.sums is None else self.sums + step
        return pos, neg

    def take(self) -> tuple[int, int, int]:
        """(positives, negatives, images) since the last call, then zero."""
        sums, self.sums = self.sums, None
        if sums is None:
            return 0, 0, 0
        positives, negatives, images = sums.tolist()
        return int(positives), int(negatives), int(images)


def count_roi_samples(model: nn.Module) -> RoISampleCounter:
    """Count the RoIs ``model``'s box sampler picks (a torchvision R-CNN; in place)."""
    roi_heads = model.roi_heads
    if not isinstance(roi_heads.fg_bg_sampler, RoISampleCounter):
        roi_heads.fg_bg_sampler = RoISampleCounter(roi_heads.fg_bg_sampler)
    return roi_heads.fg_bg_sampler


def roi_sample_counter(model: nn.Module) -> RoISampleCounter | None:
    """The counter of ``model`` (or of the model inside DDP), if one counts."""
    model = getattr(model, "module", model)
    roi_heads = getattr(model, "roi_heads", None)
    sampler = getattr(roi_heads, "fg_bg_sampler", None)
    return sampler if isinstance(sampler, RoISampleCounter) else None


def sampler_cap(rois_per_image: int) -> int:
    """The most positives torchvision's box sampler keeps of an image's ``rois_per_image``."""
    return int(rois_per_image * POSITIVE_FRACTION)


def propose_around(
    targets: list[dict], per_object: int, generator: torch.Generator | None = None
) -> list[dict]:
    """``targets`` (copies) with ``rpn_jitter``: ``per_object`` proposals around each object for
    :func:`join_proposals_around` (none for an image without objects)."""
    out = []
    for target in targets:
        boxes = target["boxes"]
        shape = (len(boxes), per_object, 4)
        jitter = torch.randn(shape, generator=generator) * JITTER
        out.append({**target, "rpn_jitter": jitter.to(boxes.device)})
    return out


def per_object_for(targets: list[dict], positives: int) -> int:
    """Proposals around each object that give every image of ``targets`` at least about
    ``positives`` positive RoIs (a quarter more than needed: a few jittered boxes fall below the
    sampler's IoU of 0.5)."""
    fewest = min((len(t["boxes"]) for t in targets), default=0)
    return math.ceil(1.25 * positives / fewest) if fewest else 0


def join_proposals_around(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
    """A forward hook on a torchvision RPN: in training, joins to each image's proposals the
    boxes its target's ``rpn_jitter`` makes around its objects (centre moved and size scaled by
    the jitter, in the boxes' own resized coordinates), as a trained RPN proposes them."""
    if not module.training or len(args) < 3 or not args[2] or "rpn_jitter" not in args[2][0]:
        return None
    images, _features, targets = args[:3]
    proposals, losses = output
    joined = []
    for boxes, target, (h, w) in zip(proposals, targets, images.image_sizes, strict=True):
        gt, jitter = target["boxes"], target["rpn_jitter"].to(target["boxes"].dtype)
        size = (gt[:, 2:] - gt[:, :2])[:, None]
        centre = (gt[:, :2] + gt[:, 2:])[:, None] / 2 + jitter[..., :2] * size
        half = size * jitter[..., 2:].exp() / 2
        around = torch.cat([centre - half, centre + half], -1).reshape(-1, 4)
        around = torch.minimum(around.clamp(min=0), around.new_tensor([w, h, w, h]))
        joined.append(torch.cat([boxes, around.to(boxes.dtype)]))
    return joined, losses

"""How many RoIs the box head's sampler picks per image, positive and negative: the figure that
sets the RoI heads' memory (the mask head keeps ~1.7 MB per positive RoI in fp32 at 800 px), and
that detectron2 logs as ``roi_head/num_fg_samples`` and ``num_bg_samples``. An untrained
detector's heads see only the ground-truth boxes as positives; a trained one's sampler fills up
to ``box_positive_fraction`` of ``box_batch_size_per_image`` with them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RoISampleCounter:
    """torchvision's ``BalancedPositiveNegativeSampler`` of ``roi_heads``, counting what it
    picks. The counts add up on the sampler's device, so a training step makes no host sync;
    :meth:`take` reads them (once per log record)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.sums: Tensor | None = None  # positives, negatives, images since the last take()

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

"""Gradient accumulation (solver.accumulate): one optimizer step from k micro-batches equals one
step of the whole batch for a frozen-norm model, within float summation error."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math

import pytest
import torch
from torch import nn

from dropit_core import FrozenBatchNorm2d
from rcnn_dropit.checkpoint.files import load_checkpoint
from rcnn_dropit.config import load_config
from rcnn_dropit.distributed import DistInfo
from rcnn_dropit.engine.runner import prepare_model, train
from rcnn_dropit.engine.step import StepOptions, micro_batches
from rcnn_dropit.engine.trainer import Schedule, Trainer
from rcnn_dropit.metrics_file import NullWriter
from rcnn_dropit.models import build_model
from tests.helpers import MASK_CFG, MASK_DROPIT_CFG, tiny_opts, train_killed_at


class _FrozenNormNet(nn.Module):
    """A detector-shaped toy: conv, frozen norm, ReLU, linear; each loss a mean over images."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = FrozenBatchNorm2d(8)
        self.norm.running_var.uniform_(0.5, 2.0)
        self.fc = nn.Linear(8, 2)
        self.forwards = 0
        self.synced: list[bool] = []
        self._in_no_sync = False

    @contextlib.contextmanager
    def no_sync(self):
        """Stands for DDP's: records which forwards ran without gradient synchronisation."""
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def forward(self, images, targets):
        self.forwards += 1
        self.synced.append(not self._in_no_sync)
        x = torch.stack(images)
        feats = torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3))
        logits = self.fc(feats)
        labels = torch.stack([t["label"] for t in targets])
        return {
            "loss_classifier": nn.functional.cross_entropy(logits, labels),
            "loss_box_reg": (feats**2).sum(dim=1).mean() * 0.01,
        }


def _batch(n: int = 4):
    gen = torch.Generator().manual_seed(3)
    images = [torch.rand(3, 10, 10, generator=gen) for _ in range(n)]
    targets = [{"label": torch.tensor(i % 2)} for i in range(n)]
    return images, targets


def _trainer(model: nn.Module, accumulate: int, batch_size: int = 4, **options) -> Trainer:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    step = StepOptions(batch_size=batch_size, accumulate=accumulate, **options)
    return Trainer(
        model, opt, sched, None, None, torch.device("cpu"), step, Schedule(4, 4, 1, 0, 0, 0),
        NullWriter(), progress=False,
    )  # fmt: skip


def test_micro_batches_split_in_order_and_as_evenly_as_possible() -> None:
    images, targets = list(range(5)), [f"t{i}" for i in range(5)]
    parts = micro_batches(images, targets, 2)
    assert parts == [([0, 1], ["t0", "t1"]), ([2, 3, 4], ["t2", "t3", "t4"])]
    assert [len(i) for i, _ in micro_batches(images, targets, 3)] == [1, 2, 2]
    # an epoch's short last batch: one micro-batch per image at most
    assert micro_batches([7], ["t7"], 4) == [([7], ["t7"])]


@pytest.mark.parametrize("k", [2, 4, 3])
def test_k_micro_batches_give_the_weights_of_one_whole_batch_step(k: int) -> None:
    whole, split = _FrozenNormNet(), _FrozenNormNet()
    images, targets = _batch()
    logged = []
    for model, accumulate in ((whole, 1), (split, k)):
        trainer = _trainer(model, accumulate)
        logged.append(trainer.step(images, targets, 1))
        logged.append(trainer.step(images, targets, 2))  # momentum carries the first step over
    moved = [(p - q).abs().max().item() for p, q in zip(whole.parameters(), _FrozenNormNet()
                                                          .parameters(), strict=True)]  # fmt: skip
    assert min(moved) > 1e-3  # the steps did move every weight
    for p, q in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    # the logged losses are the whole batch's
    for key in logged[0]:
        assert logged[2][key] == pytest.approx(logged[0][key], rel=1e-5)
    # DDP synchronises only the last micro-batch's gradients
    assert split.forwards == 2 * min(k, 4) and whole.synced == [True, True]
    assert split.synced == ([False] * (min(k, 4) - 1) + [True]) * 2


def test_a_nonfinite_micro_batch_skips_the_whole_step() -> None:
    model = _FrozenNormNet()
    before = copy.deepcopy(model.state_dict())
    images, targets = _batch()
    images[3] = images[3] * float("nan")  # only the second micro-batch is NaN
    trainer = _trainer(model, accumulate=2, nonfinite="skip")
    logged = trainer.step(images, targets, 1)
    assert math.isnan(logged["loss"]) and trainer.skipped_steps == 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())  # nothing carried to the next step
    assert trainer.scheduler.last_epoch == 1
    with pytest.raises(FloatingPointError, match="non-finite loss at iteration 1"):
        _trainer(model, accumulate=2).step(images, targets, 1)


def _identical_images_detector(accumulate: int):
    """The shapes Mask R-CNN, frozen norms, with sample sizes that take every anchor and
    proposal: proposal sampling then draws nothing that depends on the micro-batch split."""
    cfg = load_config(
        MASK_CFG,
        [
            "model.norm=frozen_bn",
            "model.trainable_layers=3",
            "model.min_size=64",
            "model.max_size=64",
            "model.rpn_batch_size_per_image=100000",
            "model.box_batch_size_per_image=100000",
            f"solver.accumulate={accumulate}",
        ],
    )
    torch.manual_seed(0)
    return build_model(cfg)[0].train()


def test_mask_rcnn_with_frozen_norms_steps_the_same_in_two_micro_batches() -> None:
    # Identical images: every image then has the same number of sampled anchors, proposals and
    # positive RoIs, so the batch's losses (means over those) are the means of the micro-batch
    # losses; with images of different content they are not exactly (docs/training.md).
    gen = torch.Generator().manual_seed(0)
    image = torch.rand(3, 64, 64, generator=gen)
    mask = torch.zeros(1, 64, 64, dtype=torch.uint8)
    mask[0, 8:40, 12:50] = 1
    target = {"boxes": torch.tensor([[12.0, 8.0, 50.0, 40.0]]), "labels": torch.tensor([1])}
    target["masks"] = mask
    models = []
    for k in (1, 2):
        model = _identical_images_detector(k)
        torch.manual_seed(1)
        _trainer(model, k, batch_size=2).step([image, image], [target, target], 1)
        models.append(model)
    whole, split = models
    start = _identical_images_detector(1)
    for (name, p), q, p0 in zip(
        whole.named_parameters(), split.parameters(), start.parameters(), strict=True
    ):
        if not p.requires_grad:
            continue
        # within float summation error of the layer's step (measured: at most 1e-4 of it),
        # plus the rounding of the weights themselves where the step is tiny
        step, other = p - p0, q - p0
        assert step.abs().max() > 0, name
        bound = 2e-4 * step.abs().max() + 1e-6 * p0.abs().max()
        assert (other - step).abs().max() <= bound, name


def test_trainable_batchnorm_with_accumulation_says_the_statistics_change(caplog) -> None:
    info = DistInfo(0, 1, 0, torch.device("cpu"), distributed=False)
    for norm, says in (("bn", True), ("frozen_bn", False)):
        cfg = load_config(MASK_CFG, [f"model.norm={norm}", "solver.accumulate=2"])
        caplog.clear()
        with caplog.at_level(logging.INFO):
            prepare_model(cfg, info)
        assert ("micro-batch of ~4 image(s) is normalised" in caplog.text) is says


@pytest.mark.slow
def test_accumulated_quant_run_resumes_bit_for_bit_and_reports_a_micro_batch(
    tmp_path, tiny_shapes
) -> None:
    # 4-bit stochastic rounding draws per forward: each micro-batch its own draws, the same
    # ones again after a resume
    opts = tiny_opts(
        tiny_shapes,
        "dropit.strategy=quant",
        "solver.accumulate=2",
        "solver.max_iters=3",
        "train.checkpoint_every_iters=2",
        "train.measure_memory=true",
        "train.keep_last=0",
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(MASK_DROPIT_CFG, opts, output_dir=straight)
    train_killed_at(MASK_DROPIT_CFG, opts, resumed, 3)
    train(MASK_DROPIT_CFG, opts, output_dir=resumed, resume="auto")
    a = load_checkpoint(straight / "checkpoints/model_0000003.pth")["model"]
    b = load_checkpoint(resumed / "checkpoints/model_0000003.pth")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    memory = json.loads((straight / "memory.json").read_text())
    assert memory["accumulate"] == 2 and memory["batch_size"] == 1  # one micro-batch: 1 of 2 images
    log = (straight / "log.txt").read_text()
    assert "for 3 iterations (4 per epoch, each in 2 micro-batches, 1 process(es) on cpu)" in log

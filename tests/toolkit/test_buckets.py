"""Size buckets (model.size_buckets): which bucket a batch takes, what padding to it keeps and
changes, the poolers' scales, the fallback counted in training, and the logged count."""

from __future__ import annotations

import copy

import pytest
import torch
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops.poolers import _setup_scales

from rcnn_dropit.checkpoint.files import load_checkpoint
from rcnn_dropit.config import load_config
from rcnn_dropit.engine.runner import train
from rcnn_dropit.models import build_model
from rcnn_dropit.models.buckets import (
    BucketedTransform,
    padded_size,
    smallest_bucket,
    use_size_buckets,
)
from tests.helpers import FASTER_CFG, MASK_CFG, REPO, tiny_opts, train_records

COCO_RECIPE = REPO / "configs/maskrcnn_baseline.yaml"
COCO_BUCKETS = [[800, 1344], [1344, 800]]  # the COCO recipe's orientations (docs/configs.md)
SIZE = 64  # the tiny model's images


def test_a_batch_takes_the_smallest_bucket_that_holds_it_in_both_dimensions() -> None:
    buckets = [(800, 1344), (1344, 800), (512, 512)]
    assert smallest_bucket((480, 640), buckets) == (800, 1344)
    assert smallest_bucket((1344, 608), buckets) == (1344, 800)
    assert smallest_bucket((512, 512), buckets) == (512, 512)  # the least area that holds it
    assert smallest_bucket((800, 800), buckets) == (800, 1344)  # equal areas: the first listed
    assert smallest_bucket((1344, 1344), buckets) is None  # a landscape and a portrait image
    images = [torch.zeros(3, 700, 1000), torch.zeros(3, 800, 1333)]
    assert padded_size(images, 32) == (800, 1344)  # torchvision's: the largest, up to 32


@pytest.mark.parametrize("height, width", [(480, 640), (640, 480), (375, 500), (612, 612),
                                           (200, 1000), (1000, 200), (333, 500)])  # fmt: skip
def test_the_coco_recipes_two_buckets_hold_every_image_it_resizes(height, width) -> None:
    m = load_config(COCO_RECIPE).model
    transform = GeneralizedRCNNTransform(m.min_size, m.max_size, [0.0] * 3, [1.0] * 3)
    resized, _ = transform.resize(torch.zeros(1, height, width))
    natural = padded_size([resized], transform.size_divisible)
    assert smallest_bucket(natural, [tuple(b) for b in COCO_BUCKETS]) is not None, natural


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    """The demo's R18 Mask R-CNN at 64 px, frozen norms (the COCO recipe's), untrained."""
    cfg = load_config(MASK_CFG, [f"model.min_size={SIZE}", f"model.max_size={SIZE}",
                                 "model.norm=frozen_bn", "model.box_batch_size_per_image=32",
                                 "model.rpn_batch_size_per_image=32"])  # fmt: skip
    torch.manual_seed(0)
    model, _ = build_model(cfg)
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, SIZE, SIZE, generator=g) for _ in range(2)]
    masks = torch.zeros(2, SIZE, SIZE, dtype=torch.uint8)
    masks[0, 8:40, 6:30], masks[1, 20:60, 24:50] = 1, 1
    target = {
        "boxes": torch.tensor([[6.0, 8.0, 30.0, 40.0], [24.0, 20.0, 50.0, 60.0]]),
        "labels": torch.tensor([1, 2]),
        "masks": masks,
    }
    return images, [dict(target), dict(target)]


def _outputs(model: torch.nn.Module, buckets: list[list[int]] | None):
    """(training losses, detections) of a fresh copy of ``model``, with ``buckets`` if given;
    the same random draws for each copy."""
    out = []
    for training in (True, False):
        net = copy.deepcopy(model)
        if buckets is not None:
            use_size_buckets(net, buckets)
        net.train(training)
        images, targets = _batch()
        torch.manual_seed(5)  # the RPN's and RoI heads' sampling
        with torch.set_grad_enabled(training):
            out.append(net(images, targets if training else None))
    return out


def test_a_bucket_of_the_batchs_own_size_gives_the_unpadded_losses_and_detections(
    tiny_model,
) -> None:
    losses, detections = _outputs(tiny_model, None)
    bucket_losses, bucket_detections = _outputs(tiny_model, [[SIZE, SIZE], [256, 256]])
    assert losses.keys() == bucket_losses.keys()
    for key, value in losses.items():
        assert torch.equal(value, bucket_losses[key]), key  # bit for bit, fp32
    for plain, padded in zip(detections, bucket_detections, strict=True):
        assert len(plain["boxes"]) > 0
        for key, value in plain.items():
            assert torch.equal(value, padded[key]), key


def test_a_larger_bucket_pads_with_zeros_and_the_heads_keep_each_images_size(tiny_model) -> None:
    bucketed = BucketedTransform(tiny_model.transform, [[128, 96]])
    plain = copy.deepcopy(tiny_model.transform)
    images = [torch.rand(3, SIZE, SIZE), torch.rand(3, 48, SIZE)]
    reference, _ = plain([i.clone() for i in images])
    batch, _ = bucketed([i.clone() for i in images])
    assert tuple(batch.tensors.shape) == (2, 3, 128, 96)
    assert batch.image_sizes == reference.image_sizes == [(SIZE, SIZE), (48, SIZE)]
    height, width = reference.tensors.shape[-2:]
    assert torch.equal(batch.tensors[..., :height, :width], reference.tensors)
    assert not batch.tensors[..., height:, :].any() and not batch.tensors[..., width:].any()
    assert bucketed.unbucketed == 0


def test_a_larger_bucket_changes_the_outputs_and_keeps_them_inside_each_image(tiny_model) -> None:
    # Not exact, and not meant to be: the backbone sees the padding's features where the
    # unpadded batch had its convs' zero padding, and the RPN gets anchors over the padding
    # (more negatives to sample, more candidates before NMS). What holds: finite losses of the
    # same terms, and every detection inside its own image, not the bucket.
    losses, _ = _outputs(tiny_model, None)
    bucket_losses, detections = _outputs(tiny_model, [[4 * SIZE, 4 * SIZE]])
    assert bucket_losses.keys() == losses.keys()
    assert all(torch.isfinite(v) for v in bucket_losses.values())
    assert any(not torch.equal(losses[k], bucket_losses[k]) for k in losses)
    for found in detections:
        assert len(found["boxes"]) > 0
        assert found["boxes"].min() >= 0 and found["boxes"].max() <= SIZE
        assert found["masks"].shape[-2:] == (SIZE, SIZE)


def test_the_poolers_scales_are_the_fpns_whatever_the_bucket(tiny_model) -> None:
    plain = copy.deepcopy(tiny_model)
    plain.eval()
    with torch.no_grad():
        plain(_batch()[0])  # torchvision infers the scales from this first batch
    tall = copy.deepcopy(tiny_model)
    use_size_buckets(tall, [[4 * SIZE, SIZE]])
    for name in ("box_roi_pool", "mask_roi_pool"):
        inferred = getattr(plain.roi_heads, name)
        fixed = getattr(tall.roi_heads, name)
        assert fixed.scales == inferred.scales == [1 / 4, 1 / 8, 1 / 16, 1 / 32]
        assert (fixed.map_levels.k_min, fixed.map_levels.k_max) == (2, 5)
        assert vars(fixed.map_levels) == vars(inferred.map_levels)
    # what torchvision would infer from a first batch 4x shorter than its bucket: P2 at 1
    maps = [torch.zeros(1, 1, 4 * SIZE // 2**k, SIZE // 2**k) for k in range(2, 6)]
    wrong, _ = _setup_scales(maps, [(SIZE, SIZE)], 224, 4)
    assert wrong[0] == 1.0


def test_a_batch_no_bucket_holds_is_padded_as_torchvision_pads_it_and_counted_in_training(
    tiny_model,
) -> None:
    bucketed = BucketedTransform(tiny_model.transform, [[32, 32]])
    images = [torch.rand(3, SIZE, SIZE)]
    batch, _ = bucketed(images)
    assert tuple(batch.tensors.shape[-2:]) == (SIZE, SIZE)
    assert (bucketed.unbucketed, bucketed.last_unbucketed) == (1, (SIZE, SIZE))
    bucketed.eval()  # evaluation batches are not counted: the log counts training's
    bucketed(images)
    assert bucketed.unbucketed == 1


def test_bad_buckets_are_refused_with_an_example() -> None:
    for value in ("[[800]]", "[[800,1333]]", "[800,1344]", "[[0,32]]"):
        with pytest.raises(ValueError, match=r"model.size_buckets .* two positive multiples of 32"):
            load_config(FASTER_CFG, [f"model.size_buckets={value}"])
    assert load_config(FASTER_CFG).model.size_buckets == []  # off unless set
    cfg = load_config(FASTER_CFG, [f"model.size_buckets={COCO_BUCKETS}"])
    assert cfg.model.size_buckets == COCO_BUCKETS


@pytest.mark.slow  # two tiny training runs
def test_a_run_logs_the_batches_no_bucket_held(tmp_path, tiny_shapes) -> None:
    opts = tiny_opts(tiny_shapes, "solver.max_iters=3", "train.checkpoint_every_iters=2")
    fits = train(FASTER_CFG, [*opts, "model.size_buckets=[[96,96]]"], output_dir=tmp_path / "a")
    records = train_records(fits.output_dir)
    assert [r["unbucketed_batches"] for r in records] == [0, 0, 0]
    small = train(FASTER_CFG, [*opts, "model.size_buckets=[[32,32]]"], output_dir=tmp_path / "b")
    records = train_records(small.output_dir)
    assert [r["unbucketed_batches"] for r in records] == [1, 2, 3]  # every batch, once
    state = load_checkpoint(small.output_dir / "checkpoints/model_0000002.pth")
    assert state["loop"]["unbucketed_batches"] == 2  # resumed runs go on counting
    log = (small.output_dir / "log.txt").read_text()
    assert "1 more batch(es) fit no bucket of model.size_buckets [[32, 32]]" in log
    plain = train(FASTER_CFG, [*opts, "solver.max_iters=1"], output_dir=tmp_path / "c")
    assert "unbucketed_batches" not in train_records(plain.output_dir)[0]

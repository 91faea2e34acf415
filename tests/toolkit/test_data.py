"""Tests of rcnn_dropit.data: COCO parsing, shapes generation, transforms, samplers, loaders."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pycocotools.mask as mask_utils
import pytest
import torch
from PIL import Image
from torch.utils.data import DistributedSampler

from rcnn_dropit.config import Config, config_from_dict
from rcnn_dropit.data import (
    CocoDetection,
    GroupedBatchSampler,
    aspect_ratio_groups,
    build_dataset,
    build_train_loader,
    build_transforms,
    build_val_loader,
    dataset_paths,
    ensure_dataset,
    hflip,
    images_to_device,
    make_shapes,
    mask_to_rle,
    segmentation_to_mask,
    shard_indices,
)
from rcnn_dropit.engine.data_position import epoch_batches
from rcnn_dropit.errors import UsageError

SHAPES = {"num_train": 6, "num_val": 3, "image_size": 64, "num_classes": 3, "seed": 1}


def make_cfg(root: Path, dataset: str = "shapes", **data_overrides) -> Config:
    """A validated Config of the data set at root (COCO file names as the defaults have them),
    batches of 2."""
    data = {
        "dataset": dataset,
        "root": str(root),
        "shapes": SHAPES,
        "num_workers": 0,
        "aspect_ratio_group_factor": 3,
        "hflip_prob": 0.5,
        **data_overrides,
    }
    model = {"num_classes": SHAPES["num_classes"] + 1}
    return config_from_dict({"data": data, "solver": {"batch_size": 2}, "model": model})


@pytest.fixture(scope="module")
def shapes_root(shapes_set) -> Path:
    return shapes_set(**SHAPES)


def mask_box(mask: torch.Tensor) -> list[int]:
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]


# ---------------------------------------------------------------- shapes


def test_shapes_load_consistent(shapes_root):
    ds = CocoDetection(
        shapes_root / "train2017",
        shapes_root / "annotations/instances_train2017.json",
        train=True,
        transforms=build_transforms(False, 0.0),
    )
    assert ds.num_classes == 4
    assert ds.class_names == ["__background__", "circle", "square", "triangle"]
    assert ds.stats["images_in_file"] == 6
    assert ds.stats["dropped_without_annotations"] == 1  # the generated empty image
    assert len(ds) == 5
    n_objects = 0
    for i in range(len(ds)):
        image, target = ds[i]
        h, w = image.shape[1:]
        assert image.dtype == torch.float32 and 0.0 <= image.min() and image.max() <= 1.0
        assert target["boxes"].dtype == torch.float32
        assert target["labels"].dtype == torch.int64
        assert target["masks"].dtype == torch.uint8 and target["masks"].shape[1:] == (h, w)
        assert 1 <= len(target["labels"]) <= 4
        assert ((target["labels"] >= 1) & (target["labels"] <= 3)).all()
        for box, mask, area in zip(target["boxes"], target["masks"], target["area"], strict=True):
            assert torch.allclose(box, torch.tensor(mask_box(mask), dtype=torch.float32), atol=1)
            assert int(mask.sum()) == int(area)
        n_objects += len(target["labels"])
    assert n_objects == ds.stats["annotations_used"]


def test_shapes_json_has_both_segmentation_kinds(shapes_root):
    doc = json.loads((shapes_root / "annotations/instances_train2017.json").read_text())
    kinds = {type(a["segmentation"]).__name__ for a in doc["annotations"]}
    assert kinds == {"list", "dict"}
    for ann in doc["annotations"]:
        img = doc["images"][ann["image_id"] - 1]
        mask = segmentation_to_mask(ann["segmentation"], img["height"], img["width"])
        assert int(mask.sum()) == ann["area"] > 0
        if isinstance(ann["segmentation"], dict):  # uncompressed RLE: what others can read
            assert all(isinstance(c, int) for c in ann["segmentation"]["counts"])


def _shapes_digest(root: Path) -> str:
    """SHA-256 over every annotation's decoded mask bits, box, area and ids, and every image."""
    h = hashlib.sha256()
    for split in ("train", "val"):
        doc = json.loads((root / "annotations" / f"instances_{split}2017.json").read_text())
        sizes = {im["id"]: (im["height"], im["width"]) for im in doc["images"]}
        for ann in doc["annotations"]:
            mask = segmentation_to_mask(ann["segmentation"], *sizes[ann["image_id"]])
            h.update(np.packbits(mask).tobytes())
            fields = ("bbox", "area", "category_id", "image_id", "id", "iscrowd")
            h.update(json.dumps([ann[k] for k in fields]).encode())
        for im in doc["images"]:
            h.update((root / f"{split}2017" / im["file_name"]).read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize(
    "params, digest",
    [
        ((8, 4, 64, 3, 0), "a7d9151f11c4ef1df015c30d2984a2ec9033dd898e6f9ae8ea76cc9ccf3cc8ab"),
        ((30, 10, 96, 3, 5, 3), "f7b73ea1f7c8841fdb22dcb090287df1aaa68cd3c9f45b4b196ba5735d6a35c2"),
    ],
)
def test_shapes_decode_to_the_masks_the_study_trained_on(tmp_path, params, digest):
    # Digests taken with the generator that wrote compressed RLE (commit fae5b30), whose decoded
    # masks the accuracy study's runs trained on: the format changed, no mask bit, box or area.
    # (The demo's set, 200 + 50 images of 128 px, gave 625c2276757e... both ways.)
    make_shapes(tmp_path, *params)
    assert _shapes_digest(tmp_path) == digest


def _reference_masks(segmentations: list, height: int, width: int) -> list[torch.Tensor]:
    """What torchvision's detection reference does with a COCO target's segmentations
    (convert_coco_poly_to_mask), written out: frPyObjects, decode, any over the parts."""
    masks = []
    for segmentation in segmentations:
        decoded = mask_utils.decode(mask_utils.frPyObjects(segmentation, height, width))
        if decoded.ndim == 2:  # one RLE, not a list of polygon parts
            decoded = decoded[..., None]
        masks.append(torch.as_tensor(decoded, dtype=torch.uint8).any(dim=2))
    return masks


def test_torchvisions_reference_reads_every_shapes_annotation(shapes_root):
    for split in ("train", "val"):
        doc = json.loads((shapes_root / "annotations" / f"instances_{split}2017.json").read_text())
        for img in doc["images"]:
            anns = [a for a in doc["annotations"] if a["image_id"] == img["id"]]
            h, w = img["height"], img["width"]
            theirs = _reference_masks([a["segmentation"] for a in anns], h, w)
            for ann, mask in zip(anns, theirs, strict=True):
                ours = segmentation_to_mask(ann["segmentation"], h, w)
                assert torch.equal(mask, torch.from_numpy(ours).bool())


def test_mask_to_rle_is_exact_and_starts_with_zeros():
    mask = np.zeros((3, 4), dtype=np.uint8)
    mask[0, 0] = mask[1:, 2] = 1  # column-major: 1, 0 0 0 0 0, 0 1 1, 0 0 0
    rle = mask_to_rle(mask)
    assert rle == {"size": [3, 4], "counts": [0, 1, 6, 2, 3]}
    assert np.array_equal(mask_utils.decode(mask_utils.frPyObjects(rle, 3, 4)), mask)
    assert mask_to_rle(np.zeros((2, 2)))["counts"] == [4]


def test_shapes_deterministic(tmp_path):
    def digest(root: Path) -> dict:
        return {
            str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }

    make_shapes(tmp_path / "a", 4, 2, 48, 6, seed=3)
    make_shapes(tmp_path / "b", 4, 2, 48, 6, seed=3)
    make_shapes(tmp_path / "c", 4, 2, 48, 6, seed=4)
    a, b, c = digest(tmp_path / "a"), digest(tmp_path / "b"), digest(tmp_path / "c")
    assert len(a) == 4 + 2 + 2 and a == b
    assert a != c


def test_make_shapes_rejects_bad_args(tmp_path):
    with pytest.raises(ValueError, match="num_classes: 7"):
        make_shapes(tmp_path, 2, 2, 64, 7, 0)
    with pytest.raises(ValueError, match="num_classes: 4 is not in 1..3"):
        make_shapes(tmp_path, 2, 2, 64, 4, 0, first_class=3)
    with pytest.raises(ValueError, match="first_class: 6"):
        make_shapes(tmp_path, 2, 2, 64, 1, 0, first_class=6)


def test_make_shapes_command_refuses_a_used_root(tmp_path, capsys):
    from rcnn_dropit.commands.make_shapes import main

    small = ["--num-train", "2", "--num-val", "1", "--image-size", "32"]
    assert main(["--root", str(tmp_path / "set"), *small]) == 0
    before = sorted(p.name for p in (tmp_path / "set/train2017").iterdir())
    capsys.readouterr()
    assert main(["--root", str(tmp_path / "set")]) == 2  # would write 200 images over 2
    assert "is not empty; give a new or empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "set/train2017").iterdir()) == before
    (tmp_path / "file").write_text("x")
    assert main(["--root", str(tmp_path / "file"), *small]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err


def test_shapes_first_class_draws_other_objects(tmp_path):
    """A set from first_class 3 has the last three shape kinds only, labelled 1..3."""
    make_shapes(tmp_path / "other", 6, 2, 64, 3, seed=5, first_class=3)
    doc = json.loads((tmp_path / "other/annotations/instances_train2017.json").read_text())
    assert [c["name"] for c in doc["categories"]] == ["ellipse", "diamond", "hexagon"]
    assert {a["category_id"] for a in doc["annotations"]} <= {1, 2, 3}
    assert doc["info"]["shapes"]["first_class"] == 3
    # the default set records no first_class, as sets made before the option did
    make_shapes(tmp_path / "plain", 2, 2, 64, 3, seed=5)
    plain = json.loads((tmp_path / "plain/annotations/instances_val2017.json").read_text())
    assert "first_class" not in plain["info"]["shapes"]


# ---------------------------------------------------------------- hand-written COCO


def write_png(path: Path, w: int, h: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((h, w, 3), 128, dtype=np.uint8)).save(path)


def tiny_coco(root: Path) -> tuple[Path, Path]:
    """Four images: mixed annotations, empty, crowd-only, and an RLE-only one."""
    images = root / "img"
    for name, w, h in [("a.png", 20, 10), ("b.png", 8, 8), ("c.png", 8, 8), ("d.png", 6, 5)]:
        write_png(images / name, w, h)
    small = np.zeros((5, 6), dtype=np.uint8)
    small[1:3, 1:4] = 1
    rle = mask_utils.encode(np.asfortranarray(small))
    doc = {
        "images": [
            {"id": 1, "file_name": "a.png", "width": 20, "height": 10},
            {"id": 2, "file_name": "b.png", "width": 8, "height": 8},
            {"id": 3, "file_name": "c.png", "width": 8, "height": 8},
            {"id": 4, "file_name": "d.png", "width": 6, "height": 5},
        ],
        "categories": [{"id": 7, "name": "cat"}, {"id": 3, "name": "dog"}],
        "annotations": [
            # polygon, box sticks out of the image on the right: clipped to x2 = 20
            {"id": 10, "image_id": 1, "category_id": 7, "bbox": [15, 2, 10, 4], "area": 20,
             "iscrowd": 0, "segmentation": [[15, 2, 20, 2, 20, 6, 15, 6]]},
            # uncompressed RLE (column-major run lengths over 10x20)
            {"id": 11, "image_id": 1, "category_id": 3, "bbox": [0, 0, 1, 3], "area": 3,
             "iscrowd": 0, "segmentation": {"size": [10, 20], "counts": [0, 3, 197]}},
            {"id": 12, "image_id": 1, "category_id": 3, "bbox": [2, 2, 0, 5], "area": 0,
             "iscrowd": 0, "segmentation": [[2, 2, 2, 7, 2, 7]]},  # degenerate: zero width
            {"id": 13, "image_id": 1, "category_id": 7, "bbox": [0, 0, 20, 10], "area": 200,
             "iscrowd": 1, "segmentation": {"size": [10, 20], "counts": [0, 200]}},
            {"id": 14, "image_id": 3, "category_id": 7, "bbox": [0, 0, 4, 4], "area": 16,
             "iscrowd": 1,
             "segmentation": {"size": [8, 8], "counts": [0, 4, 4, 4, 4, 4, 4, 4, 36]}},
            # compressed RLE with counts as str
            {"id": 15, "image_id": 4, "category_id": 3, "bbox": [1, 1, 3, 2], "area": 6,
             "iscrowd": 0, "segmentation": {"size": [5, 6], "counts": rle["counts"].decode()}},
        ],
    }  # fmt: skip
    ann = root / "instances.json"
    ann.write_text(json.dumps(doc))
    return images, ann


def test_tiny_coco_train_counts_and_targets(tmp_path):
    images, ann = tiny_coco(tmp_path)
    ds = CocoDetection(images, ann, train=True, transforms=build_transforms(False, 0.0))
    assert ds.stats == {
        "images_in_file": 4,
        "images": 2,
        "dropped_without_annotations": 2,  # b.png empty, c.png crowd only
        "skipped_missing_images": 0,
        "annotations_used": 3,
        "crowd_annotations": 2,
        "degenerate_boxes": 1,
    }
    assert ds.image_ids == [1, 4]
    assert ds.num_classes == 3 and ds.cat_ids == [3, 7]
    assert ds.label_to_cat_id(1) == 3 and ds.label_to_cat_id(2) == 7
    assert ds.cat_id_to_label(7) == 2

    _, t = ds[0]
    assert t["image_id"] == 1
    assert t["labels"].tolist() == [2, 1]
    assert t["boxes"].tolist() == [[15.0, 2.0, 20.0, 6.0], [0.0, 0.0, 1.0, 3.0]]
    assert t["iscrowd"].tolist() == [0, 0]
    assert t["masks"].shape == (2, 10, 20)
    assert t["masks"][0].sum() == 20 and mask_box(t["masks"][0]) == [15, 2, 20, 6]
    assert t["masks"][1, :3, 0].tolist() == [1, 1, 1] and t["masks"][1].sum() == 3

    _, t = ds[1]
    assert t["masks"].shape == (1, 5, 6) and t["masks"].sum() == 6
    assert mask_box(t["masks"][0]) == [1, 1, 4, 3]


def test_tiny_coco_val_keeps_all_images(tmp_path):
    images, ann = tiny_coco(tmp_path)
    ds = CocoDetection(images, ann, train=False, transforms=build_transforms(False, 0.0))
    assert len(ds) == 4 and ds.stats["dropped_without_annotations"] == 0
    _, t = ds[1]
    assert t["boxes"].shape == (0, 4) and t["masks"].shape == (0, 8, 8)
    assert sorted(ds.coco.getImgIds()) == [1, 2, 3, 4]


# ---------------------------------------------------------------- errors


def test_error_missing_folder_and_file(tmp_path):
    images, ann = tiny_coco(tmp_path)
    with pytest.raises(FileNotFoundError, match="data.val_images: folder .*nope"):
        CocoDetection(tmp_path / "nope", ann, train=False, image_key="data.val_images")
    with pytest.raises(FileNotFoundError, match="data.val_ann: annotation file .*none.json"):
        CocoDetection(images, tmp_path / "none.json", train=False, ann_key="data.val_ann")
    cfg = make_cfg(tmp_path / "coco", dataset="coco")
    with pytest.raises(FileNotFoundError, match="data.root: folder"):
        ensure_dataset(cfg)
    (tmp_path / "coco" / "train2017").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="data.train_ann: annotation file"):
        ensure_dataset(cfg)


def test_error_not_coco(tmp_path):
    images, _ = tiny_coco(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"annotations": [], "categories": []}))
    with pytest.raises(ValueError, match="missing key 'images'"):
        CocoDetection(images, bad, train=True)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a COCO file"):
        CocoDetection(images, bad, train=True)


def test_error_unknown_category(tmp_path):
    images, ann = tiny_coco(tmp_path)
    doc = json.loads(ann.read_text())
    doc["annotations"][2]["category_id"] = 99
    ann.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="annotation 12 has category_id 99"):
        CocoDetection(images, ann, train=True)


def test_a_polygon_far_outside_its_image_is_refused_before_pycocotools(tmp_path):
    # pycocotools' memory grows with a polygon's extent (some 23 GB for a point at 2e8): such a
    # file is refused at load, by the image's size, and a point next to the image still loads
    images, ann = tiny_coco(tmp_path)
    doc = json.loads(ann.read_text())
    doc["annotations"][0]["segmentation"] = [[-20, -10, 40, 2, 40, 20, 15, 6]]  # one size out
    ann.write_text(json.dumps(doc))
    _, target = CocoDetection(images, ann, train=False)[0]
    assert target["masks"][0].sum() > 0
    doc["annotations"][0]["segmentation"] = [[15, 2, 20, 2, 2e8, 6, 15, 6]]
    ann.write_text(json.dumps(doc))
    with pytest.raises(
        ValueError, match=r"annotation 10 has a polygon point \(200000000.0, 6\) far"
    ):
        CocoDetection(images, ann, train=False)
    doc["annotations"][0]["segmentation"] = [[15, 2, 20, 2, 20, -10.5, 15, 6]]
    ann.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"point \(20, -10.5\) far outside its image \(20x10\)"):
        CocoDetection(images, ann, train=True)
    with pytest.raises(ValueError, match=r"point \(15, 400000000.0\) lies far outside the image"):
        segmentation_to_mask([[0, 0, 15, 4e8, 9, 9]], 10, 20)


def test_missing_and_unreadable_images(tmp_path):
    images, ann = tiny_coco(tmp_path)
    (images / "a.png").unlink()
    with pytest.raises(FileNotFoundError, match="a.png.*skip_missing_images"):
        CocoDetection(images, ann, train=False)
    (images / "b.png").write_bytes(b"not an image")
    ds = CocoDetection(images, ann, train=False, skip_missing_images=True)
    assert ds.stats["skipped_missing_images"] == 2 and ds.image_ids == [3, 4]
    # without the skip option a corrupt file fails when loaded, naming the file
    write_png(images / "a.png", 20, 10)
    ds = CocoDetection(images, ann, train=False)
    with pytest.raises(ValueError, match="b.png' cannot be read"):
        ds[1]


# ---------------------------------------------------------------- transforms


def test_hflip_moves_boxes_and_masks_together(shapes_root):
    ann = shapes_root / "annotations/instances_val2017.json"
    ds = CocoDetection(shapes_root / "val2017", ann, False)
    image, target = ds[0]
    flipped_image, flipped = hflip(image, target)
    w = image.shape[-1]
    assert torch.equal(flipped_image, image.flip(-1))
    for box, mask in zip(flipped["boxes"], flipped["masks"], strict=True):
        assert mask_box(mask) == [int(v) for v in box.tolist()]
    orig = target["boxes"]
    assert torch.equal(flipped["boxes"][:, 0], w - orig[:, 2])
    assert torch.equal(flipped["boxes"][:, 2], w - orig[:, 0])
    again_image, again = hflip(flipped_image, flipped)
    assert torch.equal(again_image, image) and torch.equal(again["boxes"], orig)
    assert torch.equal(again["masks"], target["masks"])


def test_random_flip_probability():
    image = torch.arange(6, dtype=torch.uint8).reshape(1, 2, 3)
    target = {"boxes": torch.tensor([[0.0, 0.0, 1.0, 2.0]]), "masks": torch.ones(1, 2, 3)}
    always, never = build_transforms(True, 1.0), build_transforms(True, 0.0)
    out, t = always(image, target, random.Random(0))
    assert out.dtype == torch.float32 and t["boxes"].tolist() == [[2.0, 0.0, 3.0, 2.0]]
    assert torch.equal(out * 255, image.flip(-1).float())
    out, t = never(image, target, random.Random(0))
    assert torch.equal(t["boxes"], target["boxes"])
    flips = sum(
        build_transforms(True, 0.5)(image, target, random.Random(i))[1]["boxes"][0, 0] == 2
        for i in range(400)
    )
    assert 150 < flips < 250


# ---------------------------------------------------------------- samplers


SIZES = [(640, 480), (480, 640), (500, 500), (640, 480), (480, 640), (1000, 300), (640, 480)] * 3


def test_aspect_ratio_groups():
    groups = aspect_ratio_groups([(640, 480), (480, 640), (500, 500), (1000, 300), (100, 400)], 3)
    assert groups == [4, 1, 3, 6, -1]
    assert aspect_ratio_groups(SIZES, -1) == [0] * len(SIZES)


def make_batch_sampler(world_size=1, rank=0, batch_size=2, factor=3, seed=0):
    sampler = DistributedSampler(
        range(len(SIZES)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )
    return GroupedBatchSampler(sampler, aspect_ratio_groups(SIZES, factor), batch_size)


def test_grouped_batches_cover_once_and_share_group():
    groups = aspect_ratio_groups(SIZES, 3)
    bs = make_batch_sampler(batch_size=3)
    for epoch in range(3):
        bs.set_epoch(epoch)
        batches = list(bs)
        assert len(batches) == len(bs) == 7
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(SIZES)))
        full = [b for b in batches if len({groups[i] for i in b}) == 1]
        # 21 images in groups of 9, 6, 3, 3: at most the leftovers are mixed, and here none are
        assert len(full) == 7 and all(len(b) == 3 for b in batches)


def test_grouped_batches_deterministic_per_epoch():
    a, b = make_batch_sampler(), make_batch_sampler()
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b)
    b.set_epoch(2)
    assert list(a) != list(b)
    c = make_batch_sampler(seed=5)
    c.set_epoch(1)
    assert list(a) != list(c)


def test_grouped_batches_resume_mid_epoch():
    bs = make_batch_sampler()
    bs.set_epoch(4)
    full = list(bs)
    resumed = make_batch_sampler()
    resumed.set_epoch(4)
    resumed.set_start_batch(5)
    assert list(resumed) == full[5:]
    assert list(resumed) == full  # the skip applies to one pass only
    with pytest.raises(ValueError, match="start batch 99"):
        resumed.set_start_batch(99)
    keyed = GroupedBatchSampler(bs.sampler, bs.group_ids, 2, emit_epoch=True)
    keyed.set_epoch(4)
    assert next(iter(keyed)) == [(i, 4) for i in full[0]]


def test_grouped_batches_equal_count_per_rank():
    for world_size in (2, 3, 4):
        counts, seen = set(), []
        for rank in range(world_size):
            bs = make_batch_sampler(world_size, rank, batch_size=2)
            bs.set_epoch(7)
            batches = list(bs)
            counts.add(len(batches))
            assert len(batches) == len(bs)
            seen += [i for b in batches for i in b]
        assert len(counts) == 1  # DDP would hang on unequal counts
        assert set(seen) == set(range(len(SIZES)))


def test_val_sharding_exactly_once():
    for n in (0, 1, 5, 7, 10):
        for world_size in (1, 2, 3):
            shards = [shard_indices(n, r, world_size) for r in range(world_size)]
            assert sorted(i for s in shards for i in s) == list(range(n))
            assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError):
        shard_indices(5, 3, 3)


# ---------------------------------------------------------------- loaders


def test_ensure_dataset_generates_shapes_once(tmp_path):
    root = tmp_path / "ds" / "shapes"
    cfg = make_cfg(root)
    ensure_dataset(cfg)
    assert (root / "annotations/instances_val2017.json").is_file()
    assert sorted(p.name for p in root.parent.iterdir()) == ["shapes"]  # no temp folder left
    stamp = (root / "train2017/000000.png").stat().st_mtime_ns
    ensure_dataset(cfg)
    assert (root / "train2017/000000.png").stat().st_mtime_ns == stamp
    other = make_cfg(root)
    other.data.shapes.num_train = 7
    with pytest.raises(ValueError, match="generated with"):
        ensure_dataset(other)


def test_shapes_are_in_coco_2017_layout_and_an_older_set_is_read_where_it_lies(
    tmp_path, shapes_root
):
    """The set reads as COCO with the COCO keys' defaults; one written with the names used
    before (train/, instances_train.json) is found as it is, nothing moved or made again."""
    coco = make_cfg(shapes_root, dataset="coco")
    assert [dataset_paths(coco, s)[:2] for s in ("train", "val")] == [
        (shapes_root / "train2017", shapes_root / "annotations/instances_train2017.json"),
        (shapes_root / "val2017", shapes_root / "annotations/instances_val2017.json"),
    ]
    assert len(build_dataset(coco, "train")) == 5
    old = tmp_path / "old"
    shutil.copytree(shapes_root, old)
    for split in ("train", "val"):
        (old / f"{split}2017").rename(old / split)
        ann = old / "annotations" / f"instances_{split}2017.json"
        ann.rename(old / "annotations" / f"instances_{split}.json")
    cfg = make_cfg(old)
    ensure_dataset(cfg)
    assert sorted(p.name for p in old.iterdir()) == ["annotations", "train", "val"]
    assert dataset_paths(cfg, "val")[:2] == (old / "val", old / "annotations/instances_val.json")
    assert len(build_dataset(cfg, "train")) == 5


def test_loaders_on_shapes(shapes_root):
    cfg = make_cfg(shapes_root)
    train = build_train_loader(cfg, distributed=False, seed=3)
    assert len(train) == 3  # 5 usable images, batch 2
    train.batch_sampler.set_epoch(0)
    seen = []
    for images, targets in train:
        assert isinstance(images, list) and isinstance(targets, list)
        assert len(images) == len(targets) <= 2
        seen += [t["image_id"] for t in targets]
        for image, t in zip(images, targets, strict=True):
            for box, mask in zip(t["boxes"], t["masks"], strict=True):
                assert mask_box(mask) == [int(v) for v in box.tolist()]
            assert image.shape[1:] == t["masks"].shape[1:]
    assert sorted(seen) == sorted(train.dataset.image_ids)

    val = build_val_loader(cfg, distributed=False)
    assert [t["image_id"] for _, ts in val for t in ts] == [1, 2, 3]
    assert val.dataset.label_to_cat_id(3) == 3


def test_loaders_leave_the_data_set_check_to_the_caller(shapes_root, monkeypatch):
    # ensure_dataset runs once, on rank 0 before the loaders: not again on every rank in them
    from rcnn_dropit.data import loader as loader_module

    def checked(cfg):
        raise AssertionError("the loaders checked the data set again")

    monkeypatch.setattr(loader_module, "ensure_dataset", checked)
    cfg = make_cfg(shapes_root)
    assert len(build_train_loader(cfg, distributed=False)) == 3
    assert len(build_val_loader(cfg, distributed=False)) == SHAPES["num_val"]


def test_train_augmentation_independent_of_workers(shapes_root):
    def epoch_boxes(num_workers: int) -> list:
        cfg = make_cfg(shapes_root, num_workers=num_workers, hflip_prob=0.5)
        loader = build_train_loader(cfg, distributed=False, seed=11)
        loader.batch_sampler.set_epoch(2)
        return [t["boxes"].tolist() for _, ts in loader for t in ts]

    assert epoch_boxes(0) == epoch_boxes(1)


def test_loaders_send_uint8_and_the_device_copy_becomes_the_float_image(shapes_root):
    cfg = make_cfg(shapes_root)
    val = build_val_loader(cfg, distributed=False, device=torch.device("cpu"))
    as_float = build_dataset(cfg, "val")  # the dataset's own float conversion
    for index, (images, _targets) in enumerate(val):
        assert images[0].dtype == torch.uint8  # a quarter of the float bytes cross to the device
        on_device = images_to_device(images, torch.device("cpu"))[0]
        assert on_device.dtype == torch.float32
        assert torch.equal(on_device, as_float[index][0])  # bit-identical to the old input
    assert index == SHAPES["num_val"] - 1


def test_loaders_pin_memory_for_cuda_and_keep_training_workers(shapes_root):
    cuda = torch.device("cuda")  # only building the loaders, which needs no GPU
    with_workers = make_cfg(shapes_root, num_workers=2)
    train = build_train_loader(with_workers, distributed=False, seed=3, device=cuda)
    assert (train.pin_memory, train.persistent_workers) == (True, True)
    val = build_val_loader(with_workers, distributed=False, device=cuda)
    assert (val.pin_memory, val.persistent_workers) == (True, False)
    cpu = build_train_loader(make_cfg(shapes_root), False, 3, torch.device("cpu"))
    assert (cpu.pin_memory, cpu.persistent_workers) == (False, False)


def test_persistent_workers_give_the_same_epochs_and_resumed_epochs(shapes_root):
    def passes(num_workers: int) -> list:
        loader = build_train_loader(make_cfg(shapes_root, num_workers=num_workers), False, seed=5)
        # epochs 0 and 1, then epoch 1 again from its second batch (a resumed run)
        plan = [(0, 0), (1, 0), (1, 1)]
        return [
            [[t["image_id"] for t in ts] + t_boxes(ts) for _, ts in epoch_batches(loader, e, k)]
            for e, k in plan
        ]

    def t_boxes(targets) -> list:
        return [t["boxes"].tolist() for t in targets]

    fresh = passes(0)
    assert fresh[2] == fresh[1][1:]
    assert passes(1) == fresh


def test_error_num_classes_below_the_categories(tmp_path):
    # tiny_coco has 2 categories: a 2-class model (1 + background) would index past its logits
    images, ann = tiny_coco(tmp_path)
    paths = {"train_images": str(images), "train_ann": str(ann)}
    cfg = make_cfg(tmp_path, dataset="coco", **paths)
    cfg.model.num_classes = 2
    with pytest.raises(
        UsageError, match=r"model.num_classes: 2 is too small .*has 2 categories.*at least 3"
    ):
        build_dataset(cfg, "train")
    cfg.model.num_classes = 3
    assert build_dataset(cfg, "train").num_classes == 3

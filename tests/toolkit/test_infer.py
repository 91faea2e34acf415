"""tools/infer.py and the drawing behind it: pictures, COCO results, the gallery, bad input."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO

from rcnn_dropit.checkpoint.files import save_checkpoint
from rcnn_dropit.config import config_yaml, load_config
from rcnn_dropit.data import ensure_dataset
from rcnn_dropit.inference import class_names_for
from rcnn_dropit.models import build_model
from rcnn_dropit.visualize import (
    CAPTION_HEIGHT,
    GAP,
    class_color,
    draw_ground_truth,
    draw_prediction,
    prediction_vs_truth,
    shown_detections,
)
from tests.helpers import MASK_CFG, assert_one_line_error, call_tool, tiny_opts


def _prediction() -> dict[str, torch.Tensor]:
    """Two detections on a 60x60 image: a confident class-2 box with a mask, a weak class-1 box."""
    masks = torch.zeros(2, 1, 60, 60)
    masks[0, 0, 25:35, 15:25] = 0.8  # the object (below the caption at the box's top)
    masks[0, 0, 40:45, 40:45] = 0.4  # below the 0.5 mask threshold
    masks[1, 0] = 0.9
    return {
        "boxes": torch.tensor([[5.0, 5.0, 50.0, 50.0], [0.0, 0.0, 59.0, 59.0]]),
        "labels": torch.tensor([2, 1]),
        "scores": torch.tensor([0.9, 0.3]),
        "masks": masks,
    }


def test_drawn_prediction_colours_box_edge_and_mask_interior() -> None:
    image = torch.zeros(3, 60, 60, dtype=torch.uint8)
    names = ["bg", "circle", "square"]
    drawn = draw_prediction(image, _prediction(), names, score_thresh=0.5)
    color = torch.tensor(class_color(2), dtype=torch.uint8)
    assert drawn.shape == (3, 60, 60) and drawn.dtype == torch.uint8
    assert torch.equal(drawn[:, 30, 5], color)  # left edge, below the caption
    assert torch.equal(drawn[:, 30, 50], color)  # right edge
    assert torch.equal(drawn[:, 50, 30], color)  # bottom edge
    # mask at alpha 0.5 over black: half the class colour
    assert torch.allclose(drawn[:, 30, 20].float(), color.float() / 2, atol=1)
    assert drawn[:, 42, 42].sum() == 0  # probability 0.4: not part of the mask
    assert drawn[:, 55, 0].sum() == 0 and drawn[:, 59, 30].sum() == 0  # score 0.3: not drawn
    assert torch.equal(drawn[:, 9, 45], color)  # the caption's filled background, top of box
    assert drawn[:, 9:19, 8:45].sum() < drawn[:, 9:19, 8:45].numel() / 3 * color.sum()  # text

    big = draw_prediction(image, _prediction(), names, scale=2.0)
    assert big.shape == (3, 120, 120)
    assert torch.equal(big[:, 60, 10], color)
    assert torch.allclose(big[:, 60, 40].float(), color.float() / 2, atol=1)


def test_a_picture_shows_one_box_per_object() -> None:
    # One object found three times (two classes, boxes of about its size), another once.
    prediction = {
        "boxes": torch.tensor(
            [[10.0, 10.0, 50.0, 50.0], [12.0, 11.0, 50.0, 52.0], [8.0, 9.0, 49.0, 48.0],
             [60.0, 60.0, 90.0, 90.0], [61.0, 60.0, 90.0, 91.0]]
        ),
        "scores": torch.tensor([0.9, 0.8, 0.7, 0.6, 0.4]),
        "labels": torch.tensor([1, 2, 1, 2, 1]),
    }  # fmt: skip
    assert shown_detections(prediction, 0.5).tolist() == [0, 3]
    assert shown_detections(prediction, 0.5, overlap=1.0).tolist() == [0, 1, 2, 3]
    assert shown_detections(prediction, 0.3).tolist() == [0, 3]  # 4 hides behind 3
    assert shown_detections(prediction, 0.95).tolist() == []
    # a box on a part of a better one: IoU 0.16, but all of it lies inside: hidden; a box that
    # only touches the better one (a third of the smaller box) stays
    parts = {
        "boxes": torch.tensor(
            [[0.0, 0.0, 50.0, 50.0], [10.0, 10.0, 30.0, 30.0], [40.0, 0.0, 70.0, 30.0]]
        ),
        "scores": torch.tensor([0.9, 0.8, 0.7]),
        "labels": torch.tensor([1, 2, 1]),
    }
    assert shown_detections(parts, 0.5).tolist() == [0, 2]
    assert shown_detections(parts, 0.5, overlap=1.0).tolist() == [0, 1, 2]
    image = torch.zeros(3, 100, 100, dtype=torch.uint8)
    one = draw_prediction(image, prediction, ["bg", "a", "b"], score_thresh=0.5)
    every = draw_prediction(image, prediction, ["bg", "a", "b"], score_thresh=0.5, overlap=1.0)
    assert torch.equal(one[:, 30, 12], torch.zeros(3, dtype=torch.uint8))  # box 1's edge: hidden
    assert torch.equal(every[:, 30, 12], torch.tensor(class_color(2), dtype=torch.uint8))


def test_ground_truth_panel_and_gallery_layout() -> None:
    image = torch.full((3, 30, 50), 255, dtype=torch.uint8)
    masks = torch.zeros(1, 30, 50, dtype=torch.uint8)
    masks[0, 10:20, 20:30] = 1
    target = {"boxes": torch.tensor([[15.0, 5.0, 35.0, 25.0]]), "labels": torch.tensor([3])}
    truth = draw_ground_truth(image, {**target, "masks": masks}, ["bg", "a", "b", "c"])
    color = torch.tensor(class_color(3))
    assert torch.equal(truth[:, 22, 15], color)  # box edge
    assert torch.allclose(truth[:, 15, 25].float(), (255 + color.float()) / 2, atol=1)
    assert torch.equal(truth[:, 2, 2], torch.full((3,), 255, dtype=torch.uint8))

    small = torch.zeros(3, 20, 10, dtype=torch.uint8)
    sheet = prediction_vs_truth([(truth, truth), (small, small)])
    assert sheet.shape == (3, CAPTION_HEIGHT + 30 + 20 + 4 * GAP, 2 * 50 + 3 * GAP)
    row2 = CAPTION_HEIGHT + 30 + 3 * GAP
    assert torch.equal(sheet[:, row2 + 10, 2 * GAP + 50 + 5], torch.zeros(3, dtype=torch.uint8))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_shapes) -> Path:
    """A run directory (config.yaml + checkpoint) of an untrained tiny Mask R-CNN on the tiny
    shapes set, and checkpoints of a 5-class and of a Faster R-CNN model beside it."""
    base = tmp_path_factory.mktemp("infer")
    # score threshold 0: an untrained model's detections all reach the COCO results
    opts = tiny_opts(tiny_shapes, "test.score_thresh=0.0")
    cfg = load_config(MASK_CFG, opts)
    ensure_dataset(cfg)
    run = base / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config_yaml(cfg))
    for name, extra in (
        ("run/checkpoints", ()),
        ("five_classes", ("model.num_classes=5", "data.shapes.num_classes=4")),
        ("faster", ("model.arch=fasterrcnn",)),
    ):
        torch.manual_seed(0)
        model, _ = build_model(load_config(MASK_CFG, [*opts, *extra]))
        state = {"model": model.state_dict(), "iteration": 3}
        save_checkpoint(base / name, "model_0000003.pth", state, keep_last=1)
    return run


def _val_images(run: Path) -> tuple[Path, dict]:
    """The shapes val folder and its COCO annotations."""
    shapes = Path(load_config(run / "config.yaml").data.root)
    doc = json.loads((shapes / "annotations/instances_val2017.json").read_text())
    return shapes / "val2017", doc


def test_infer_folder_writes_pictures_and_coco_results(tiny_run, tmp_path, capsys) -> None:
    val_dir, gt = _val_images(tiny_run)
    folder = tmp_path / "in"
    folder.mkdir()
    for im in gt["images"][:2]:
        shutil.copy(val_dir / im["file_name"], folder / im["file_name"])
    (folder / "notes.txt").write_text("not an image, skipped: only image suffixes are read")
    out = tmp_path / "out"
    ann = val_dir.parent / "annotations/instances_val2017.json"
    proc = call_tool(
        "infer.py",
        "--run", str(tiny_run), "--input", str(folder), "--output", str(out),
        "--scale", "2", "--json", "--image-ids", str(ann),
        capsys=capsys,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"wrote 2 picture(s) to '{out}'" in proc.stdout
    for im in gt["images"][:2]:
        with Image.open(out / Path(im["file_name"]).with_suffix(".png")) as pic:
            assert pic.size == (2 * im["width"], 2 * im["height"]) and pic.mode == "RGB"

    wanted_ids = {im["id"] for im in gt["images"][:2]}
    cat_ids = {c["id"] for c in gt["categories"]}
    coco_gt = COCO()
    coco_gt.dataset = gt
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt.createIndex()
    for iou_type, key in (("bbox", "bbox"), ("segm", "segmentation")):
        results = json.loads((out / f"coco_results_{iou_type}.json").read_text())
        assert results, iou_type  # score threshold 0: an untrained model still detects
        assert all(set(r) == {"image_id", "category_id", key, "score"} for r in results)
        assert {r["image_id"] for r in results} <= wanted_ids
        assert {r["category_id"] for r in results} <= cat_ids
        with contextlib.redirect_stdout(io.StringIO()):
            loaded = coco_gt.loadRes(results)
        assert len(loaded.getAnnIds()) == len(results)
    segm = json.loads((out / "coco_results_segm.json").read_text())
    first = next(im for im in gt["images"] if im["id"] == segm[0]["image_id"])
    assert segm[0]["segmentation"]["size"] == [first["height"], first["width"]]


def test_infer_single_image_numbers_it_1(tiny_run, tmp_path, capsys) -> None:
    val_dir, gt = _val_images(tiny_run)
    image = val_dir / gt["images"][0]["file_name"]
    proc = call_tool(
        "infer.py", "--run", str(tiny_run), "--input", str(image), "--json",
        "--output", str(tmp_path), capsys=capsys,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with Image.open(tmp_path / f"{image.stem}.png") as pic:
        assert pic.size == (gt["images"][0]["width"], gt["images"][0]["height"])
    results = json.loads((tmp_path / "coco_results_bbox.json").read_text())
    assert results and {r["image_id"] for r in results} == {1}


def test_val_gallery_is_one_picture_with_its_path_printed(tiny_run, capsys) -> None:
    proc = call_tool("infer.py", "--run", str(tiny_run), "--val", "2", capsys=capsys)
    assert proc.returncode == 0, proc.stderr
    path = tiny_run / "predictions.png"
    assert str(path) in proc.stdout
    _, gt = _val_images(tiny_run)
    panels = []
    for im in sorted(gt["images"], key=lambda im: im["id"])[:2]:
        scale = 256 / max(im["width"], im["height"])  # panel_size: longer side 256 px
        panels.append((round(im["width"] * scale), round(im["height"] * scale)))
    width = 2 * max(w for w, _ in panels) + 3 * GAP
    height = CAPTION_HEIGHT + sum(h for _, h in panels) + 4 * GAP
    with Image.open(path) as pic:
        assert pic.size == (width, height)
        sheet = torch.from_numpy(np.array(pic.convert("RGB"))).permute(2, 0, 1)
    # the ground-truth column shows every annotated class of those images in its colour
    truth = sheet[:, CAPTION_HEIGHT + 2 * GAP :, 2 * GAP + max(w for w, _ in panels) :]
    shown = {im["id"] for im in sorted(gt["images"], key=lambda im: im["id"])[:2]}
    labels = {a["category_id"] for a in gt["annotations"] if a["image_id"] in shown}
    assert labels  # shapes category ids are the labels 1..K
    for label in labels:
        color = torch.tensor(class_color(label), dtype=torch.uint8)[:, None, None]
        assert (truth == color).all(dim=0).any(), label
    absent = torch.tensor(class_color(7), dtype=torch.uint8)[:, None, None]  # no such class
    assert not (truth == absent).all(dim=0).any()


def test_class_names_fall_back_to_class_n_without_annotations(tmp_path) -> None:
    cfg = load_config(MASK_CFG, tiny_opts(tmp_path / "no_data"))
    names, cat_ids = class_names_for(cfg)
    assert names == ["__background__", "class 1", "class 2", "class 3"] and cat_ids == [1, 2, 3]


def test_bad_inputs_get_one_line_and_exit_2(tiny_run, tmp_path, capsys) -> None:
    run = ("--run", str(tiny_run))
    fake = tmp_path / "fake.png"
    fake.write_text("hello")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.md").write_text("no images here")
    ckpt = tiny_run.parent / "five_classes/model_0000003.pth"
    faster = tiny_run.parent / "faster/model_0000003.pth"
    image = str(next(_val_images(tiny_run)[0].iterdir()))
    cases = [
        ((*run, "--input", str(fake)), (str(fake), "not an image", ".png")),
        ((*run, "--input", str(empty)), (str(empty), "holds no images", ".jpg")),
        ((*run, "--input", str(tmp_path / "nope")), ("nope", "does not exist")),
        (("--run", str(tmp_path), "--input", image), (str(tmp_path), "config.yaml")),
        ((*run, "--checkpoint", str(tmp_path / "x.pth"), "--input", image), ("x.pth",)),
        ((*run, "--checkpoint", str(fake), "--input", image), (str(fake), "not a loadable")),
        (
            ("--config", str(tmp_path / "c.yaml"), "--checkpoint", str(ckpt), "--input", image),
            ("c.yaml", "does not exist"),
        ),
        (
            (*run, "--checkpoint", str(ckpt), "--input", image),
            ("has 5 classes, config model.num_classes 4",),
        ),
        (
            (*run, "--checkpoint", str(faster), "--input", image),
            ("is a fasterrcnn", "config model.arch maskrcnn"),
        ),
        ((*run, "--input", image, "--json", "--image-ids", str(fake)), ("not valid JSON",)),
        ((*run, "--val", "0"), ("--val", ">= 1")),
        ((*run, "--input", image, "--output", str(fake)), (str(fake), "is a file, not a folder")),
        ((*run, "--checkpoint", str(empty), "--input", image), (str(empty), "is a folder")),
    ]
    for args, fragments in cases:
        proc = call_tool("infer.py", *args, capsys=capsys)
        assert_one_line_error(proc, *fragments)
    assert not (tiny_run / "infer").exists()  # nothing written for rejected input

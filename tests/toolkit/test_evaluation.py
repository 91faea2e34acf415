"""COCOEvaluator on a hand-written two-image COCO set with AP values worked out by hand."""

import json

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_util

from rcnn_dropit.engine.evaluator_loop import outputs_to_host
from rcnn_dropit.evaluation import COCOEvaluator, format_metrics_table
from tests.helpers import CAT_OF_LABEL, IMAGES, evaluate_into, make_coco_gt, predictions, rect_mask


def no_predictions(image_id: int) -> dict[str, torch.Tensor]:
    h, w = IMAGES[image_id]
    return {
        "boxes": torch.zeros(0, 4),
        "scores": torch.zeros(0),
        "labels": torch.zeros(0, dtype=torch.int64),
        "masks": torch.zeros(0, 1, h, w),
    }


def evaluate(outputs_by_image: dict[int, dict], output_dir=None) -> dict:
    evaluator = COCOEvaluator(make_coco_gt(), ("bbox", "segm"), CAT_OF_LABEL.__getitem__)
    for image_id, output in outputs_by_image.items():
        evaluator.update([output], [image_id])
    return evaluate_into(evaluator, output_dir)


def test_perfect_predictions_score_one(tmp_path):
    metrics = evaluate({i: predictions(i) for i in IMAGES}, tmp_path)
    assert metrics["num_images"] == 2
    for iou_type in ("bbox", "segm"):
        m = metrics[iou_type]
        # COCOeval divides by tp + fp + eps, so a perfect score is 1 - 2e-16.
        assert [m[k] for k in ("AP", "AP50", "AP75", "APs", "APm")] == pytest.approx([1.0] * 5)
        assert m["APl"] == -1.0  # no large ground truth: COCOeval's "absent"


def test_shifted_boxes_pass_four_of_ten_thresholds():
    # Shifting a w-wide rectangle by w/5 gives IoU (w - w/5) / (w + w/5) = 2/3 for box and mask:
    # a match at IoU 0.50, 0.55, 0.60, 0.65, a miss at 0.70 ... 0.95, so AP = 4/10.
    metrics = evaluate({i: predictions(i, shift=0.2) for i in IMAGES})
    for iou_type in ("bbox", "segm"):
        m = metrics[iou_type]
        assert m["AP50"] == pytest.approx(1.0)
        assert m["AP75"] == pytest.approx(0.0)
        assert m["AP"] == pytest.approx(0.4)
        assert m["APs"] == pytest.approx(0.4)
        assert m["APm"] == pytest.approx(0.4)


def test_only_evaluated_images_count():
    metrics = evaluate({2: predictions(2)})
    assert metrics["num_images"] == 1
    assert metrics["bbox"]["AP"] == pytest.approx(
        1.0
    )  # image 1's objects are not counted as missed
    assert metrics["bbox"]["APm"] == -1.0  # the only medium object lives in image 1


def test_no_detections_give_zero(tmp_path):
    metrics = evaluate({i: no_predictions(i) for i in IMAGES}, tmp_path)
    assert metrics["num_images"] == 2
    for iou_type in ("bbox", "segm"):
        assert metrics[iou_type] == dict.fromkeys(("AP", "AP50", "AP75", "APs", "APm", "APl"), 0.0)
        assert json.loads((tmp_path / f"coco_results_{iou_type}.json").read_text()) == []


def test_results_json_has_valid_entries(tmp_path):
    evaluate({1: predictions(1, shift=0.2), 2: no_predictions(2)}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "coco_results_bbox.json",
        "coco_results_segm.json",
    ]
    boxes = json.loads((tmp_path / "coco_results_bbox.json").read_text())
    assert [(r["image_id"], r["category_id"], r["score"]) for r in boxes] == [
        (1, 1, 1.0),
        (1, 3, 1.0),
    ]
    assert boxes[0]["bbox"] == [4.0, 5.0, 10.0, 10.0]  # xyxy (4, 5, 14, 15) as xywh
    assert "segmentation" not in boxes[0]
    segms = json.loads((tmp_path / "coco_results_segm.json").read_text())
    assert len(segms) == 2 and "bbox" not in segms[0]
    rle = segms[1]["segmentation"]
    assert rle["size"] == [64, 64] and isinstance(rle["counts"], str)
    decoded = mask_util.decode({"size": rle["size"], "counts": rle["counts"].encode()})
    np.testing.assert_array_equal(decoded, rect_mask(1, 24, 10, 64, 50))


def test_bbox_only_and_input_errors():
    evaluator = COCOEvaluator(make_coco_gt(), ("bbox",), CAT_OF_LABEL.__getitem__)
    out = predictions(1)
    del out["masks"]
    evaluator.update([out], [torch.tensor(1)])
    metrics = evaluate_into(evaluator)
    assert set(metrics) == {"bbox", "num_images"}
    assert metrics["bbox"]["AP"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="iou_types"):
        COCOEvaluator(make_coco_gt(), ("keypoints",))
    segm = COCOEvaluator(make_coco_gt(), ("segm",), CAT_OF_LABEL.__getitem__)
    with pytest.raises(ValueError, match="masks"):
        segm.update([out], [1])
    with pytest.raises(ValueError, match="2 outputs but 1 image ids"):
        segm.update([out, out], [1])
    twice = COCOEvaluator(make_coco_gt(), ("bbox",), CAT_OF_LABEL.__getitem__)
    twice.update([out, out], [1, 1])
    with pytest.raises(RuntimeError, match=r"repeat images \(e\.g\. ids \[1\]\)"):
        twice.evaluate_with_results()
    unknown = COCOEvaluator(make_coco_gt(), ("bbox",), CAT_OF_LABEL.__getitem__)
    unknown.update([out], [99])
    with pytest.raises(ValueError, match=r"\[99\]"):
        unknown.evaluate_with_results()


def test_format_metrics_table():
    metrics = {
        "bbox": {"AP": 0.3712, "AP50": 0.5, "AP75": 0.25, "APs": 0.0, "APm": 1.0, "APl": -1.0},
        "segm": {"AP": 0.345, "AP50": 0.6, "AP75": 0.3, "APs": 0.1, "APm": 0.2, "APl": 0.3},
        "num_images": 5,
    }
    assert format_metrics_table(metrics).splitlines() == [
        "| type | AP | AP50 | AP75 | APs | APm | APl |",
        "|---|---|---|---|---|---|---|",
        "| bbox | 37.1 | 50.0 | 25.0 | 0.0 | 100.0 | - |",
        "| segm | 34.5 | 60.0 | 30.0 | 10.0 | 20.0 | 30.0 |",
    ]


def test_masks_thresholded_before_the_host_copy_give_the_same_results(tmp_path):
    probs = predictions(1, shift=0.2)
    probs["masks"] = torch.rand(probs["masks"].shape, generator=torch.Generator().manual_seed(0))
    probs["masks"][0, 0, 0, :3] = torch.tensor([0.5, 0.5000001, 0.4999999])  # 0.5: background
    (host,) = outputs_to_host([probs])
    assert host["masks"].dtype == torch.bool and host["masks"].device.type == "cpu"
    assert torch.equal(host["masks"], probs["masks"] > 0.5)
    assert host["masks"][0, 0, 0, :3].tolist() == [False, True, False]
    for key in ("boxes", "scores", "labels"):
        assert torch.equal(host[key], probs[key])
    evaluate({1: probs}, tmp_path / "probs")
    evaluate({1: host}, tmp_path / "host")
    name = "coco_results_segm.json"
    assert (tmp_path / "host" / name).read_text() == (tmp_path / "probs" / name).read_text()

"""The pooler bench (tools/bench.py pooler): the lean pooler's smaller copy, measured on the
CPU under bf16 autocast, with the same bits as torchvision's."""

from __future__ import annotations

import json
import math

import pytest
import torch

from instruments.commands.bench import main as bench_main
from instruments.measure import pooler_bench
from instruments.measure.pooler_bench import _compare, pooler_costs, pyramid, rois
from rcnn_dropit.errors import UsageError


def test_the_pyramid_and_rois_have_the_recipes_shapes() -> None:
    maps = pyramid(2, 128, torch.bfloat16, torch.device("cpu"))
    assert [tuple(m.shape) for m in maps.values()] == [(2, 256, 32 >> i, 48 >> i) for i in range(4)]
    boxes = rois(2, 50, 128, torch.device("cpu"))
    assert len(boxes) == 2 and all(b.shape == (50, 4) for b in boxes)
    every = torch.cat(boxes)
    assert (every[:, 2:] > every[:, :2]).all() and every[:, 2].max() <= 128 * 4 / 3
    assert every[:, 3].max() <= 128
    sides = ((every[:, 2] - every[:, 0]) * (every[:, 3] - every[:, 1])).sqrt()
    assert sides.min() < 32 and sides.max() > 64  # spread over the levels


def test_the_lean_pooler_copies_one_image_and_keeps_the_bits() -> None:
    """3 images, few RoIs: the whole level's fp32 copy, and in the backward its fp32 gradient,
    are most of torchvision's peaks."""
    ref, lean = _compare("box", 7, 3, 8, 128, torch.bfloat16, torch.device("cpu"), 1)
    assert ref["forward"] == "torchvision" and lean["forward"] == "lean"
    assert lean["same_bits"] is True and lean["rois"] == 24
    level_copy = 3 * 256 * 32 * 48 * 4 / 2**20  # P2 of the batch in fp32
    assert ref["forward_peak_mb"] >= level_copy
    assert lean["forward_peak_mb"] < ref["forward_peak_mb"] - level_copy * 2 / 3 + 0.5
    # torchvision's backward holds the level's fp32 gradient beside its cast, the lean one one
    # image's (then the next's)
    assert lean["backward_peak_mb"] < ref["backward_peak_mb"] - level_copy * 2 / 3 + 0.5
    assert math.isclose(
        lean["forward_peak_ratio"], lean["forward_peak_mb"] / ref["forward_peak_mb"]
    )
    assert lean["ms"] > 0 and ref["ms"] > 0


def test_the_pooler_bench_runs_under_autocast_only(monkeypatch, tmp_path, capsys) -> None:
    with pytest.raises(UsageError, match="fp16 or bf16"):
        pooler_costs(device="cpu", amp="fp32")
    monkeypatch.setattr(pooler_bench, "POOLERS", {"mask": (14, 4)})  # 4 RoIs per image: fast
    out = tmp_path / "pooler.json"
    argv = ["pooler", "--images", "2", "--image-size", "64", "--repeats", "0", "--json", str(out)]
    assert bench_main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["pooler"], r["forward"], r["amp"], r["rois"]) for r in rows] == [
        ("mask", "torchvision", "bf16", 8),
        ("mask", "lean", "bf16", 8),
    ]
    assert rows[1]["same_bits"] is True
    lines, table = capsys.readouterr().out.split("\n\n")  # the JSON lines, then their table
    assert [json.loads(line) for line in lines.splitlines()] == rows
    assert table.strip() == pooler_bench.pooler_markdown(rows)

"""tools/train.py and tools/test.py as a user runs them: exit codes, one-line errors, eval."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from rcnn_dropit.checkpoint.checkpointer import Checkpointer
from rcnn_dropit.config import load_config
from rcnn_dropit.models import build_model
from tests.helpers import FASTER_CFG, REPO, assert_one_line_error, call_tool
from tests.helpers import run_tool as run_fresh
from tests.helpers import tiny_opts as shared_tiny_opts


def run_tool(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The tool as a user starts it: a fresh interpreter (slow: imports torch)."""
    return run_fresh(REPO / "tools" / script, *args, cwd=cwd)


def tiny_opts(root: Path) -> list[str]:
    return shared_tiny_opts(root)


@pytest.mark.slow
def test_train_bad_config_key_exits_2(tmp_path) -> None:
    proc = run_tool(
        "train.py", "--config", str(FASTER_CFG), "--opts", "solver.lrr=0.1", cwd=tmp_path
    )
    assert_one_line_error(proc, "solver.lrr")
    assert not (tmp_path / "outputs").exists()  # nothing written for a rejected config


def test_train_missing_config_and_used_dir_exit_2(tmp_path, tiny_shapes, capsys) -> None:
    proc = call_tool("train.py", "--config", str(tmp_path / "nope.yaml"), capsys=capsys)
    assert_one_line_error(proc, "nope.yaml")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    proc = call_tool(
        "train.py",
        "--config",
        str(FASTER_CFG),
        "--output-dir",
        str(run),
        "--opts",
        *tiny_opts(tiny_shapes),
        capsys=capsys,
    )
    assert_one_line_error(proc, str(run), "--resume auto", "--overwrite")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_shapes) -> Path:
    """A checkpoint of an untrained tiny Faster R-CNN, as the trainer writes them."""
    base = tmp_path_factory.mktemp("tools")
    cfg = load_config(FASTER_CFG, tiny_opts(tiny_shapes))
    torch.manual_seed(0)
    model, _ = build_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    saver = Checkpointer(base / "checkpoints", model, opt, sched, None, 4, cfg.to_dict())
    return saver.save(7, {"skipped_steps": 0})


@pytest.mark.slow
def test_test_tool_evaluates_checkpoint(tmp_path, checkpoint, tiny_shapes) -> None:
    out = tmp_path / "eval"
    opts = tiny_opts(tiny_shapes)
    proc = run_tool(
        "test.py",
        "--config",
        str(FASTER_CFG),
        "--checkpoint",
        str(checkpoint),
        "--output-dir",
        str(out),
        "--opts",
        *opts,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| bbox |" in proc.stdout
    result = json.loads((out / "eval.json").read_text())
    assert result["num_images"] == 4 and result["iter"] == 7
    assert 0.0 <= result["bbox"]["AP"] <= 1.0
    assert (out / "coco_results_bbox.json").is_file()


def test_test_tool_rejects_wrong_model_and_missing_file(
    tmp_path, checkpoint, tiny_shapes, capsys
) -> None:
    opts = tiny_opts(tiny_shapes)
    proc = call_tool(
        "test.py",
        "--config",
        str(FASTER_CFG),
        "--checkpoint",
        str(tmp_path / "missing.pth"),
        "--opts",
        *opts,
        capsys=capsys,
    )
    assert_one_line_error(proc, "missing.pth")
    proc = call_tool(
        "test.py",
        "--config",
        str(FASTER_CFG),
        "--checkpoint",
        str(checkpoint),
        "--output-dir",
        str(tmp_path / "e"),
        "--opts",
        *opts,
        "model.backbone=resnet34",
        capsys=capsys,
    )
    assert_one_line_error(proc, str(checkpoint), "missing keys")

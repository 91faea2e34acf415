"""The run directory: paths, the atomic writer, log.txt through logging, TensorBoard records."""

from __future__ import annotations

import json
import logging
import sys
import warnings

import pytest

from rcnn_dropit.atomic import write_atomic, write_json_atomic
from rcnn_dropit.config import load_config
from rcnn_dropit.metrics_file import read_metrics
from rcnn_dropit.run_dir import LOGGER_NAME, RunDir
from rcnn_dropit.tensorboard import scalars
from tests.helpers import FASTER_CFG

log = logging.getLogger(LOGGER_NAME)


def test_failed_atomic_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "eval.json"
    write_json_atomic(path, {"AP": 0.5})

    def half_then_full_disk(f):
        f.write(b'{"AP": 0.')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, half_then_full_disk)
    assert json.loads(path.read_text()) == {"AP": 0.5}
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]


def test_overwrite_removes_exactly_the_run_files(tmp_path):
    run = RunDir(tmp_path / "run")
    (run.checkpoints).mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "eval.json", "log.txt", "log.rank3.txt"):
        (run.root / name).write_text("x")
    (run.root / "events.out.tfevents.1.host").write_text("x")
    (run.root / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty; pass --resume auto"):
        run.check(resume=None, overwrite=False)
    run.check(resume=None, overwrite=True)
    assert [p.name for p in run.root.iterdir()] == ["notes.txt"]


def test_console_lines_and_warnings_reach_log_txt_once_the_folder_exists(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    run.start_logging()
    try:
        log.info("note: before the folder exists")  # e.g. a data note printed during checks
        run.create("name: tiny\n")
        log.info("training for 2 iterations")
        warnings.warn("a warning from somewhere", UserWarning, stacklevel=1)
        log.error("error: it broke", extra={"file_only": True})
    finally:
        run.stop_logging()
    out, err = capsys.readouterr()
    assert out == "note: before the folder exists\ntraining for 2 iterations\n"
    assert "UserWarning: a warning from somewhere" in err  # still on stderr, as before
    assert "error: it broke" not in out + err  # run_cli prints the console's error line
    lines = (run.root / "log.txt").read_text().splitlines()
    assert [line.split(" ", 3)[2:] for line in lines[:2]] == [
        ["INFO", "note: before the folder exists"],
        ["INFO", "training for 2 iterations"],
    ]
    assert "WARNING" in lines[2] and "UserWarning: a warning from somewhere" in lines[2]
    assert lines[-1].endswith("ERROR error: it broke")
    assert (run.root / "config.yaml").read_text() == "name: tiny\n"
    assert logging.getLogger(LOGGER_NAME).handlers == []  # nothing left behind after the run


def test_metrics_records_are_the_tensorboard_scalars():
    record = {
        "type": "eval",
        "iter": 20,
        "epoch": 1,
        "bbox": {"AP": 0.25, "APs": -1.0},
        "num_images": 4,
        "note": "text is left out",
    }
    assert scalars(record) == {"eval/bbox/AP": 0.25, "eval/bbox/APs": -1.0, "eval/num_images": 4.0}
    train = {"type": "train", "iter": 3, "loss": 1.5, "lr": 0.02, "peak_mem_mb": None}
    assert scalars(train) == {"train/loss": 1.5, "train/lr": 0.02}


def test_tensorboard_gets_the_same_records_as_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional 'tensorboard' extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    writer = run.open_metrics(tensorboard=True)
    writer.write({"type": "train", "iter": 1, "loss": 2.0, "lr": 0.25})
    writer.write({"type": "train", "iter": 2, "loss": 1.0, "lr": 0.5})
    writer.write({"type": "eval", "iter": 2, "bbox": {"AP": 0.5}, "num_images": 4})
    writer.write({"type": "memory", "iter": 2, "saved_mb": 12.5}, tensorboard_only=True)
    writer.close()
    assert [r["type"] for r in read_metrics(run.metrics)] == ["train", "train", "eval"]
    events = EventAccumulator(str(run.root))
    events.Reload()
    got = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    assert got == {
        "train/loss": [(1, 2.0), (2, 1.0)],
        "train/lr": [(1, 0.25), (2, 0.5)],  # float32 in event files: exact values
        "eval/bbox/AP": [(2, 0.5)],
        "eval/num_images": [(2, 4.0)],
        "memory/saved_mb": [(2, 12.5)],
    }


def test_tensorboard_without_the_package_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now fails
    cfg = load_config(FASTER_CFG, ["train.tensorboard=true"])
    assert cfg.train.tensorboard is True
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    with pytest.raises(ValueError) as info:
        run.open_metrics(tensorboard=True)
    assert str(info.value) == (
        "train.tensorboard: true needs the tensorboard package; pip install "
        "'rcnn-dropit[tensorboard]' (or pip install tensorboard), or set train.tensorboard=false"
    )

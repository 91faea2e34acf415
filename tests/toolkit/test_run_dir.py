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


RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.json", "log.txt", "log.rank3.txt")


def _old_run(root) -> RunDir:
    run = RunDir(root)
    (run.checkpoints).mkdir(parents=True)
    (run.checkpoints / "model_0000004.pth").write_text("old weights")
    for name in (*RUN_FILES, "events.out.tfevents.1.host"):
        (run.root / name).write_text("old")
    (run.root / "notes.txt").write_text("mine")
    return run


def _files(root) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_sets_exactly_the_run_files_aside_and_puts_them_back(tmp_path):
    run = _old_run(tmp_path / "run")
    before = _files(run.root)
    with pytest.raises(ValueError, match="is not empty; pass --resume auto"):
        run.check(resume=None, overwrite=False)
    run.check(resume=None, overwrite=True)
    assert sorted(p.name for p in run.root.iterdir()) == [".replaced", "notes.txt"]
    # a new run writes, then fails before it can stand alone: the old one comes back, whole
    (run.root / "config.yaml").write_text("new")
    (run.root / "log.txt").write_text("new")
    assert run.restore_replaced()
    assert _files(run.root) == before
    assert not run.restore_replaced()  # nothing set aside any more


def test_a_second_overwrite_keeps_the_run_the_first_set_out_to_replace(tmp_path):
    run = _old_run(tmp_path / "run")
    run.check(resume=None, overwrite=True)
    (run.root / "log.txt").write_text("first attempt, crashed")
    run.check(resume=None, overwrite=True)  # the first attempt's files go, the old run stays
    assert not (run.root / "log.txt").exists()
    assert (run.replaced / "log.txt").read_text() == "old"
    run.drop_replaced()  # the new run stands alone
    assert sorted(p.name for p in run.root.iterdir()) == ["notes.txt"]


def test_a_folder_holds_a_run_with_its_evaluation_or_checkpoint_files(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    (run.root / "log.txt").write_text("stopped before its first checkpoint")
    run.checkpoints.mkdir()
    assert not run.holds_a_run()
    (run.checkpoints / "last_checkpoint").write_text("garbage")
    assert run.holds_a_run()
    (run.checkpoints / "last_checkpoint").unlink()
    (run.root / "eval.json").write_text("{}")
    assert run.holds_a_run()


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

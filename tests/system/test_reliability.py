"""Reliability end to end: kill -9 and resume, a full disk, and every bad input through
tools/train.py and tools/test.py (exit code, one `error:` line, no half-made run directory)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rcnn_dropit.checkpoint.files import load_checkpoint
from rcnn_dropit.metrics_file import read_metrics
from tests.helpers import FASTER_CFG, MASK_CFG, TEST_PY, TRAIN_PY, coco_opts
from tests.helpers import tiny_opts as shared_tiny_opts

TRAIN, TEST = TRAIN_PY, TEST_PY
pytestmark = pytest.mark.slow  # every test runs the tools in child processes
LOSS_KEYS = ("loss", "loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg")


# ---- running the tools ---------------------------------------------------------------------


def _child(fn: Callable, args: tuple, log: str) -> None:
    """Body of a forked child: fds 1 and 2 go to log files, the exit code is fn's."""
    for fd, name in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{log}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    torch.set_num_threads(1)  # the same as OMP_NUM_THREADS=1 of the fresh interpreters below
    code = 1
    try:
        fn(*args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_script(script: Path, args: list[str], cwd: Path) -> None:
    os.chdir(cwd)
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


def start_tool(script: Path, *args: str, cwd: Path) -> tuple[multiprocessing.Process, Path]:
    """Start the tool as `python script args` would, in a forked child process.

    A child of this test process (fork) instead of a fresh interpreter: the script still runs
    as __main__ in its own process with its own exit code and output, without paying the
    8 s of importing torch again for every case.
    """
    log = cwd / f"log-{time.monotonic_ns()}"
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_child, args=(_run_script, (script, list(args), cwd), str(log)))
    proc.start()
    return proc, log


def finish(
    proc: multiprocessing.Process, log: Path, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Wait for a started tool and collect its exit code and output."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        pytest.fail(f"tool still running after {timeout} s")
    out = Path(f"{log}.out").read_text()
    err = Path(f"{log}.err").read_text()
    return subprocess.CompletedProcess(proc.name, proc.exitcode, out, err)


def run_tool(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run a tool to its end in a child process."""
    return finish(*start_tool(script, *args, cwd=cwd))


def error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The single `error: ...` line of a failed tool, checked for exit code and no traceback."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # the training or evaluation progress bar may stand before the error, nothing else
    bars = ("train:", "eval:")
    lines = [s for s in proc.stderr.splitlines() if s.strip() and not s.startswith(bars)]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> content hash of every file under folder."""
    return {
        str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ---- data and options ----------------------------------------------------------------------


def tiny_opts(root: Path, *extra: str) -> list[str]:
    """A seconds-long CPU run (tests/helpers.py) with a frozen ResNet-18 body."""
    return shared_tiny_opts(root, "model.trainable_layers=0", "model.norm=frozen_bn", *extra)


@pytest.fixture
def coco(tmp_path, tiny_shapes) -> tuple[Path, list[str]]:
    """A private copy of the shapes set read as data.dataset=coco, and the options for it."""
    root = tmp_path / "coco"
    shutil.copytree(tiny_shapes, root)
    opts = coco_opts(root)
    return root, opts


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _save_training_checkpoint(cfg_path: Path, opts: list[str], path: Path) -> None:
    """A complete training checkpoint, written by the trainer's checkpointer, of an untrained
    model."""
    from rcnn_dropit.checkpoint.checkpointer import Checkpointer
    from rcnn_dropit.config import load_config
    from rcnn_dropit.models import build_model

    cfg = load_config(cfg_path, opts)
    model, _ = build_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    saver = Checkpointer(path.parent, model, opt, sched, None, 4, cfg.to_dict())
    assert saver.save(1, {"skipped_steps": 0}) == path


@pytest.fixture(scope="module")
def faster_checkpoint(tmp_path_factory, tiny_shapes) -> Path:
    """A Faster R-CNN training checkpoint (made in a child: no torch work in this process)."""
    path = tmp_path_factory.mktemp("ckpt") / "model_0000001.pth"
    ctx = multiprocessing.get_context("fork")
    log = str(path.parent / "log")
    proc = ctx.Process(
        target=_child,
        args=(_save_training_checkpoint, (FASTER_CFG, tiny_opts(tiny_shapes), path), log),
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0, Path(f"{log}.err").read_text()
    return path


# ---- bad inputs: one error line, exit code 2, nothing left behind ---------------------------


def _yaml(tmp: Path, text: str) -> Path:
    path = tmp / "bad.yaml"
    path.write_text(f"_base_: {FASTER_CFG}\n{text}")
    return path


CONFIG_CASES = {
    # name: (config text after the base line, overrides, fragments of the message)
    "malformed_yaml": ("model:\n  arch: [fasterrcnn\n", [], ["bad.yaml", "line 4", "invalid YAML"]),
    "unknown_key": ("dropit:\n  gama: 0.5\n", [], ["dropit.gama", "did you mean 'dropit.gamma'"]),
    "wrong_type": ("", ["solver.batch_size=two"], ["solver.batch_size = 'two'", "an integer"]),
    "gamma_range": ("", ["dropit.gamma=1.5"], ["dropit.gamma = 1.5", "out of range", "< 1.0"]),
    "unknown_strategy": ("", ["dropit.strategy=topk"], ["'topk'", "is not one of", "mink"]),
    "yaml_code_tag": (
        "name: !!python/object/apply:os.system ['touch yaml-ran']\n",
        [],
        ["bad.yaml", "invalid YAML", "python/object/apply"],
    ),
    "dropit_option": (
        "dropit:\n  enabled: true\n  options: {bogus: 1}\n",
        [],
        ["DropIT option 'bogus'", "allowed"],
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_is_one_error_line_and_no_run_dir(case, tmp_path, tiny_shapes) -> None:
    text, overrides, fragments = CONFIG_CASES[case]
    out = tmp_path / "run"
    cfg = _yaml(tmp_path, text)
    proc = run_tool(
        TRAIN, "--config", str(cfg), "--output-dir", str(out),
        "--opts", *tiny_opts(tiny_shapes), *overrides, cwd=tmp_path,
    )  # fmt: skip
    line = error_line(proc)
    for fragment in fragments:
        assert fragment in line, line
    assert not out.exists()
    assert not (tmp_path / "yaml-ran").exists()  # safe loading: YAML tags never run code


def _missing_root(root: Path) -> list[str]:
    shutil.rmtree(root)
    return []


def _missing_ann(root: Path) -> list[str]:
    (root / "annotations/instances_val2017.json").unlink()
    return []


def _not_coco(root: Path) -> list[str]:
    (root / "annotations/instances_train2017.json").write_text('{"images": [], "annotations": []}')
    return []


def _missing_image(root: Path) -> list[str]:
    (root / "train2017/000003.png").unlink()
    return []


def _bad_category(root: Path) -> list[str]:
    edit_json(
        root / "annotations/instances_train2017.json",
        lambda d: d["annotations"][0].update(category_id=99),
    )
    return []


def _unreadable_images(root: Path) -> list[str]:
    # every training image: the first batch meets one, after the run dir was made
    for png in (root / "train2017").glob("*.png"):
        png.write_bytes(b"not a png")
    return ["solver.max_iters=1"]


DATA_CASES = {
    "missing_root": (_missing_root, ["data.root: folder", "/coco'", "does not exist"]),
    "missing_ann": (_missing_ann, ["data.val_ann", "instances_val2017.json' does not exist"]),
    "not_coco": (_not_coco, ["data.train_ann", "not a COCO file", "missing key 'categories'"]),
    "missing_image": (_missing_image, ["000003.png' does not exist", "skip_missing_images=true"]),
    "bad_category": (
        _bad_category,
        ["category_id 99", "not among the file's categories [1, 2, 3]"],
    ),
    "unreadable_image": (_unreadable_images, ["train2017/0000", ".png' cannot be read"]),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data_is_one_error_line_and_no_run_dir(case, tmp_path, coco) -> None:
    root, opts = coco
    spoil, fragments = DATA_CASES[case]
    extra = spoil(root)
    out = tmp_path / "run"
    proc = run_tool(
        TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(out), "--opts", *opts, *extra,
        cwd=tmp_path,
    )  # fmt: skip
    line = error_line(proc)
    for fragment in fragments:
        assert fragment in line, line
    assert not out.exists()


def test_skipped_images_and_degenerate_boxes_are_counted(tmp_path, coco) -> None:
    root, opts = coco
    (root / "train2017/000001.png").unlink()
    (root / "train2017/000002.png").write_bytes(b"")
    ann = root / "annotations/instances_train2017.json"
    doc = json.loads(ann.read_text())
    kept = [a for a in doc["annotations"] if a["image_id"] > 3]
    kept[0]["bbox"][2] = 0.0  # zero width
    kept[1]["bbox"][3] = -2.0  # negative height
    ann.write_text(json.dumps(doc))
    out = tmp_path / "run"
    proc = run_tool(
        TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(out),
        "--opts", *opts, "data.skip_missing_images=true", "solver.max_iters=1", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "note: data (train): skipped 2 missing or unreadable images; "
        "dropped 2 boxes with non-positive width or height" in proc.stdout
    )
    assert [r["iter"] for r in read_metrics(out / "metrics.jsonl") if r["type"] == "train"] == [1]


def test_used_output_dir_is_never_overwritten(tmp_path, tiny_shapes, coco) -> None:
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints/model_0000004.pth").write_bytes(b"old weights")
    (out / "metrics.jsonl").write_text('{"type": "train", "iter": 4}\n')

    def refused(*args: str) -> str:
        """The error line of a train run into ``out`` that must leave it as it was."""
        before = snapshot(out)
        proc = run_tool(
            TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(out), *args, cwd=tmp_path
        )  # fmt: skip
        assert snapshot(out) == before
        return error_line(proc)

    opts = tiny_opts(tiny_shapes)
    line = refused("--opts", *opts)
    assert f"output dir '{out}' is not empty" in line and "--overwrite" in line
    # an empty --resume is refused (it once started a fresh run over this one)
    assert "--resume: give 'auto'" in refused("--resume", "", "--opts", *opts)
    # --resume auto over a run whose checkpoints cannot be read: refused, not started afresh
    (out / "checkpoints/last_checkpoint").write_text("garbage")
    line = refused("--resume", "auto", "--opts", *opts)
    assert "holds a run (eval.json or checkpoint files) but no readable" in line
    # --overwrite with a bad input: the old run must survive the rejected new one, whether the
    # input is found bad only once training reads an image or before the folder is touched
    root, opts = coco
    extra = _unreadable_images(root)
    assert ".png' cannot be read" in refused("--overwrite", "--opts", *opts, *extra)
    _missing_ann(root)
    assert "data.val_ann" in refused("--overwrite", "--opts", *opts)


def test_resume_from_missing_or_foreign_checkpoint(
    tmp_path, tiny_shapes, faster_checkpoint
) -> None:
    out = tmp_path / "run"
    missing = tmp_path / "none.pth"
    proc = run_tool(
        TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(out), "--resume", str(missing),
        "--opts", *tiny_opts(tiny_shapes), cwd=tmp_path,
    )  # fmt: skip
    assert f"resume: checkpoint '{missing}' does not exist" in error_line(proc)
    assert not out.exists()
    proc = run_tool(
        TRAIN, "--config", str(MASK_CFG), "--output-dir", str(out),
        "--resume", str(faster_checkpoint), "--opts", *tiny_opts(tiny_shapes), cwd=tmp_path,
    )  # fmt: skip
    line = error_line(proc)
    assert f"--resume: checkpoint '{faster_checkpoint}'" in line
    assert "checkpoint is from another model" in line and "roi_heads.mask_head" in line
    assert not out.exists()


def test_test_tool_rejects_a_checkpoint_of_another_model(tmp_path, tiny_shapes, faster_checkpoint):
    out = tmp_path / "eval"
    proc = run_tool(
        TEST, "--config", str(MASK_CFG), "--checkpoint", str(faster_checkpoint),
        "--output-dir", str(out), "--opts", *tiny_opts(tiny_shapes), cwd=tmp_path,
    )  # fmt: skip
    line = error_line(proc)
    assert str(faster_checkpoint) in line and "checkpoint is from another model" in line
    assert not out.exists()


def test_test_tool_bad_output_or_images_leave_no_folder(tmp_path, coco):
    root, opts = coco
    faster_checkpoint = tmp_path / "ckpt/model_0000001.pth"
    proc = multiprocessing.get_context("fork").Process(
        target=_child,
        args=(_save_training_checkpoint, (FASTER_CFG, opts, faster_checkpoint), tmp_path / "log"),
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0, Path(f"{tmp_path / 'log'}.err").read_text()
    taken = tmp_path / "taken"
    taken.write_text("a file")
    proc = run_tool(
        TEST, "--config", str(FASTER_CFG), "--checkpoint", str(faster_checkpoint),
        "--output-dir", str(taken), "--opts", *opts, cwd=tmp_path,
    )  # fmt: skip
    assert f"--output-dir '{taken}' is a file, not a folder" in error_line(proc)
    assert taken.read_text() == "a file"
    for png in (root / "val2017").glob("*.png"):  # met only while evaluating, after the folder
        png.write_bytes(b"not a png")
    out = tmp_path / "eval"
    proc = run_tool(
        TEST, "--config", str(FASTER_CFG), "--checkpoint", str(faster_checkpoint),
        "--output-dir", str(out), "--opts", *opts, cwd=tmp_path,
    )  # fmt: skip
    assert ".png' cannot be read" in error_line(proc)
    assert not out.exists()


class _RunsCode:
    """Unpickling this would create a file: what a malicious checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_with_code_is_refused_without_running_it(tmp_path, tiny_shapes) -> None:
    marker, evil = tmp_path / "pickle-ran", tmp_path / "model_0000001.pth"
    torch.save({"model": {}, "iteration": 1, "payload": _RunsCode(marker)}, evil)
    out = tmp_path / "run"
    proc = run_tool(
        TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(out), "--resume", str(evil),
        "--opts", *tiny_opts(tiny_shapes), cwd=tmp_path,
    )  # fmt: skip
    line = error_line(proc)
    assert f"checkpoint '{evil}' is unreadable or corrupt" in line and "weights_only" in line
    assert not marker.exists() and not out.exists()


def test_nonfinite_loss_stops_or_skips(tmp_path, tiny_shapes) -> None:
    # lr 1e12 makes every loss NaN from iteration 2 on
    opts = tiny_opts(tiny_shapes, "solver.lr=1e12", "solver.warmup_iters=0", "solver.max_iters=3")
    out = tmp_path / "stop"
    proc = run_tool(
        TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(out), "--opts", *opts,
        cwd=tmp_path,
    )  # fmt: skip
    line = error_line(proc, code=1)
    assert line.startswith("error: non-finite loss at iteration 2: loss=nan, loss_classifier=nan")
    assert "loss_rpn_box_reg=" in line and "solver.nonfinite=skip" in line
    out = tmp_path / "skip"
    proc = run_tool(
        TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(out),
        "--opts", *opts, "solver.nonfinite=skip", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: non-finite loss at iteration 2: loss=nan" in proc.stdout
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "train"]
    assert [(r["iter"], r["skipped_steps"]) for r in records] == [(1, 0), (2, 1), (3, 2)]
    weights = load_checkpoint(out / "checkpoints/model_0000003.pth")["model"]
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())


# ---- a full disk -------------------------------------------------------------------------------


def test_disk_full_stops_with_one_line_and_keeps_the_last_checkpoint(tmp_path, tiny_shapes) -> None:
    out = tmp_path / "run"
    opts = tiny_opts(tiny_shapes, "solver.max_iters=3", "train.checkpoint_every_iters=1")
    proc, log = start_tool(
        TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(out), "--opts", *opts,
        cwd=tmp_path,
    )  # fmt: skip
    ckpts = out / "checkpoints"
    deadline = time.monotonic() + 180
    while not (ckpts / "model_0000001.pth").exists():
        assert proc.is_alive() and time.monotonic() < deadline, "no first checkpoint"
        time.sleep(0.01)
    # The writer's temp file for iteration 2 is a link to /dev/full: a real ENOSPC on write.
    (ckpts / f".model_0000002.pth.tmp-{proc.pid}").symlink_to("/dev/full")
    result = finish(proc, log)
    line = error_line(result, code=1)
    assert "could not write" in line and "model_0000002.pth" in line
    assert "No space left on device" in line and "previous checkpoint is kept" in line
    assert sorted(p.name for p in ckpts.iterdir()) == ["last_checkpoint", "model_0000001.pth"]
    assert (ckpts / "last_checkpoint").read_text() == "model_0000001.pth"
    assert load_checkpoint(ckpts / "model_0000001.pth")["iteration"] == 1
    # space is back: the run continues from the kept checkpoint
    result = run_tool(
        TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(out), "--resume", "auto",
        "--opts", *opts, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    train = [r["iter"] for r in read_metrics(out / "metrics.jsonl") if r["type"] == "train"]
    assert train == [1, 2, 3]


# ---- kill -9 while checkpointing, then resume --------------------------------------------------

KILL_ITERS = 8


def _kill_opts(tiny_shapes: Path) -> list[str]:
    return tiny_opts(
        tiny_shapes, f"solver.max_iters={KILL_ITERS}", "train.checkpoint_every_iters=1",
        "train.keep_last=2",
    )  # fmt: skip


def _popen_train(out: Path, tiny_shapes: Path, cwd: Path, *extra: str) -> subprocess.Popen:
    """tools/train.py in a fresh interpreter (one thread, as the forked children use)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--config", str(FASTER_CFG), "--output-dir", str(out), *extra]
    return subprocess.Popen(
        [sys.executable, str(TRAIN), *args, "--opts", *_kill_opts(tiny_shapes)],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _writing_or_written(ckpts: Path, pid: int) -> int:
    """Highest iteration whose checkpoint proc `pid` is writing or the pointer names (0: none)."""
    names = [p.name for p in ckpts.glob(f".model_*.pth.tmp-{pid}")] if ckpts.is_dir() else []
    pointer = ckpts / "last_checkpoint"
    if pointer.is_file():
        names.append(pointer.read_text())
    return max((int(n.split("_")[1][:7]) for n in names if n.strip()), default=0)


def _kill_while_checkpointing(
    proc: subprocess.Popen, ckpts: Path, target: int, rng: random.Random
) -> bool:
    """SIGKILL proc a random moment after its checkpoint of iteration `target` began to be
    written; False if it finished first."""
    deadline = time.monotonic() + 240
    while _writing_or_written(ckpts, proc.pid) < target:
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "no checkpoint writes seen"
        time.sleep(0.005)
    # 0 s: inside the write; later: rename, pointer update, the next step (a write is ~0.3 s)
    time.sleep(rng.uniform(0.0, 0.6))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def _check_checkpoints_load(ckpts: Path) -> list[int]:
    """Every model_*.pth on disk loads with weights_only=True; returns their iterations."""
    iterations = []
    for path in sorted(ckpts.glob("model_*.pth")):
        state = load_checkpoint(path)  # torch.load(weights_only=True)
        assert state["iteration"] == int(path.stem.split("_")[1])
        iterations.append(state["iteration"])
    return iterations


def test_sigkill_during_checkpoints_then_resume_equals_uninterrupted(tmp_path, tiny_shapes) -> None:
    # The uninterrupted run goes alongside (both use one thread: two cores).
    straight = tmp_path / "straight"
    reference = start_tool(
        TRAIN, "--config", str(FASTER_CFG), "--output-dir", str(straight),
        "--opts", *_kill_opts(tiny_shapes), cwd=tmp_path,
    )  # fmt: skip
    run = tmp_path / "killed"
    ckpts = run / "checkpoints"
    rng = random.Random(20240607)
    # one kill in each third of the run, at a random checkpoint and a random moment after it
    targets = [rng.choice(span) for span in ((1, 2), (3, 4), (5, 6))]
    kills = 0
    for target in targets:
        proc = _popen_train(run, tiny_shapes, tmp_path, *(["--resume", "auto"] if kills else []))
        if not _kill_while_checkpointing(proc, ckpts, target, rng):
            break
        kills += 1
        assert proc.returncode == -signal.SIGKILL
        assert _check_checkpoints_load(ckpts), "a kill left no loadable checkpoint"
    assert kills == 3
    proc = _popen_train(run, tiny_shapes, tmp_path, "--resume", "auto")
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    done = finish(*reference)
    assert done.returncode == 0, done.stderr[-3000:]

    assert _check_checkpoints_load(ckpts) == [KILL_ITERS - 1, KILL_ITERS]
    assert not list(ckpts.glob(".*tmp*")), "temp files of killed writers were not cleaned"
    assert (ckpts / "last_checkpoint").read_text() == f"model_{KILL_ITERS:07d}.pth"
    a = load_checkpoint(straight / f"checkpoints/model_{KILL_ITERS:07d}.pth")
    b = load_checkpoint(ckpts / f"model_{KILL_ITERS:07d}.pth")
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for index, buf in a["optimizer"]["state"].items():
        assert torch.equal(
            buf["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"]
        )

    ref, got = read_metrics(straight / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [(r["type"], r["iter"]) for r in got] == [
        *(("train", i) for i in range(1, KILL_ITERS + 1)),
        ("eval", KILL_ITERS),
    ]  # each iteration exactly once, nothing lost, nothing repeated
    for ra, rb in zip(ref, got, strict=True):
        for key in ("lr", *LOSS_KEYS) if ra["type"] == "train" else ("bbox",):
            assert ra[key] == rb[key], (ra["iter"], key)

"""A failure on rank 0 ends every rank of a 2-process gloo job with the same one-line message,
under torchrun and as plain processes given the launcher's variables (as `srun` starts them,
with no agent to stop the others): an unwritable output dir (setup), a checkpoint that cannot be
written, a corrupt annotation file, a metrics record that cannot be written mid-run, an
evaluation that fails on rank 0."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import (
    FASTER_CFG,
    REPO,
    TRAIN_PY,
    coco_opts,
    free_port,
    job_env,
    single_node,
    tiny_opts,
)

pytestmark = [pytest.mark.slow, pytest.mark.dist]
# A hang would last until the process-group timeout (30 min); the goal is every rank out in 60 s.
SPREAD_S = 60
JOB_TIMEOUT_S = 240


def _unwritable_output_dir(tmp: Path, tiny_shapes: Path) -> tuple[list[str], str, int]:
    blocker = tmp / "a-file"
    blocker.write_text("not a folder")
    run = blocker / "run"
    message = f"error: output dir '{run}' cannot be written"
    return (
        ["--output-dir", str(run), "--opts", *tiny_opts(tiny_shapes, "solver.max_iters=1")],
        message,
        2,
    )


def _checkpoint_write_fails(tmp: Path, tiny_shapes: Path) -> tuple[list[str], str, int]:
    run = tmp / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a file where the checkpoint folder belongs")
    args = ["--output-dir", str(run), "--resume", "auto"]
    message = f"error: could not write checkpoints into '{run / 'checkpoints'}': it exists"
    return [*args, "--opts", *tiny_opts(tiny_shapes, "solver.max_iters=1")], message, 1


def _corrupt_annotations(tmp: Path, tiny_shapes: Path) -> tuple[list[str], str, int]:
    root = tmp / "coco"
    root.mkdir()
    for split in ("train2017", "val2017"):
        (root / split).symlink_to(tiny_shapes / split)
    (root / "annotations").mkdir()
    train_ann = root / "annotations/instances_train2017.json"
    train_ann.write_bytes((tiny_shapes / "annotations/instances_train2017.json").read_bytes())
    val_ann = root / "annotations/instances_val2017.json"
    val_ann.write_text('{"images": [')  # cut off mid-write
    opts = coco_opts(root, "solver.max_iters=1")
    message = f"error: data.val_ann: '{val_ann}' is not valid JSON"
    return ["--output-dir", str(tmp / "run"), "--opts", *opts], message, 2


# tools/train.py with a failure planted on rank 0 only, where no input can cause one on demand.
RANK0_FAILS = """
import os, runpy, sys
sys.path.insert(0, {repo!r})
if os.environ["RANK"] == "0":
    if {where!r} == "bug":
        import rcnn_dropit.evaluation as evaluation

        def cocoeval(*args):
            return {{}}["AP"]  # a bug: KeyError

        evaluation._run_cocoeval = cocoeval
    elif {where!r} == "metrics":
        from rcnn_dropit.metrics_file import MetricsWriter

        real_write = MetricsWriter.write

        def write(self, record):
            if record.get("iter") == 2:
                raise OSError(28, "No space left on device", str(self.path))
            real_write(self, record)

        MetricsWriter.write = write
    else:
        import rcnn_dropit.evaluation as evaluation
        from rcnn_dropit.errors import UsageError

        def cocoeval(*args):
            raise UsageError("COCOeval found the detections unusable")

        evaluation._run_cocoeval = cocoeval
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


def _planted(where: str, message: str, code: int):
    def case(tmp: Path, tiny_shapes: Path) -> tuple[list[str], str, int, Path]:
        script = tmp / "train_rank0_fails.py"
        script.write_text(RANK0_FAILS.format(repo=str(REPO), where=where, train=str(TRAIN_PY)))
        opts = tiny_opts(tiny_shapes, "solver.max_iters=3", "train.checkpoint_every=0")
        return ["--output-dir", str(tmp / "run"), "--opts", *opts], message, code, script

    return case


CASES: dict[str, Callable[[Path, Path], tuple]] = {
    "unwritable_output_dir": _unwritable_output_dir,
    "checkpoint_write_fails": _checkpoint_write_fails,
    "corrupt_annotations": _corrupt_annotations,
    "metrics_write_fails": _planted("metrics", "error: [Errno 28] No space left on device", 1),
    "evaluation_fails": _planted("eval", "error: COCOeval found the detections unusable", 2),
}


def _case(name: str, tmp: Path, tiny_shapes: Path) -> tuple[list[str], str, int, Path]:
    """(train.py arguments, the expected error line's start, exit code, the script to run)."""
    args, message, code, *script = CASES[name](tmp, tiny_shapes)
    return args, message, code, script[0] if script else TRAIN_PY


def _plain_processes(script: Path, args: list[str], logs: Path) -> list[tuple[int, str, float]]:
    """Two `python tools/train.py` processes with RANK/WORLD_SIZE/... set and no agent:
    (exit code, stderr, seconds until exit) per rank."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = job_env(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        err = open(logs / f"rank{rank}.err", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(script), "--config", str(FASTER_CFG), *args]
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err), err))
    start = time.monotonic()
    ended: dict[int, float] = {}
    while len(ended) < 2 and time.monotonic() - start < JOB_TIMEOUT_S:
        for rank, (proc, _) in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.monotonic() - start
        time.sleep(0.2)
    for proc, err in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        err.close()
    assert len(ended) == 2, f"ranks {sorted(set((0, 1)) - set(ended))} still running: a hang"
    return [(procs[r][0].returncode, (logs / f"rank{r}.err").read_text(), ended[r]) for r in (0, 1)]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank0_failure_ends_plain_processes_with_one_message(case, tmp_path, tiny_shapes) -> None:
    args, message, code, script = _case(case, tmp_path, tiny_shapes)
    logs = tmp_path / "logs"
    logs.mkdir()
    (code0, err0, t0), (code1, err1, t1) = _plain_processes(script, args, logs)
    assert (code0, code1) == (code, code), err0[-2000:] + err1[-2000:]
    for stderr in (err0, err1):
        assert "Traceback" not in stderr, stderr[-3000:]
        lines = _error_lines(stderr)
        assert len(lines) == 1 and lines[0].startswith(message), stderr[-3000:]
    assert _error_lines(err0) == _error_lines(err1)  # the same message on both ranks
    assert abs(t0 - t1) < SPREAD_S


def test_a_bug_on_rank0_ends_every_rank_and_shows_its_traceback(tmp_path, tiny_shapes) -> None:
    # Not a usage error: rank 0's console shows the traceback (log.txt keeps it too), and the
    # other rank gets the same error instead of waiting for rank 0 in a collective.
    args, _, _, script = _planted("bug", "", 1)(tmp_path, tiny_shapes)
    logs = tmp_path / "logs"
    logs.mkdir()
    (code0, err0, t0), (code1, err1, t1) = _plain_processes(script, args, logs)
    assert (code0, code1) == (1, 1), err0[-2000:] + err1[-2000:]
    for stderr in (err0, err1):
        assert "Traceback" in stderr and "KeyError: 'AP'" in stderr, stderr[-3000:]
    assert ", in cocoeval" in err0  # rank 0's own frames, down to the planted bug
    assert "KeyError: 'AP'" in (tmp_path / "run" / "log.txt").read_text()
    assert abs(t0 - t1) < SPREAD_S


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank0_failure_ends_a_torchrun_job_with_its_message(case, tmp_path, tiny_shapes) -> None:
    args, message, code, script = _case(case, tmp_path, tiny_shapes)
    logs = tmp_path / "torchrun-logs"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *single_node(2),
        f"--log-dir={logs}",
        "--redirects=2",  # each rank's stderr to its own file
        str(script),
        "--config",
        str(FASTER_CFG),
        *args,
    ]
    try:
        proc = subprocess.run(
            cmd, env=job_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the torchrun job still ran after {JOB_TIMEOUT_S} s: a rank hangs")
    assert proc.returncode != 0
    rank_logs = sorted(logs.rglob("stderr.log"), key=lambda p: p.parent.name)
    assert [p.parent.name for p in rank_logs] == ["0", "1"], proc.stderr[-3000:]
    messages = []
    for log in rank_logs:
        stderr = log.read_text()
        assert "Traceback" not in stderr, stderr[-3000:]  # no gloo "connection closed" either
        lines = _error_lines(stderr)
        assert len(lines) == 1 and lines[0].startswith(message), stderr[-3000:]
        messages.append(lines[0])
    assert messages[0] == messages[1]
    # torchrun's summary: the first rank out exited with the tool's code; the other with the same
    # code, unless the agent's SIGTERM (sent once one rank is gone) reached it after its message.
    summary = proc.stderr
    assert summary.count(f"exitcode  : {code} ") + summary.count("exitcode  : -15 ") == 2, summary
    assert f"exitcode  : {code} " in summary.split("Root Cause")[1], summary

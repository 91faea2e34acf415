"""The shapes study driver: run list, skipping finished runs, resuming started ones, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rcnn_dropit.engine as engine
from rcnn_dropit.config import dump_config, load_config
from rcnn_dropit.study import run_study, study_runs


def test_runs_are_seed_major_with_names_and_overrides() -> None:
    runs = study_runs([1, 2])
    assert [r.name for r in runs[:4]] == [
        "baseline_s1",
        "mink_0.8_s1",
        "parallel_mink_0.8_s1",
        "random_0.8_s1",
    ]
    assert len(runs) == 8 and runs[4].name == "baseline_s2"
    assert "dropit.strategy=parallel_mink" in runs[2].overrides
    assert "train.seed=2" in runs[7].overrides


CONFIG = "configs/study/shapes_maskrcnn.yaml"


def _fake_run(run_dir: Path, overrides: tuple[str, ...], ap: float) -> None:
    """A finished run directory as training would leave it, without training."""
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(load_config(CONFIG, overrides), run_dir / "config.yaml")
    metrics = {k: ap for k in ("AP", "AP50", "AP75", "APs", "APm", "APl")}
    (run_dir / "eval.json").write_text(json.dumps({"bbox": metrics, "segm": metrics, "iter": 4}))


def test_study_skips_finished_resumes_started_and_reports(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "study"
    runs = study_runs([1])
    _fake_run(out / runs[0].name, runs[0].overrides, 0.5)  # finished before
    (out / runs[1].name).mkdir(parents=True)  # started, interrupted
    calls = []

    def fake_train(config, overrides, resume, output_dir):
        calls.append((Path(output_dir).name, resume))
        ap = 0.3 if "dropit.strategy=random" in overrides else 0.49
        _fake_run(Path(output_dir), tuple(overrides), ap)

    monkeypatch.setattr(engine, "train", fake_train)
    report = tmp_path / "shapes.md"
    markdown = run_study(CONFIG, out, seeds=[1], report=report)
    assert calls == [
        ("mink_0.8_s1", "auto"),
        ("parallel_mink_0.8_s1", None),
        ("random_0.8_s1", None),
    ]
    text = report.read_text()
    assert text.startswith("# Accuracy study on the synthetic shapes set")
    assert "tools/study.py --config configs/study/shapes_maskrcnn.yaml --seeds 1" in text
    assert "30.0 (-20.0)" in markdown  # random's box AP against the baseline's 50.0
    assert "49.0 (-1.0)" in markdown


def test_finished_run_with_another_config_is_refused(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "study"
    first = study_runs([1])[0]
    # an lr the study config does not use
    _fake_run(out / first.name, (*first.overrides, "solver.lr=0.123"), 0.5)
    monkeypatch.setattr(engine, "train", lambda *a, **k: pytest.fail("must not train"))
    with pytest.raises(ValueError, match="trained with a different config"):
        run_study(CONFIG, out, seeds=[1])


class _FakeProcess:
    """Stands in for a child process: the run 'finishes' after a set number of polls."""

    live: list[_FakeProcess] = []
    most_at_once = 0

    def __init__(self, run_dir: Path, overrides: tuple[str, ...], fail: bool) -> None:
        self.run_dir, self.overrides, self.fail, self.polls = run_dir, overrides, fail, 2
        self.exitcode: int | None = None
        _FakeProcess.live.append(self)
        _FakeProcess.most_at_once = max(_FakeProcess.most_at_once, len(_FakeProcess.live))

    def is_alive(self) -> bool:
        self.polls -= 1
        if self.polls > 0:
            return True
        if self.exitcode is None:
            self.exitcode = 1 if self.fail else 0
            if not self.fail:
                _fake_run(self.run_dir, self.overrides, 0.4)
            _FakeProcess.live.remove(self)
        return False

    def join(self) -> None:
        assert self.exitcode is not None


def test_side_by_side_runs_at_most_jobs_at_once_and_names_failures(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    import rcnn_dropit.study as study

    out = tmp_path / "study"
    started = []

    def fake_start(config, run, resume, run_dir, log, threads):
        started.append((run.name, resume, threads, log.name))
        return _FakeProcess(run_dir, run.overrides, fail=run.name == "random_0.8_s1")

    monkeypatch.setattr(study, "_start_run", fake_start)
    monkeypatch.setattr(study, "_POLL_SECONDS", 0.0)
    monkeypatch.setattr(study, "_cpu_count", lambda: 4)
    monkeypatch.setattr("rcnn_dropit.data.loader.ensure_dataset", lambda cfg: None)
    (out / "mink_0.8_s1").mkdir(parents=True)  # interrupted earlier: resumed
    report = tmp_path / "shapes.md"
    with pytest.raises(RuntimeError, match="study runs failed: random_0.8_s1"):
        run_study(CONFIG, out, seeds=[1], report=report, jobs=2)
    assert started == [
        ("baseline_s1", None, 2, "baseline_s1.log"),
        ("mink_0.8_s1", "auto", 2, "mink_0.8_s1.log"),
        ("parallel_mink_0.8_s1", None, 2, "parallel_mink_0.8_s1.log"),
        ("random_0.8_s1", None, 2, "random_0.8_s1.log"),
    ]
    assert _FakeProcess.most_at_once == 2
    assert "random_0.8_s1: FAILED (exit 1)" in capsys.readouterr().out
    text = report.read_text()  # the report is still written, naming the missing run
    assert "--jobs 2" in text and "random_0.8_s1" in text


def test_jobs_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="jobs: 0 must be >= 1"):
        run_study(CONFIG, tmp_path, seeds=[1], jobs=0)


def test_child_process_logs_error_and_exits_nonzero(tmp_path: Path) -> None:
    from rcnn_dropit.study import StudyRun, _start_run

    log = tmp_path / "bad.log"
    run = StudyRun("bad", ("solver.lr=-1",))
    proc = _start_run(CONFIG, run, None, tmp_path / "bad", log, threads=1)
    proc.join(timeout=120)
    assert proc.exitcode == 1
    assert "solver.lr" in log.read_text()
    assert not (tmp_path / "bad").exists()  # nothing trained, nothing left behind

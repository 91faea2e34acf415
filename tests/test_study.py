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
    _fake_run(out / first.name, (*first.overrides, "solver.lr=0.01"), 0.5)
    monkeypatch.setattr(engine, "train", lambda *a, **k: pytest.fail("must not train"))
    with pytest.raises(ValueError, match="trained with a different config"):
        run_study(CONFIG, out, seeds=[1])

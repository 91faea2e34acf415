"""The study driver: plan, run order, skip/resume, pretraining dependency, report, statistics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import instruments.measure.study as study
from instruments.measure.study import run_study
from instruments.measure.study_plan import PlanError, StudyRun, load_plan, plan_runs
from rcnn_dropit.config import config_yaml, load_config
from rcnn_dropit.report.paired import paired_diff, spread, t95
from tests.helpers import REPO


def write_plan(tmp_path: Path, groups: str | None = None) -> Path:
    """A plan of two regimes over the real study configs, the backbone file inside tmp_path."""
    finetune = tmp_path / "finetune.yaml"
    finetune.write_text(
        f"_base_: {REPO / 'configs/study/finetune.yaml'}\n"
        f"model:\n  backbone_weights: {tmp_path / 'backbone.pth'}\n"
    )
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        f"out: {tmp_path / 'runs'}\nreport: {tmp_path / 'report' / 'shapes.md'}\n"
        f"notes: {tmp_path / 'notes.md'}\n"
        f"pretrain: {{config: {REPO / 'configs/study/pretrain.yaml'}, for: [finetune]}}\n"
        f"regimes: {{scratch: {REPO / 'configs/study/scratch.yaml'}, finetune: {finetune}}}\n"
        "settings:\n"
        "  baseline: [dropit.enabled=false]\n"
        "  mink_0.8: [dropit.enabled=true, dropit.strategy=mink, dropit.gamma=0.8]\n"
        "  random_0.8: [dropit.enabled=true, dropit.strategy=random, dropit.gamma=0.8]\n"
        + (
            groups
            or "groups:\n"
            "  - {regimes: [scratch, finetune], settings: [baseline, mink_0.8], seeds: [1, 2]}\n"
            "  - {regimes: [scratch], settings: [random_0.8], seeds: [1]}\n"
        )
    )
    return plan


def test_runs_start_with_pretraining_then_go_group_by_group_seed_major(tmp_path: Path) -> None:
    runs = plan_runs(load_plan(write_plan(tmp_path)))
    assert [r.name for r in runs] == [
        "pretrain/pretrain",
        "scratch/baseline_s1",
        "scratch/mink_0.8_s1",
        "finetune/baseline_s1",
        "finetune/mink_0.8_s1",
        "scratch/baseline_s2",
        "scratch/mink_0.8_s2",
        "finetune/baseline_s2",
        "finetune/mink_0.8_s2",
        "scratch/random_0.8_s1",
    ]
    backbone = str(tmp_path / "backbone.pth")
    assert runs[0].exports == backbone and runs[0].needs is None
    assert [r.needs for r in runs[1:5]] == [None, None, backbone, backbone]
    assert runs[2].overrides == (
        "dropit.enabled=true",
        "dropit.strategy=mink",
        "dropit.gamma=0.8",
        "train.seed=1",
        "name=mink_0.8_s1",
    )


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ("groups:\n  - {regimes: [scratch], settings: [mink_0.9], seeds: [1]}\n", "mink_0.9"),
        ("groups:\n  - {regimes: [cifar], settings: [baseline], seeds: [1]}\n", "cifar"),
        ("groups:\n  - {regimes: [scratch], settings: [baseline], seeds: []}\n", "seeds"),
        ("groups: []\nbudget: 4\n", "unknown key"),
        ("groups: []\nconfigs: {mink_0.9: configs/maskrcnn_g0.8.yaml}\n", "configs: 'mink_0.9'"),
        ("groups: []\nconfigs: {mink_0.8: configs/nothing.yaml}\n", "'configs/nothing.yaml'"),
        ("groups: [scratch]\n", r"groups\[0\]: must be a mapping with keys regimes"),
        ("groups:\n  - {regimes: [scratch], settings: [baseline], seed: [1]}\n", "groups\\[0\\]"),
        ("groups:\n  - {regimes: [scratch], settings: [baseline], seeds: 1}\n", "seeds: must be"),
        ("groups: {a: 1}\n", "groups must be a list of mappings"),
        ("groups: [\n", "line 1.: invalid YAML"),
        ("groups: []\npairs: [[mink_0.8, mink_0.9]]\n", r"pairs\[0\] \['mink_0.8', 'mink_0.9'\]"),
        ("groups: []\npairs: [mink_0.8]\n", r"pairs\[0\] 'mink_0.8': must be \[setting, other\]"),
        ("groups: []\npairs: {a: b}\n", "pairs must be a list"),
    ],
)
def test_bad_plans_name_the_problem(tmp_path: Path, groups: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        load_plan(write_plan(tmp_path, groups))


def test_a_bad_setting_stops_the_study_before_any_run(tmp_path: Path, monkeypatch) -> None:
    plan = write_plan(tmp_path, "groups:\n  - {regimes: [scratch], settings: [typo], seeds: [1]}\n")
    plan.write_text(
        plan.read_text().replace("settings:\n", "settings:\n  typo: [dropit.gama=0.8]\n")
    )
    monkeypatch.setattr(study, "_schedule", lambda *a: pytest.fail("a run was scheduled"))
    with pytest.raises(PlanError, match=r"study run scratch/typo_s1: .*dropit.gama.*dropit.gamma"):
        run_study(plan)
    broken = tmp_path / "broken.yaml"
    broken.write_text(plan.read_text().replace("configs/study/scratch.yaml", "configs/nope.yaml"))
    with pytest.raises(PlanError, match="regimes.scratch: file .*nope.yaml' does not exist"):
        load_plan(broken)


def _fake_run(run: StudyRun, run_dir: Path, ap: float, evals: tuple[int, ...] = ()) -> None:
    """A finished run directory as training would leave it, without training."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml(load_config(run.config, run.overrides)))
    metrics = {k: ap for k in ("AP", "AP50", "AP75", "APs", "APm", "APl")}
    (run_dir / "eval.json").write_text(json.dumps({"bbox": metrics, "segm": metrics, "iter": 8}))
    records = [{"type": "train", "iter": 4, "loss": 1.0, "images_per_sec": 2.0}]
    records += [
        {"type": "eval", "iter": it, "bbox": {"AP": ap * it / 8}, "segm": {"AP": ap * it / 8}}
        for it in evals
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


class _FakeProcess:
    """Stands in for a child process: the run 'finishes' after a set number of polls."""

    def __init__(self, run: StudyRun, run_dir: Path, ap: float, fail: bool, live: list) -> None:
        self.run, self.run_dir, self.ap, self.fail, self.live = run, run_dir, ap, fail, live
        self.polls = 2
        self.exitcode: int | None = None
        live.append(self)

    def is_alive(self) -> bool:
        self.polls -= 1
        if self.polls > 0:
            return True
        if self.exitcode is None:
            self.exitcode = 1 if self.fail else 0
            if not self.fail:
                _fake_run(self.run, self.run_dir, self.ap, evals=(4, 8))
            self.live.remove(self)
        return False

    def join(self) -> None:
        assert self.exitcode is not None


def _fake_scheduler(monkeypatch, fail: str = "", gpus: int = 0) -> list:
    started, live, most = [], [], [0]
    seeds_ap = {"baseline": 0.50, "mink_0.8": 0.495, "random_0.8": 0.30}

    def fake_start(run, resume, run_dir, log, threads, gpu):
        setting, _, seed = Path(run.name).name.rpartition("_s")
        if run.needs is not None:
            assert Path(run.needs).is_file(), f"{run.name} started before its backbone existed"
        started.append((run.name, resume, threads, gpu))
        ap = seeds_ap.get(setting, 0.4) + 0.01 * (int(seed) if seed.isdigit() else 0)
        proc = _FakeProcess(run, run_dir, ap, fail=run.name == fail, live=live)
        most[0] = max(most[0], len(live))
        return proc

    def fake_export(run_dir, target):
        Path(target).write_bytes(b"weights")
        return True

    monkeypatch.setattr(study, "_start_run", fake_start)
    monkeypatch.setattr(study, "_export", fake_export)
    monkeypatch.setattr(study, "_POLL_SECONDS", 0.0)
    monkeypatch.setattr(study, "_cpu_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr("rcnn_dropit.data.loader.ensure_dataset", lambda cfg: None)
    started.append(most)
    return started


def test_study_skips_finished_resumes_started_waits_for_backbone_and_reports(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    plan_file = write_plan(tmp_path)
    plan = load_plan(plan_file)
    runs = {r.name: r for r in plan_runs(plan)}
    out = tmp_path / "runs"
    _fake_run(runs["scratch/baseline_s1"], out / "scratch/baseline_s1", 0.51)  # finished
    (out / "scratch/mink_0.8_s1").mkdir(parents=True)  # started, interrupted
    (tmp_path / "notes.md").write_text("### Findings\n\nWritten by hand.\n")
    started = _fake_scheduler(monkeypatch, fail="scratch/random_0.8_s1", gpus=2)
    most = started.pop()
    with pytest.raises(RuntimeError, match="study runs failed: scratch/random_0.8_s1"):
        run_study(plan_file, jobs=2)
    names = [s[0] for s in started]
    assert "scratch/baseline_s1" not in names and len(names) == 9
    assert started[0] == ("pretrain/pretrain", None, 1, 0)  # one thread: reproducible weights
    assert started[1] == ("scratch/mink_0.8_s1", "auto", 2, 1)  # resumed, second GPU
    assert names.index("pretrain/pretrain") < names.index("finetune/baseline_s1")
    assert most[0] == 2
    assert "scratch/random_0.8_s1: FAILED (exit 1)" in capsys.readouterr().out
    times = (out / "study_times.jsonl").read_text().splitlines()
    assert len(times) == 9 and json.loads(times[0])["jobs"] == 2
    # the interrupted run's line holds its last segment only, and says so
    resumed = {r["run"]: r["resumed"] for r in map(json.loads, times)}
    assert resumed["scratch/mink_0.8_s1"] is True
    assert sum(resumed.values()) == 1

    text = (tmp_path / "report/shapes.md").read_text()
    assert "## Regime: scratch" in text and "## Regime: finetune" in text
    # scratch mink: seeds 1, 2 at 50.5 / 51.5 against baseline 51.0 (finished before) / 52.0
    assert "| mink_0.8 | 1,2 | 51.0 ± 0.7 | 51.0 ± 0.7 | -0.5 [-0.5, -0.5] (n=2)" in text
    verdict = text[text.index("### scratch") : text.index("## Goal")]
    # both planned seeds finished, and the interval of the two differences lies inside ±1
    assert "| mink_0.8 | 2 of 2 | -0.5 [-0.5, -0.5] | **keeps** |" in verdict
    assert "| keeps AP |" in verdict
    assert "| random_0.8 | 0 of 1 | - | - | - | - | not measured yet |" in verdict  # it failed
    assert "mink_0.8_backbone" not in text  # a verdict row only where the plan trains it
    assert "| baseline | 52.0 / 52.0 |" not in text  # the pre-finished baseline had no evals
    assert "iter 4 | iter 8" in text
    assert text.index("## Verdict") < text.index("Written by hand.") < text.index("## Regime")


def test_a_failed_pretraining_leaves_its_dependents_unrun(tmp_path: Path, monkeypatch) -> None:
    plan_file = write_plan(tmp_path)
    started = _fake_scheduler(monkeypatch, fail="pretrain/pretrain")
    started.pop()
    with pytest.raises(RuntimeError, match="finetune/baseline_s1") as err:
        run_study(plan_file, jobs=1)
    assert "pretrain/pretrain" in str(err.value)
    assert not any(name.startswith("finetune/") for name, *_ in started)


def test_finished_run_with_another_config_is_refused(tmp_path: Path, monkeypatch) -> None:
    plan_file = write_plan(tmp_path)
    run = plan_runs(load_plan(plan_file))[1]
    other = StudyRun(run.name, run.config, (*run.overrides, "solver.lr=0.123"))
    _fake_run(other, tmp_path / "runs" / run.name, 0.5)
    _fake_scheduler(monkeypatch)
    with pytest.raises(ValueError, match=r"different config .*solver.lr: now 0.02, run has 0.123"):
        run_study(plan_file, jobs=1)


def test_regimes_option_trains_only_those_and_their_pretraining(
    tmp_path: Path, monkeypatch
) -> None:
    plan_file = write_plan(tmp_path)
    started = _fake_scheduler(monkeypatch)
    started.pop()
    run_study(plan_file, jobs=1, regimes=["scratch"])
    assert [s[0] for s in started] == [
        "scratch/baseline_s1",
        "scratch/mink_0.8_s1",
        "scratch/baseline_s2",
        "scratch/mink_0.8_s2",
        "scratch/random_0.8_s1",
    ]
    assert {s[2] for s in started} == {4}  # one job gets the 4 (faked) cores
    started.clear()
    run_study(plan_file, jobs=1, regimes=["finetune"], threads=1)
    assert [s[0] for s in started][:2] == ["pretrain/pretrain", "finetune/baseline_s1"]
    assert {s[2] for s in started} == {1}


def test_a_key_added_since_a_run_counts_with_its_default(tmp_path: Path, monkeypatch) -> None:
    import yaml

    plan_file = write_plan(tmp_path)
    run = plan_runs(load_plan(plan_file))[1]
    run_dir = tmp_path / "runs" / run.name
    _fake_run(run, run_dir, 0.5)
    old = yaml.safe_load((run_dir / "config.yaml").read_text())
    del old["model"]["fpn_channels"]  # written before the key existed; the schema default is 256
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old))
    _fake_scheduler(monkeypatch)
    with pytest.raises(ValueError, match="model.fpn_channels: now 64, run has 256"):
        study._check_same_config(run_dir, run.config, run.overrides)
    del old["train"]["eval_every_iters"]  # the default (0) is not what the study uses either
    old["model"]["fpn_channels"] = 64
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(ValueError, match="train.eval_every_iters: now 400, run has 0"):
        study._check_same_config(run_dir, run.config, run.overrides)
    old["train"]["eval_every_iters"] = 400
    del old["train"]["tensorboard"]  # added later, default false: the same setting
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old))
    study._check_same_config(run_dir, run.config, run.overrides)


def test_jobs_and_regimes_are_checked(tmp_path: Path) -> None:
    plan_file = write_plan(tmp_path)
    with pytest.raises(ValueError, match="jobs: 0 must be >= 1"):
        run_study(plan_file, jobs=0)
    with pytest.raises(ValueError, match="threads: 0 must be >= 1"):
        run_study(plan_file, threads=0)
    with pytest.raises(PlanError, match=r"--regimes \['cifar'\]"):
        run_study(plan_file, regimes=["cifar"])


@pytest.mark.slow
def test_child_process_logs_error_and_exits_nonzero(tmp_path: Path) -> None:
    from instruments.measure.study import _start_run

    log = tmp_path / "bad.log"
    run = StudyRun("scratch/bad", str(REPO / "configs/study/scratch.yaml"), ("solver.lr=-1",))
    proc = _start_run(run, None, tmp_path / "bad", log, threads=1, gpu=None)
    proc.join(timeout=120)
    assert proc.exitcode == 1
    assert "solver.lr" in log.read_text()
    assert not (tmp_path / "bad").exists()  # nothing trained, nothing left behind


def test_paired_statistics() -> None:
    d = paired_diff({1: 3.0, 2: 5.0, 3: 7.0}, {1: 2.0, 2: 3.0, 3: 4.0, 4: 9.0})
    assert d is not None and d.n == 3 and d.mean == pytest.approx(2.0)
    half = 4.303 * 1.0 / 3**0.5  # t(2) * sd of the differences (1, 2, 3) / sqrt(3)
    assert (d.low, d.high) == (pytest.approx(2.0 - half), pytest.approx(2.0 + half))
    one = paired_diff({1: 1.0, 5: 2.0}, {1: 0.5})
    assert one is not None and (one.n, one.mean, one.low) == (1, 0.5, None)
    assert paired_diff({1: 1.0}, {2: 1.0}) is None
    s = spread([1.0, 3.0])
    assert s is not None and (s.mean, s.std) == (2.0, pytest.approx(2**0.5))
    assert t95(11) == 2.228 and t95(100) == 1.96
    with pytest.raises(ValueError):
        t95(0)


def test_a_stopped_study_takes_its_running_children_down(tmp_path: Path, monkeypatch) -> None:
    # Ctrl-C or kill of the parent must not leave trainings running orphaned (they would write
    # into run directories the next study resumes).
    import multiprocessing
    import signal

    plan_file = write_plan(tmp_path)
    _fake_scheduler(monkeypatch)
    children = []

    def real_start(run, resume, run_dir, log, threads, gpu):
        proc = multiprocessing.get_context("spawn").Process(target=signal.pause)
        proc.start()
        children.append(proc)
        return proc

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "_start_run", real_start)
    monkeypatch.setattr(study.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_study(plan_file, jobs=2)
    assert len(children) == 2
    for proc in children:
        assert not proc.is_alive() and proc.exitcode == -signal.SIGTERM


def test_report_shows_the_gradient_fidelity_tables_when_measured(tmp_path: Path) -> None:
    from instruments.measure.study_report import _grad_groups

    path = tmp_path / "shapes_grad_groups" / "finetune.json"
    path.parent.mkdir()
    assert _grad_groups(path) == []  # not measured: nothing to show
    cell = {"cosine": 0.9512, "norm_ratio": 0.876}
    path.write_text(json.dumps({"run": "runs/b_s1", "init": {"mink_0.8": {"FPN": cell}}}))
    lines = _grad_groups(path)
    assert "`python tools/grad_groups.py --run runs/b_s1 --json" in lines[0]
    assert lines[2] == "At initialisation:"
    assert "| mink_0.8 | 0.951 / 0.88 |" in lines


def test_the_runs_finished_sentence_counts_what_the_time_table_counts(tmp_path: Path) -> None:
    from instruments.measure.study_report import finished_runs_sentence, time_account

    plan = load_plan(write_plan(tmp_path))
    out = tmp_path / "runs"
    runs = {r.name: r for r in plan_runs(plan)}
    finished = ["pretrain/pretrain", "scratch/baseline_s1", "finetune/mink_0.8_s2"]
    for name in finished:
        _fake_run(runs[name], out / name, 0.5)
    (out / "scratch/mink_0.8_s1").mkdir(parents=True)  # started, not finished: counted nowhere
    _fake_run(runs["scratch/baseline_s1"], out / "scratch/baseline_s9", 0.5)  # not in the plan
    sentence = finished_runs_sentence(plan)
    assert sentence == (
        f"3 of {len(runs)} planned runs finished (the backbone pretraining, and 2 of "
        f"{len(runs) - 1} runs in the regimes). The time table also counts 1 finished run that "
        "the plan does not name: scratch/baseline_s9."
    )
    total = next(line for line in time_account(plan, 2) if line.startswith("| **all** |"))
    assert total.split("|")[2].strip() == "4"  # 3 planned + 1 not planned, as the sentence says

    for name in finished:  # the pretraining is a planned run like the others, counted alike
        (out / name / "eval.json").unlink()
    assert finished_runs_sentence(plan).startswith(
        f"0 of {len(runs)} planned runs finished (not the pretraining, and 0 of"
    )

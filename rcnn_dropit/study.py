"""The accuracy study: the same Mask R-CNN run for several DropIT settings and seeds, resumable.

Each run is an ordinary run directory under the study folder. A run with an ``eval.json`` is
finished and skipped; a run with checkpoints is resumed; so re-running the study after an
interruption continues where it stopped. The report of all runs is written at the end.

With ``jobs > 1`` the runs train side by side in child processes that share the cores. On a small
CPU this is faster than one run after another: part of each step (RoIAlign's backward, NMS, the
Python between ops) uses one core only, and two one-thread runs fill the gaps of each other.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from rcnn_dropit.report import build_report

# (label, overrides): the paper's contrast at gamma=0.8 against the exact baseline.
DEFAULT_SETTINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("baseline", ("dropit.enabled=false",)),
    ("mink_0.8", ("dropit.enabled=true", "dropit.strategy=mink", "dropit.gamma=0.8")),
    (
        "parallel_mink_0.8",
        ("dropit.enabled=true", "dropit.strategy=parallel_mink", "dropit.gamma=0.8"),
    ),
    ("random_0.8", ("dropit.enabled=true", "dropit.strategy=random", "dropit.gamma=0.8")),
)


@dataclass(frozen=True)
class StudyRun:
    """One run of the study: its folder name and config overrides."""

    name: str
    overrides: tuple[str, ...]


def study_runs(
    seeds: Sequence[int], settings: Sequence[tuple[str, Sequence[str]]] = DEFAULT_SETTINGS
) -> list[StudyRun]:
    """All runs, seed-major so that a cut-short study still has every setting at seed 1."""
    return [
        StudyRun(f"{label}_s{seed}", (*overrides, f"train.seed={seed}", f"name={label}_s{seed}"))
        for seed in seeds
        for label, overrides in settings
    ]


def run_study(
    config: str | Path,
    out_root: str | Path,
    seeds: Sequence[int] = (1, 2),
    report: str | Path | None = None,
    jobs: int = 1,
) -> str:
    """Train every missing run of the study (``jobs`` at a time), then write the grouped report."""
    if jobs < 1:
        raise ValueError(f"jobs: {jobs} must be >= 1")
    out_root = Path(out_root)
    runs = study_runs(seeds)
    todo = []
    for i, run in enumerate(runs, 1):
        run_dir = out_root / run.name
        if (run_dir / "eval.json").is_file():
            _check_same_config(run_dir, config, run.overrides)
            print(f"[{i}/{len(runs)}] {run.name}: finished, skipped", flush=True)
        else:
            todo.append((i, run))
    if jobs == 1:
        failed = _train_in_turn(config, out_root, todo, len(runs))
    else:
        failed = _train_side_by_side(config, out_root, todo, len(runs), jobs)
    dirs = [out_root / r.name for r in runs]
    markdown = build_report(dirs, baseline=dirs[0], out=report, group_seeds=True)
    if report is not None:
        Path(report).write_text(_header(config, seeds, jobs) + markdown)
    if failed:
        raise RuntimeError(
            f"study runs failed: {', '.join(failed)}; their logs are in {out_root}; "
            "run the study again to resume them"
        )
    return markdown


def _train_in_turn(
    config: str | Path, out_root: Path, todo: list[tuple[int, StudyRun]], total: int
) -> list[str]:
    """Train the runs one after another in this process (errors propagate)."""
    from rcnn_dropit.engine import train  # the engine pulls in torchvision; keep import lazy

    for i, run in todo:
        run_dir = out_root / run.name
        resume = _resume_flag(run_dir)
        print(f"[{i}/{total}] {run.name}: {'resuming' if resume else 'training'}", flush=True)
        start = time.time()
        train(config, overrides=run.overrides, resume=resume, output_dir=run_dir)
        print(f"[{i}/{total}] {run.name}: done in {time.time() - start:.0f} s", flush=True)
    return []


def _train_side_by_side(
    config: str | Path,
    out_root: Path,
    todo: list[tuple[int, StudyRun]],
    total: int,
    jobs: int,
) -> list[str]:
    """Train the runs in up to ``jobs`` child processes at once; returns the names that failed."""
    from rcnn_dropit.config import load_config
    from rcnn_dropit.data.loader import ensure_dataset

    if todo:  # generate the dataset once here, not in two children at the same moment
        ensure_dataset(load_config(config, todo[0][1].overrides))
    out_root.mkdir(parents=True, exist_ok=True)
    threads = max(1, _cpu_count() // jobs)
    pending, running, failed = list(todo), [], []
    while pending or running:
        while pending and len(running) < jobs:
            i, run = pending.pop(0)
            run_dir = out_root / run.name
            resume = _resume_flag(run_dir)
            log = out_root / f"{run.name}.log"
            print(
                f"[{i}/{total}] {run.name}: {'resuming' if resume else 'training'} "
                f"({threads} thread(s), log {log})",
                flush=True,
            )
            proc = _start_run(config, run, resume, run_dir, log, threads)
            running.append((i, run, proc, time.time()))
        time.sleep(_POLL_SECONDS)
        for entry in list(running):
            i, run, proc, start = entry
            if proc.is_alive():
                continue
            proc.join()
            running.remove(entry)
            took = time.time() - start
            if proc.exitcode == 0:
                print(f"[{i}/{total}] {run.name}: done in {took:.0f} s", flush=True)
            else:
                failed.append(run.name)
                print(
                    f"[{i}/{total}] {run.name}: FAILED (exit {proc.exitcode}) after {took:.0f} s",
                    flush=True,
                )
    return failed


_POLL_SECONDS = 2.0


def _resume_flag(run_dir: Path) -> str | None:
    """A started run (its folder exists) resumes from its newest checkpoint, if it has one."""
    return "auto" if run_dir.exists() else None


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _start_run(
    config: str | Path,
    run: StudyRun,
    resume: str | None,
    run_dir: Path,
    log: Path,
    threads: int,
) -> multiprocessing.process.BaseProcess:
    """One run in a fresh (spawned) process; its output goes to ``log``."""
    proc = multiprocessing.get_context("spawn").Process(
        target=_child_train,
        args=(str(config), run.overrides, resume, str(run_dir), str(log), threads),
        name=run.name,
    )
    proc.start()
    return proc


def _child_train(
    config: str,
    overrides: tuple[str, ...],
    resume: str | None,
    run_dir: str,
    log: str,
    threads: int,
) -> None:
    """Child-process body: send output to the log, limit threads, train; exit 1 on error."""
    with open(log, "a", buffering=1) as stream:
        os.dup2(stream.fileno(), 1)
        os.dup2(stream.fileno(), 2)
        sys.stdout = sys.stderr = stream
        torch.set_num_threads(threads)
        from rcnn_dropit.engine import train

        try:
            train(config, overrides=overrides, resume=resume, output_dir=run_dir)
        except Exception as exc:  # the parent reports the exit code; the log keeps the trace
            import traceback

            traceback.print_exc()
            print(f"error: {exc}", flush=True)
            sys.exit(1)


def _check_same_config(run_dir: Path, config: str | Path, overrides: Sequence[str]) -> None:
    """A finished run counts only if it was trained with the study's current config."""
    from rcnn_dropit.config import load_config

    want = load_config(config, overrides).to_dict()
    have = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    for cfg in (want, have):
        cfg.get("train", {}).pop("output_dir", None)
    if want != have:
        raise ValueError(
            f"study run '{run_dir}' was trained with a different config than {config} gives now; "
            "move it away (or restore the config) so the study does not mix settings"
        )


def _header(config: str | Path, seeds: Sequence[int], jobs: int = 1) -> str:
    from rcnn_dropit.config import load_config

    num_val = load_config(config).data.shapes.num_val
    return (
        "# Accuracy study on the synthetic shapes set\n\n"
        f"Produced by `python tools/study.py --config {config} --seeds "
        f"{' '.join(map(str, seeds))} --jobs {jobs}` (or `make study`) on {platform.machine()} "
        f"{platform.system()}, {_cpu_count()} CPU cores, torch {torch.__version__}. "
        "Every run trains the same config for the same number of iterations; only the DropIT "
        "setting and the seed differ. AP is COCOeval on the "
        f"{num_val} validation images of the shapes set.\n\n"
    )

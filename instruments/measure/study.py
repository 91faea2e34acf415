"""The accuracy study: the runs of a plan (instruments.measure.study_plan) trained resumably,
then its report (instruments.measure.study_report).

A run with an ``eval.json`` is finished and skipped (after checking it was trained with today's
config), one with checkpoints is resumed.

A regime may start from a backbone the study trains itself (``pretrain``): a baseline run on a
separate shapes set, exported as the ``model.backbone_weights`` file the regime's config names.
Runs that need that file wait until it exists.

With ``jobs > 1`` the runs train side by side in child processes that share the cores. On a small
CPU this is faster than one run after another: part of each step (RoIAlign's backward, NMS, the
Python between ops) uses one core only, and two one-thread runs fill the gaps of each other.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from instruments.measure.study_plan import (
    PRETRAIN,
    TIMES_FILE,
    Plan,
    PlanError,
    StudyRun,
    check_runs,
    load_plan,
    plan_runs,
)
from instruments.measure.study_report import write_study_report
from rcnn_dropit.errors import UsageError


def run_study(
    plan_path: str | Path, jobs: int = 1, regimes: Sequence[str] = (), threads: int | None = None
) -> str:
    """Train every missing run (``jobs`` at a time), then write the report; returns it.

    Each run uses ``threads`` CPU threads (default: the cores shared out among the jobs).
    """
    if jobs < 1:
        raise UsageError(f"jobs: {jobs} must be >= 1")
    if threads is not None and threads < 1:
        raise UsageError(f"threads: {threads} must be >= 1")
    plan = load_plan(plan_path)
    unknown = [r for r in regimes if r not in plan.regimes]
    if unknown:
        raise PlanError(f"--regimes {unknown}: each must be one of {sorted(plan.regimes)}")
    runs = plan_runs(plan)
    if regimes:  # the pretraining only when a chosen regime loads its backbone
        wanted = {*regimes, *([PRETRAIN] if set(regimes) & set(plan.pretrain_for) else [])}
        runs = [r for r in runs if r.name.split("/")[0] in wanted]
    check_runs(runs)
    todo = []
    for i, run in enumerate(runs, 1):
        run_dir = plan.out / run.name
        if run.exports and Path(run.exports).is_file():
            print(f"[{i}/{len(runs)}] {run.name}: backbone {run.exports} exists, skipped")
        elif (run_dir / "eval.json").is_file():
            _check_same_config(run_dir, run.config, run.overrides)
            if run.exports:  # finished, but its exported backbone is gone (a new machine)
                todo.append((i, run))
            else:
                print(f"[{i}/{len(runs)}] {run.name}: finished, skipped", flush=True)
        else:
            todo.append((i, run))
    failed = _schedule(plan, todo, len(runs), jobs, threads or max(1, _cpu_count() // jobs))
    markdown = write_study_report(plan, plan_path, jobs)
    if failed:
        raise RuntimeError(
            f"study runs failed: {', '.join(failed)}; their logs are in {plan.out}; "
            "run the study again to resume them"
        )
    return markdown


def _schedule(
    plan: Plan, todo: list[tuple[int, StudyRun]], total: int, jobs: int, threads: int
) -> list[str]:
    """Train the runs, up to ``jobs`` child processes at once, each once the file it needs
    exists; returns the names that failed."""
    if not todo:
        return []
    from rcnn_dropit.config import load_config
    from rcnn_dropit.data.loader import ensure_dataset

    # generate each dataset once here, not in two children at the same moment
    for config in dict.fromkeys(run.config for _, run in todo):
        ensure_dataset(load_config(config))
    plan.out.mkdir(parents=True, exist_ok=True)
    pending, running, failed = list(todo), [], []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    slot = 0
    try:
        while pending or running:
            ready = [e for e in pending if e[1].needs is None or Path(e[1].needs).is_file()]
            if not ready and not running:  # what they wait for will not come: its run failed
                failed += [run.name for _, run in pending]
                for i, run in pending:
                    print(f"[{i}/{total}] {run.name}: NOT RUN ({run.needs} missing)", flush=True)
                break
            while ready and len(running) < jobs:
                entry = ready.pop(0)
                pending.remove(entry)
                i, run = entry
                run_dir = plan.out / run.name
                resume = _resume_flag(run_dir, run)
                log = run_dir.parent / f"{run_dir.name}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                gpu = slot % gpus if gpus else None  # round-robin: children do not share cuda:0
                # the pretraining runs on one thread: a machine that lost the exported backbone
                # retrains it, and one thread sums in the same order, so it gets the same weights
                n_threads = 1 if run.exports else threads
                slot += 1
                print(
                    f"[{i}/{total}] {run.name}: {'resuming' if resume else 'training'} "
                    f"({n_threads} thread(s){'' if gpu is None else f', GPU {gpu}'}, log {log})",
                    flush=True,
                )
                proc = _start_run(run, resume, run_dir, log, n_threads, gpu)
                running.append((i, run, proc, time.time(), resume == "auto"))
            time.sleep(_POLL_SECONDS)
            for entry in list(running):
                i, run, proc, start, resumed = entry
                if proc.is_alive():
                    continue
                proc.join()
                running.remove(entry)
                took = time.time() - start
                ok = proc.exitcode == 0
                if ok and run.exports:
                    ok = _export(plan.out / run.name, run.exports)
                _record_time(plan.out, run.name, took, ok, jobs, threads, resumed)
                if ok:
                    print(f"[{i}/{total}] {run.name}: done in {took:.0f} s", flush=True)
                else:
                    failed.append(run.name)
                    end = f"FAILED (exit {proc.exitcode}) after {took:.0f} s"
                    print(f"[{i}/{total}] {run.name}: {end}", flush=True)
    finally:  # stopped (Ctrl-C, kill): take the children down too, not leave them orphaned
        _stop_children([proc for _, _, proc, _, _ in running])
    return failed


def _stop_children(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Terminate runs still going (each resumes from its last checkpoint next time)."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


_POLL_SECONDS = 2.0


def _resume_flag(run_dir: Path, run: StudyRun) -> str | None:
    """A started run resumes from its newest checkpoint; a finished pretraining re-exports."""
    if not run_dir.exists():
        return None
    from rcnn_dropit.checkpoint.files import find_last_checkpoint

    if (run_dir / "eval.json").is_file() and find_last_checkpoint(run_dir / "checkpoints") is None:
        return "retrain"  # finished on another machine: its checkpoint was never committed
    return "auto"


def _export(run_dir: Path, target: str) -> bool:
    """Write the run's backbone to ``target`` and record its digest next to the run."""
    from rcnn_dropit.checkpoint.files import find_last_checkpoint
    from rcnn_dropit.models.weights import export_backbone

    ckpt = find_last_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        print(f"{run_dir}: no checkpoint to export the backbone from", flush=True)
        return False
    digest = export_backbone(ckpt, target)
    record = run_dir / "backbone_sha256.txt"
    previous = record.read_text().split()[0] if record.is_file() else None
    if previous is not None and previous != digest:
        print(
            f"{run_dir}: the retrained backbone differs from the one recorded ({previous[:12]} "
            f"now {digest[:12]}); runs trained before used the old one",
            flush=True,
        )
    record.write_text(f"{digest}  {Path(target).name}\n")
    print(f"backbone of {run_dir} written to {target} (sha256 {digest[:12]})", flush=True)
    return True


def _record_time(
    out: Path, name: str, seconds: float, ok: bool, jobs: int, threads: int, resumed: bool
) -> None:
    """Append one line to the study's time account (what the budget was spent on).

    ``resumed``: the attempt went on from a checkpoint, so ``seconds`` are its last segment's
    only (a stopped attempt writes no line); the run's whole time is in its ``log.txt``."""
    record = {
        "run": name,
        "seconds": round(seconds, 1),
        "ok": ok,
        "resumed": resumed,
        "jobs": jobs,
        "threads": threads,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with open(out / TIMES_FILE, "a") as stream:
        stream.write(json.dumps(record) + "\n")


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _start_run(
    run: StudyRun,
    resume: str | None,
    run_dir: Path,
    log: Path,
    threads: int,
    gpu: int | None,
) -> multiprocessing.process.BaseProcess:
    """One run in a fresh (spawned) process; its output goes to ``log``."""
    proc = multiprocessing.get_context("spawn").Process(
        target=_child_train,
        args=(run.config, run.overrides, resume, str(run_dir), str(log), threads, gpu),
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
    gpu: int | None,
) -> None:
    """Child-process body: send output to the log, limit threads, train; exit 1 on error."""
    if gpu is not None:  # before anything initialises CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    with open(log, "a", buffering=1) as stream:
        os.dup2(stream.fileno(), 1)
        os.dup2(stream.fileno(), 2)
        sys.stdout = sys.stderr = stream
        torch.set_num_threads(threads)
        from rcnn_dropit.engine import train

        try:
            retrain = resume == "retrain"
            train(
                config,
                overrides=overrides,
                resume=None if retrain else resume,
                output_dir=run_dir,
                overwrite=retrain,
            )
        except Exception as exc:  # the parent reports the exit code; the log keeps the trace
            import traceback

            traceback.print_exc()
            print(f"error: {exc}", flush=True)
            sys.exit(1)


def _check_same_config(run_dir: Path, config: str | Path, overrides: Sequence[str]) -> None:
    """A finished run counts only if it was trained with the study's current config.

    The run's config is read through today's schema, so a key added since then counts with its
    default value (which is what the run trained with) instead of as a difference.
    """
    from rcnn_dropit.config import config_from_dict, load_config

    want = load_config(config, overrides).to_dict()
    have = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).to_dict()
    for cfg in (want, have):
        cfg.get("train", {}).pop("output_dir", None)
    if want != have:
        diff = _first_difference(want, have)
        raise UsageError(
            f"study run '{run_dir}' was trained with a different config than {config} gives now "
            f"({diff}); move it away (or restore the config) so the study does not mix settings"
        )


def _first_difference(want: Any, have: Any, prefix: str = "") -> str:
    """The first dotted key whose value differs, for the error message."""
    if isinstance(want, dict) and isinstance(have, dict):
        for key in sorted(set(want) | set(have)):
            if want.get(key) != have.get(key):
                return _first_difference(want.get(key), have.get(key), f"{prefix}{key}.")
    return f"{prefix.rstrip('.')}: now {want!r}, run has {have!r}"

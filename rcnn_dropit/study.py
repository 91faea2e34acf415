"""The accuracy study: the same Mask R-CNN run for several DropIT settings and seeds, resumable.

Each run is an ordinary run directory under the study folder. A run with an ``eval.json`` is
finished and skipped; a run with checkpoints is resumed; so re-running the study after an
interruption continues where it stopped. The report of all runs is written at the end.
"""

from __future__ import annotations

import platform
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
) -> str:
    """Train every missing run of the study, then write and return the grouped report."""
    from rcnn_dropit.engine import train  # the engine pulls in torchvision; keep import lazy

    out_root = Path(out_root)
    runs = study_runs(seeds)
    for i, run in enumerate(runs, 1):
        run_dir = out_root / run.name
        if (run_dir / "eval.json").is_file():
            _check_same_config(run_dir, config, run.overrides)
            print(f"[{i}/{len(runs)}] {run.name}: finished, skipped", flush=True)
            continue
        resume = "auto" if run_dir.exists() else None
        print(f"[{i}/{len(runs)}] {run.name}: {'resuming' if resume else 'training'}", flush=True)
        start = time.time()
        train(config, overrides=run.overrides, resume=resume, output_dir=run_dir)
        print(f"[{i}/{len(runs)}] {run.name}: done in {time.time() - start:.0f} s", flush=True)
    dirs = [out_root / r.name for r in runs]
    markdown = build_report(dirs, baseline=dirs[0], out=report, group_seeds=True)
    if report is not None:
        Path(report).write_text(_header(config, seeds) + markdown)
    return markdown


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


def _header(config: str | Path, seeds: Sequence[int]) -> str:
    return (
        "# Accuracy study on the synthetic shapes set\n\n"
        f"Produced by `python tools/study.py --config {config} --seeds "
        f"{' '.join(map(str, seeds))}` (or `make study`) on {platform.machine()} "
        f"{platform.system()}, {torch.get_num_threads()} CPU threads, torch {torch.__version__}. "
        "Every run trains the same config for the same number of iterations; only the DropIT "
        "setting and the seed differ. AP is COCOeval on the 50 validation images.\n\n"
    )

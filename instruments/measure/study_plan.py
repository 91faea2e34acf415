"""The accuracy study's plan: regimes x DropIT settings x seeds, read from a YAML file and
checked, and the runs it makes, in the order they train.

A plan (``configs/study/plan.yaml``) names the regimes (a config each), the settings (config
overrides each) and groups of (regimes, settings, seeds). Every run is an ordinary run directory
``<out>/<regime>/<setting>_s<seed>``. Groups run in plan order (the main comparison first),
seed-major inside a group, so a study cut short has every setting of a group at seed 1 before
any at seed 2. A regime may start from a backbone the study pretrains itself (``pretrain``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rcnn_dropit.errors import UsageError, one_line

PRETRAIN = "pretrain"  # folder and run name of the study's own backbone pretraining
TIMES_FILE = "study_times.jsonl"  # a record per finished or failed attempt (resumed: its last part)


@dataclass(frozen=True)
class StudyRun:
    """One run: its folder under the study root, config, overrides and backbone dependencies."""

    name: str  # "<regime>/<setting>_s<seed>", or "pretrain/pretrain"
    config: str
    overrides: tuple[str, ...]
    needs: str | None = None  # a file that must exist before the run starts
    exports: str | None = None  # after the run: its backbone is written to this file


@dataclass(frozen=True)
class Group:
    """Settings trained in some regimes with some seeds."""

    regimes: tuple[str, ...]
    settings: tuple[str, ...]
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """What the study trains and where it writes."""

    out: Path
    report: Path
    regimes: dict[str, str]  # name -> config file
    settings: dict[str, tuple[str, ...]]  # name -> overrides
    groups: tuple[Group, ...]
    pretrain_config: str | None = None
    pretrain_for: tuple[str, ...] = field(default_factory=tuple)  # regimes using its backbone
    notes: Path | None = None  # hand-written findings (placeholders: report.notes)
    readme: Path | None = None  # a file whose study-choice block the report rewrites
    # setting -> the COCO config that trains it on R50-FPN (what the report recommends points here)
    configs: dict[str, Path] = field(default_factory=dict)
    # (setting, other): settings compared seed by seed with another, not only with the baseline
    pairs: tuple[tuple[str, str], ...] = ()


class PlanError(UsageError):
    """A study plan file that cannot be used; the message names the key and what is allowed."""


KEYS = "out report notes readme regimes settings groups pretrain configs pairs".split()
GROUP = ("regimes", "settings", "seeds")  # a group's keys, in Group's order


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan YAML file."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"study plan: file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise PlanError(f"study plan '{path}'{where}: invalid YAML ({one_line(err)})") from None
    try:
        return _plan(data)
    except PlanError as err:  # each check says what is wrong; the file is named here once
        raise PlanError(f"study plan '{path}': {err}") from None


def _plan(data: Any) -> Plan:
    if not isinstance(data, dict):
        raise PlanError("must be a mapping")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise PlanError(f"unknown key(s) {unknown}; allowed: {sorted(KEYS)}")
    regimes = _mapping(data, "regimes")
    settings = {k: tuple(map(str, v or ())) for k, v in _mapping(data, "settings").items()}
    groups = []
    listed = data.get("groups") or []
    if not isinstance(listed, list):
        raise PlanError(f"groups must be a list of mappings ({', '.join(GROUP)})")
    for i, g in enumerate(listed):
        group = Group(*(_group_list(g, key, f"groups[{i}]") for key in GROUP))
        for kind, names, allowed in (
            ("regime", group.regimes, regimes),
            ("setting", group.settings, settings),
        ):
            bad = [n for n in names if n not in allowed]
            if bad or not names:
                raise PlanError(
                    f"groups[{i}] {kind}s {list(names)}: each must be one of {sorted(allowed)}"
                )
        if not group.seeds or not all(isinstance(s, int) and s >= 0 for s in group.seeds):
            raise PlanError(f"groups[{i}] seeds must be integers >= 0")
        groups.append(group)
    pre = data.get("pretrain") or {}
    pretrain_for = tuple(pre.get("for", ()))
    if any(r not in regimes for r in pretrain_for):
        raise PlanError(f"pretrain.for {list(pretrain_for)}: unknown regime")
    for regime, config in regimes.items():
        if not Path(str(config)).is_file():
            raise PlanError(f"regimes.{regime}: file '{config}' does not exist")
    configs = {str(k): Path(str(v)) for k, v in (data.get("configs") or {}).items()}
    for setting, config in configs.items():
        if setting not in settings:
            raise PlanError(f"configs: '{setting}' is not a setting; allowed: {sorted(settings)}")
        if not config.is_file():
            raise PlanError(f"configs.{setting}: file '{config}' does not exist")
    return Plan(
        out=Path(data.get("out", "docs/results/shapes_runs")),
        report=Path(data.get("report", "docs/results/shapes.md")),
        regimes={k: str(v) for k, v in regimes.items()},
        settings=settings,
        groups=tuple(groups),
        pretrain_config=pre.get("config"),
        pretrain_for=pretrain_for,
        notes=Path(data["notes"]) if data.get("notes") else None,
        readme=Path(data["readme"]) if data.get("readme") else None,
        configs=configs,
        pairs=_pairs(data.get("pairs") or [], settings),
    )


def _pairs(listed: Any, settings: dict) -> tuple[tuple[str, str], ...]:
    """``pairs``: a list of ``[setting, other]``, both settings of the plan."""
    if not isinstance(listed, list):
        raise PlanError("pairs must be a list of [setting, other]")
    for i, pair in enumerate(listed):
        if not (isinstance(pair, list) and len(pair) == 2 and all(p in settings for p in pair)):
            raise PlanError(
                f"pairs[{i}] {pair!r}: must be [setting, other], each one of {sorted(settings)}"
            )
    return tuple((str(a), str(b)) for a, b in listed)


def _group_list(group: Any, key: str, label: str) -> tuple:
    if not isinstance(group, dict) or set(group) - set(GROUP):
        raise PlanError(f"{label}: must be a mapping with keys {', '.join(GROUP)}, got {group!r}")
    value = group.get(key, ())
    if not isinstance(value, (list, tuple)):
        raise PlanError(f"{label} {key}: must be a list, got {value!r}")
    return tuple(value)


def _mapping(data: dict, key: str) -> dict:
    value = data.get(key)
    if not isinstance(value, dict) or not value:
        raise PlanError(f"'{key}' must be a non-empty mapping")
    return value


def check_runs(runs: Sequence[StudyRun]) -> None:
    """Load each run's config with its overrides, so that a bad setting stops the study before
    any training, not when its run's turn comes hours later."""
    from rcnn_dropit.config import load_config

    for run in runs:
        try:
            load_config(run.config, run.overrides)
        except UsageError as err:
            raise PlanError(f"study run {run.name}: {one_line(err)}") from None


def backbone_file(plan: Plan) -> str | None:
    """The model.backbone_weights file the pretrained regimes load (None without pretraining)."""
    if not plan.pretrain_for:
        return None
    from rcnn_dropit.config import load_config  # here: reading a plan needs no torch

    files = {load_config(plan.regimes[r]).model.backbone_weights for r in plan.pretrain_for}
    if len(files) != 1 or None in files:
        raise PlanError(
            f"study plan: the regimes {list(plan.pretrain_for)} must all name one "
            f"model.backbone_weights file in their configs (found {sorted(map(str, files))})"
        )
    return files.pop()


def plan_runs(plan: Plan) -> list[StudyRun]:
    """Every run of the plan: the pretraining first, then group by group, seed-major in each."""
    weights = backbone_file(plan)
    runs = []
    if weights is not None:
        runs.append(
            StudyRun(
                f"{PRETRAIN}/{PRETRAIN}",
                str(plan.pretrain_config),
                (f"name={PRETRAIN}",),
                exports=weights,
            )
        )
    seen = set()
    for group in plan.groups:
        for seed in group.seeds:
            for regime in group.regimes:
                for setting in group.settings:
                    name = f"{regime}/{setting}_s{seed}"
                    if name in seen:
                        continue
                    seen.add(name)
                    overrides = (
                        *plan.settings[setting],
                        f"train.seed={seed}",
                        f"name={setting}_s{seed}",
                    )
                    needs = weights if regime in plan.pretrain_for else None
                    runs.append(StudyRun(name, plan.regimes[regime], overrides, needs=needs))
    return runs

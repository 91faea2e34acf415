"""The package as installed: its console scripts (read from its metadata) are what a training
run needs, each resolves to a command's main(), has its tools/ wrapper and runs from any folder;
the bench restarts itself for measuring."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.helpers import REPO


def _scripts() -> dict[str, str]:
    """The console scripts the installed package declares (its metadata, not a list here)."""
    eps = importlib.metadata.distribution("rcnn-dropit").entry_points
    return {ep.name: ep.value for ep in eps if ep.group == "console_scripts"}


def test_the_installed_scripts_are_pyprojects_and_only_what_training_needs() -> None:
    scripts = _scripts()
    assert scripts == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module_name, _, attr = target.partition(":")
        command = name.removeprefix("dropit-").replace("-", "_")
        assert (module_name, attr) == (f"rcnn_dropit.commands.{command}", "main"), name
        assert callable(getattr(importlib.import_module(module_name), attr)), name
        assert (REPO / "tools" / f"{command}.py").is_file(), name  # the same from a checkout
    # the instruments are not installed: they need the checkout's configs and docs
    assert not any(t.startswith("instruments") for t in scripts.values())


@pytest.mark.slow
def test_every_installed_script_runs_from_any_folder(tmp_path) -> None:
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout
    for name in _scripts():
        script = bin_dir / name
        if not script.is_file():
            pytest.skip(f"{name} is not installed beside {sys.executable} (pip install first)")
        done = subprocess.run(
            [str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (name, done.stderr[-2000:])
        assert "usage:" in done.stdout, name


def test_the_license_file_is_the_one_pyproject_names() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_bench_restarts_itself_measuring_as_it_was_started(monkeypatch) -> None:
    from instruments.commands import bench

    started = ["/usr/bin/python3", "-m", "instruments.commands.bench", "--ops"]
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(sys, "orig_argv", started)
    calls = []

    def execv(path, args):
        calls.append((path, args))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(SystemExit):
        bench.cli()
    assert calls == [(sys.executable, [sys.executable, *started[1:]])]
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_the_citation_file_names_this_version_and_license() -> None:
    import yaml

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert (str(cff["version"]), cff["license"]) == (project["version"], "Apache-2.0")
    assert "arXiv:2202.13808" in str(cff["preferred-citation"]["identifiers"])

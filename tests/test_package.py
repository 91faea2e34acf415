"""The package as installed: every console script of pyproject.toml resolves to a command's
main(), each has its tools/ wrapper, and dropit-bench restarts itself for measuring."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import tomllib

from tests.helpers import REPO


def _scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_console_script_resolves_to_its_commands_entry() -> None:
    scripts = _scripts()
    assert sorted(scripts) == sorted(
        f"dropit-{n}"
        for n in (
            "train", "test", "infer", "bench", "report", "study", "make-shapes", "grad-figure",
            "grad-groups",
        )
    )  # fmt: skip
    for name, target in scripts.items():
        module_name, _, attr = target.partition(":")
        command = name.removeprefix("dropit-").replace("-", "_")
        # the bench enters through cli(): it restarts itself measuring RSS, then calls main()
        entry = "cli" if command == "bench" else "main"
        assert (module_name, attr) == (f"rcnn_dropit.commands.{command}", entry), name
        assert callable(getattr(importlib.import_module(module_name), attr)), name
        assert (REPO / "tools" / f"{command}.py").is_file(), name  # the same from a checkout


def test_the_license_file_is_the_one_pyproject_names() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_bench_restarts_itself_measuring_as_it_was_started(monkeypatch) -> None:
    from rcnn_dropit.commands import bench

    started = ["/usr/bin/python3", "-m", "rcnn_dropit.commands.bench", "--ops"]
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

"""The package as installed: its console scripts (read from its metadata) are what a training
run needs, each resolves to a command's main() and has its tools/ wrapper; the wheel built from
the checkout, installed apart from it, runs each script from any folder, packs with its C loops
and trains; the bench restarts itself for measuring."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.helpers import REPO, job_env, tiny_opts


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


def _run(cmd: list, cwd: Path, env: dict[str, str]) -> str:
    """The command's stdout; it must succeed."""
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


@pytest.mark.slow
def test_the_wheel_installed_apart_from_the_checkout_packs_in_c_and_trains(
    tmp_path, tiny_shapes
) -> None:
    # What `pip install` gives a user, not the editable checkout: the wheel of the checkout's
    # packages (built from a copy, so that a build/ folder in the checkout adds no stale file),
    # installed into a fresh venv outside the checkout that borrows this environment's torch,
    # torchvision, pycocotools, ... through a .pth line (a plain directory line: the editable
    # install's own .pth files there are not run). Every file the code reads at run time must be
    # in it: without native.c the CPU packs fall back to eager torch with a warning.
    from dropit_core.backends import native

    compiler = native.library() is not None  # as tests/core/test_dropit_native.py decides
    src, wheels, venv, work = (tmp_path / d for d in ("src", "wheels", "venv", "work"))
    for name in ("dropit_core", "rcnn_dropit"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    work.mkdir()
    env = {k: v for k, v in job_env().items() if k != "PYTHONPATH" and not k.startswith("DROPIT_")}
    env["DROPIT_CACHE_DIR"] = str(tmp_path / "cache")  # the installed native.c built afresh
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, src], work, env)
    (wheel,) = wheels.glob("*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], work, env)  # pip: this one's
    python = venv / "bin" / "python"
    scripts = tomllib.loads((src / "pyproject.toml").read_text())["project"]["scripts"]
    _run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], work, env)
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   work, env).strip()  # fmt: skip
    needs = ("torch", "torchvision", "pycocotools", "yaml", "tqdm", "numpy", "PIL")
    borrowed = {str(Path(importlib.import_module(m).__file__).parents[1]): None for m in needs}
    (Path(purelib) / "borrowed.pth").write_text("".join(f"{d}\n" for d in borrowed))

    # Started together, as each imports torch (seconds): which files import and which backend
    # packs on the CPU; each console script's help; the demo model with its 4-bit packs (C loops)
    # trained two steps on tiny images and evaluated.
    probe = (
        "import dropit_core, rcnn_dropit; "
        "print(dropit_core.__file__, rcnn_dropit.__file__, dropit_core.pack_backend('cpu'))"
    )
    config = REPO / "configs/demo/maskrcnn_shapes_quant4.yaml"
    train = [
        venv / "bin" / "dropit-train", "--config", config, "--output-dir", work / "run",
        "--opts", *tiny_opts(tiny_shapes, "solver.max_iters=2"),
    ]  # fmt: skip
    commands = {
        "probe": [python, "-c", probe],
        "train": train,
        **{name: [venv / "bin" / name, "--help"] for name in scripts},
    }
    started = {
        name: subprocess.Popen([str(c) for c in cmd], cwd=work, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, cmd in commands.items()
    }  # fmt: skip
    try:
        out = {name: proc.communicate(timeout=600) for name, proc in started.items()}
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
    for name, proc in started.items():
        assert proc.returncode == 0, (name, out[name][0][-2000:], out[name][1][-3000:])

    *files, backend = out["probe"][0].split()
    assert all(Path(f).is_relative_to(purelib) for f in files), files  # the wheel's, not ours
    assert backend == ("native" if compiler else "eager"), out["probe"]
    assert all("usage:" in out[name][0] for name in scripts), out
    assert (work / "run" / "eval.json").is_file()
    if not compiler:
        pytest.skip("no C compiler here: the installed C loops were not checked")
    assert "C CPU packs are unavailable" not in out["train"][1], out["train"][1][-3000:]


def test_the_license_file_is_the_one_pyproject_names() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_bench_restarts_itself_measuring_as_it_was_started(monkeypatch) -> None:
    from instruments.commands import bench

    started = ["/usr/bin/python3", "-m", "instruments.commands.bench", "host"]
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

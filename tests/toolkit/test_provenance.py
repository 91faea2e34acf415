"""What log.txt says about the code a run ran: commit, uncommitted edits, folders, libraries."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dropit_core
import rcnn_dropit
from rcnn_dropit.cli import run_cli
from rcnn_dropit.provenance import (
    COMMIT_ENV,
    NoCommit,
    describe_code,
    git_state,
    library_versions,
    note_other_checkout,
    read_commit,
    source_roots,
)

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def git(root: Path, *args: str) -> str:
    env_args = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    done = subprocess.run(
        ["git", *env_args, "-C", str(root), *args], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@needs_git
def test_git_state_names_the_commit_and_uncommitted_edits_of_the_packages(tmp_path) -> None:
    (tmp_path / "rcnn_dropit").mkdir()
    (tmp_path / "rcnn_dropit" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    commit = git(tmp_path, "rev-parse", "--short", "HEAD")
    assert git_state(tmp_path) == f"commit {commit}"
    (tmp_path / "notes.txt").write_text("edited, but not the packages\n")
    (tmp_path / "scratch.py").write_text("untracked\n")
    assert git_state(tmp_path) == f"commit {commit}"
    (tmp_path / "rcnn_dropit" / "a.py").write_text("x = 2\n")
    assert git_state(tmp_path) == f"commit {commit} + uncommitted changes"


@needs_git
def test_read_commit_with_all_tracked_files_or_a_given_commit(tmp_path, monkeypatch) -> None:
    (tmp_path / "notes.txt").write_text("tracked\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    commit = git(tmp_path, "rev-parse", "--short=12", "HEAD")
    assert read_commit(tmp_path, digits=12) == (commit, False)
    (tmp_path / "notes.txt").write_text("edited\n")
    assert read_commit(tmp_path, digits=12) == (commit, True)  # no paths: every tracked file
    assert read_commit(tmp_path, ("rcnn_dropit",)) == (commit[:7], False)
    # a GPU lease's copy of a tree reads another tree's .git: the caller names the commit
    monkeypatch.setenv(COMMIT_ENV, "c8deef3")
    assert read_commit(tmp_path) == ("c8deef3", False)
    assert git_state(tmp_path) == f"commit c8deef3 (from ${COMMIT_ENV})"
    monkeypatch.setenv(COMMIT_ENV, " ")
    assert read_commit(tmp_path, digits=12) == (commit, True)


@needs_git
def test_git_state_outside_a_checkout(tmp_path) -> None:
    assert git_state(tmp_path) == "not a git checkout"
    # an installed copy inside a checkout (a .venv's site-packages) is not that checkout's code
    (tmp_path / "README").write_text("a checkout\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    site = tmp_path / ".venv" / "site-packages"
    (site / "rcnn_dropit").mkdir(parents=True)
    assert git_state(site) == "not a git checkout"
    with pytest.raises(NoCommit, match="not a git checkout"):
        read_commit(site)


def test_git_state_without_git(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on it
    assert git_state(tmp_path) == "git not found"


def test_describe_code_names_the_imported_folders_and_libraries() -> None:
    roots = source_roots()
    assert roots[0] == Path(rcnn_dropit.__file__).resolve().parent.parent
    assert Path(dropit_core.__file__).resolve().parent.parent in roots
    line = describe_code()
    assert line.startswith("code: rcnn_dropit ")
    assert f"from '{roots[0]}' (" in line
    assert f"torch {torch.__version__}" in library_versions()
    assert line.endswith(library_versions())


def test_a_script_of_another_checkout_says_whose_code_it_runs(tmp_path, capsys) -> None:
    (tmp_path / "rcnn_dropit").mkdir()
    (tmp_path / "tools").mkdir()
    note_other_checkout(str(tmp_path / "tools" / "train.py"))
    err = capsys.readouterr().err
    assert f"this is the checkout '{tmp_path.resolve()}'" in err
    assert f"imported from '{source_roots()[0]}'" in err
    assert f"PYTHONPATH={tmp_path.resolve()}" in err


def test_a_script_of_the_imported_checkout_or_elsewhere_says_nothing(tmp_path, capsys) -> None:
    note_other_checkout(str(source_roots()[0] / "tools" / "train.py"))
    note_other_checkout(str(tmp_path / "tools" / "train.py"))  # a copy outside any checkout
    assert capsys.readouterr().err == ""


def test_only_rank_0_says_it(tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "rcnn_dropit").mkdir()
    monkeypatch.setenv("RANK", "1")
    note_other_checkout(str(tmp_path / "tools" / "train.py"))
    assert capsys.readouterr().err == ""


def test_a_tool_started_from_another_checkout_says_so_before_it_runs(tmp_path, capsys, monkeypatch):
    (tmp_path / "rcnn_dropit").mkdir()
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "tools" / "train.py")])
    assert run_cli(lambda: None) == 0
    assert "PYTHONPATH=" in capsys.readouterr().err


def test_the_note_imports_no_torch(tmp_path) -> None:
    # run_cli calls it for every tool, dropit-report too, which reads no tensors
    code = (
        "import sys; from rcnn_dropit.provenance import note_other_checkout; "
        f"note_other_checkout({str(tmp_path / 'tools' / 'report.py')!r}); "
        "print('torch' in sys.modules)"
    )
    (tmp_path / "rcnn_dropit").mkdir()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
    assert "PYTHONPATH=" in done.stderr  # it did look up where the packages are

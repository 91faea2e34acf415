"""What log.txt says about the code a run ran: commit, uncommitted edits, folders, libraries."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import dropit_core
import rcnn_dropit
from rcnn_dropit.provenance import describe_code, git_state, library_versions, source_roots

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
def test_git_state_outside_a_checkout(tmp_path) -> None:
    assert git_state(tmp_path) == "not a git checkout"


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

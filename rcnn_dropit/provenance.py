"""Which code a run ran: the package's version and folder, its git commit, and the libraries.

An editable install imports the package from wherever it was installed, not from the folder a
script is started in (a second checkout or worktree runs the first one's code unless PYTHONPATH
names it), and a checkout can hold uncommitted edits: log.txt records both at every start and
resume, so a run's figures can be traced to the code that made them.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

PACKAGES = ("rcnn_dropit", "dropit_core")  # the code a run's numbers depend on


def source_roots() -> list[Path]:
    """The folders the running packages were imported from: one for a checkout, two when
    PYTHONPATH and an editable install each supply one of them."""
    roots: list[Path] = []
    for name in PACKAGES:
        module = sys.modules.get(name)  # where it was imported from, else where it would be
        origin = module.__file__ if module is not None else importlib.util.find_spec(name).origin
        root = Path(origin).resolve().parent.parent
        if root not in roots:
            roots.append(root)
    return roots


COMMIT_ENV = "RCNN_DROPIT_COMMIT"  # names the commit of a tree whose .git is not its own


class NoCommit(Exception):
    """Why no commit can be named: the message says (not a checkout, git missing or slow)."""


def read_commit(
    root: Path, paths: Sequence[str] = (), digits: int = 7, timeout: float = 5.0
) -> tuple[str, bool]:
    """The commit of the checkout whose top is ``root``, and whether tracked files (under
    ``paths``, all when empty) differ from it. ``$RCNN_DROPIT_COMMIT`` wins when set: a copy of a
    working tree (a GPU lease's) reads another tree's .git, and its caller knows better.
    Raises NoCommit with the reason when there is none."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        return given, False

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
        return done.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            raise NoCommit("not a git checkout")  # e.g. an installed copy in a checkout's .venv
        commit = git("rev-parse", f"--short={digits}", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", *paths)
    except FileNotFoundError:
        raise NoCommit("git not found") from None
    except subprocess.TimeoutExpired:
        raise NoCommit("git did not answer") from None
    except subprocess.CalledProcessError:
        raise NoCommit("not a git checkout") from None
    return commit, bool(changed)


def git_state(root: Path, timeout: float = 5.0) -> str:
    """'commit abc1234', with ' + uncommitted changes' when the packages differ from it, or why
    there is no commit to name (not a git checkout, git missing or too slow)."""
    try:
        commit, changed = read_commit(root, PACKAGES, timeout=timeout)
    except NoCommit as why:
        return str(why)
    if os.environ.get(COMMIT_ENV, "").strip():
        return f"commit {commit} (from ${COMMIT_ENV})"
    return f"commit {commit}" + (" + uncommitted changes" if changed else "")


def library_versions() -> str:
    """torch, torchvision, triton (where installed) and python versions, one string."""
    import torch  # here: the tools that read no tensors (dropit-report) import no torch

    parts = [f"torch {torch.__version__}"]
    for name in ("torchvision", "triton"):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    parts.append(f"python {platform.python_version()}")
    return ", ".join(parts)


def describe_code() -> str:
    """One line for log.txt: what code and libraries this process runs."""
    try:
        version = metadata.version("rcnn-dropit")
    except metadata.PackageNotFoundError:
        version = "not installed"
    where = " and ".join(f"'{root}' ({git_state(root)})" for root in source_roots())
    return f"code: rcnn_dropit {version} from {where}; {library_versions()}"


def note_other_checkout(script: str) -> None:
    """A tools/ script of one checkout that imports another's packages (an editable install of
    that one) says so on stderr, once per job (rank 0): its run is the other checkout's code."""
    checkout = Path(script).resolve().parent.parent
    if os.environ.get("RANK", "0") != "0" or not (checkout / "rcnn_dropit").is_dir():
        return
    roots = source_roots()
    if checkout in roots:
        return
    where = ", ".join(f"'{root}'" for root in roots)
    print(
        f"note: this is the checkout '{checkout}', but the packages are imported from {where}; "
        f"run with PYTHONPATH={checkout} to use this checkout's code",
        file=sys.stderr,
    )

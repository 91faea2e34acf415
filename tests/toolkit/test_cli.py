"""How a tool's failure reaches the user: a usage error is one line, a bug keeps its traceback
on the console and in the run's log.txt."""

from __future__ import annotations

import errno

import pytest

from rcnn_dropit.cli import finish, run_cli
from rcnn_dropit.errors import CheckpointWriteError, MissingPathError, UsageError, one_line


def _raises(err: BaseException):
    def fn() -> None:
        raise err

    return fn


def test_a_usage_error_is_one_line_and_exit_code_2(capsys) -> None:
    assert run_cli(_raises(UsageError("solver.lr = -1 is out of range;\n  it must be > 0"))) == 2
    assert capsys.readouterr().err == "error: solver.lr = -1 is out of range; it must be > 0\n"
    assert run_cli(_raises(MissingPathError("--run: folder 'x' does not exist"))) == 2
    assert capsys.readouterr().err == "error: --run: folder 'x' does not exist\n"


def test_a_bug_keeps_its_traceback_and_exit_code_1(capsys) -> None:
    # A plain ValueError is not the user's: it may come from anywhere inside.
    assert run_cli(_raises(ValueError("shapes do not broadcast"))) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.rstrip().endswith("ValueError: shapes do not broadcast")


@pytest.mark.parametrize(
    "err",
    [
        FloatingPointError("non-finite loss at iteration 3: loss_box_reg=nan"),
        CheckpointWriteError("could not write 'c/model_0000003.pth': disk full"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
)
def test_a_diverged_run_or_a_full_disk_is_one_line_and_exit_code_1(capsys, err) -> None:
    assert run_cli(_raises(err)) == 1
    assert capsys.readouterr().err == f"error: {one_line(err)}\n"


def test_success_and_interrupt(capsys) -> None:
    assert run_cli(lambda: None) == 0
    assert run_cli(_raises(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_usage_errors_are_still_the_builtin_types_callers_caught() -> None:
    assert issubclass(UsageError, ValueError)
    assert issubclass(MissingPathError, UsageError) and issubclass(MissingPathError, OSError)


def test_a_single_process_gets_its_exit_code_back(monkeypatch) -> None:
    for name in ("WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert finish(2) == 2

"""train.deterministic: the flags it sets and gives back, the cuBLAS setting, the same losses
from two runs, and one line naming an op that has no deterministic implementation."""

from __future__ import annotations

import os

import pytest
import torch

from rcnn_dropit.engine import runner as runner_module
from rcnn_dropit.engine.determinism import (
    CUBLAS_VAR,
    deterministic_algorithms,
    deterministic_refusal,
)
from rcnn_dropit.engine.runner import train
from rcnn_dropit.engine.trainer import Trainer
from rcnn_dropit.errors import UsageError
from tests.helpers import FASTER_CFG, call_tool, tiny_opts, train_records


def _flags() -> tuple[bool, bool, bool]:
    cudnn = torch.backends.cudnn
    return torch.are_deterministic_algorithms_enabled(), cudnn.benchmark, cudnn.deterministic


def _nondeterministic_op() -> None:
    """put_ without accumulate: one that torch refuses on the CPU under deterministic mode."""
    torch.zeros(3).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))


@pytest.fixture
def no_cublas_var(monkeypatch) -> None:
    """CUBLAS_WORKSPACE_CONFIG unset, and unset again after the test (the key sets it)."""
    monkeypatch.setenv(CUBLAS_VAR, "")  # records the variable as it was, to restore it
    monkeypatch.delenv(CUBLAS_VAR)


def test_the_key_sets_the_flags_inside_and_gives_them_back(no_cublas_var) -> None:
    before = _flags()
    assert before[0] is False
    with deterministic_algorithms(True):
        assert _flags() == (True, False, True)
        assert torch.is_deterministic_algorithms_warn_only_enabled() is False
    assert _flags() == before
    assert os.environ[CUBLAS_VAR] == ":4096:8"  # stays: cuBLAS sized its workspace from it


def test_the_key_off_touches_nothing_a_caller_set(no_cublas_var) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with deterministic_algorithms(False):
            assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # not reset to off
    finally:
        torch.use_deterministic_algorithms(False)
    assert CUBLAS_VAR not in os.environ


def test_a_cublas_setting_that_breaks_determinism_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(CUBLAS_VAR, ":0:0")
    with pytest.raises(UsageError, match=r"CUBLAS_WORKSPACE_CONFIG=':0:0'.*:4096:8 or :16:8"):
        with deterministic_algorithms(True):
            pass
    assert not torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv(CUBLAS_VAR, ":16:8")  # the other value torch accepts: kept
    with deterministic_algorithms(True):
        pass


def test_torchs_refusal_becomes_one_message_naming_the_op() -> None:
    with deterministic_algorithms(True), pytest.raises(RuntimeError) as info:
        _nondeterministic_op()
    refusal = deterministic_refusal(info.value)
    assert isinstance(refusal, UsageError)
    assert str(refusal).startswith("train.deterministic: put_ has no deterministic implementation")
    assert "set train.deterministic=false" in str(refusal)
    assert deterministic_refusal(RuntimeError("CUDA out of memory")) is None


@pytest.mark.slow  # two tiny training runs
def test_two_deterministic_runs_log_the_same_losses_with_the_flags_on_in_every_step(
    tmp_path, tiny_shapes, monkeypatch, no_cublas_var
) -> None:
    seen = []
    real_step = Trainer.step

    def step(self, images, targets, iteration):
        seen.append(_flags())
        return real_step(self, images, targets, iteration)

    monkeypatch.setattr(Trainer, "step", step)
    opts = tiny_opts(tiny_shapes, "solver.max_iters=3", "train.deterministic=true")
    runs = [train(FASTER_CFG, opts, output_dir=tmp_path / name).output_dir for name in "ab"]
    assert seen == [(True, False, True)] * 6
    losses = [[{k: v for k, v in r.items() if k.startswith("loss")} for r in train_records(run)]
              for run in runs]  # fmt: skip
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert _flags()[0] is False  # given back when the run ended


@pytest.mark.slow  # a training run
def test_an_op_without_a_deterministic_path_stops_the_run_with_one_line(
    tmp_path, tiny_shapes, monkeypatch, capsys, no_cublas_var
) -> None:
    real_build = runner_module.build_model

    def build_with_the_op(cfg, sync_bn=False):
        model, record = real_build(cfg, sync_bn)
        model.rpn.register_forward_hook(lambda *args: _nondeterministic_op())
        return model, record

    monkeypatch.setattr(runner_module, "build_model", build_with_the_op)
    run = tmp_path / "run"
    opts = tiny_opts(tiny_shapes, "solver.max_iters=2", "train.deterministic=true")
    proc = call_tool("train.py", "--config", str(FASTER_CFG), "--output-dir", str(run),
                     "--opts", *opts, capsys=capsys)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # after the progress bar's line
    assert last.startswith("error: train.deterministic: put_ has no deterministic implementation")
    assert "set train.deterministic=false" in last and proc.stderr.count("error:") == 1
    assert not run.exists()  # stopped before its first checkpoint: nothing left behind
    assert not torch.are_deterministic_algorithms_enabled()

"""Atomic checkpoint saving, pointer, pruning, resume lookup, RNG state and model checks."""

import errno
import random

import numpy as np
import pytest
import torch
from torch import nn

from rcnn_dropit import checkpoint as ckpt
from rcnn_dropit.checkpoint.checkpointer import Checkpointer
from rcnn_dropit.checkpoint.files import (
    find_last_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models.weights import check_model_compat
from rcnn_dropit.rng import capture_rng_state, restore_rng_state


def _checkpointer(folder, seed: int = 0, steps: int = 1) -> Checkpointer:
    """A checkpointer over a small model, its optimizer and schedule after `steps` steps."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2], gamma=0.1)
    for _ in range(steps):
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
        sched.step()
    config = {"solver": {"lr": 0.1, "lr_steps": [2]}}
    return Checkpointer(folder, model, opt, sched, None, iters_per_epoch=4, config=config)


def _training_state(seed: int = 0) -> dict:
    loop = {"log_window": None, "skipped_steps": 0}
    return _checkpointer("unused", seed).state_dict(7, [capture_rng_state()], loop)


def test_round_trip_loads_with_weights_only(tmp_path):
    state = _training_state()
    path = save_checkpoint(tmp_path, "model_0000007.pth", state, keep_last=3)
    assert path == tmp_path / "model_0000007.pth"
    loaded = load_checkpoint(path)
    for key, value in state["model"].items():
        torch.testing.assert_close(loaded["model"][key], value, rtol=0, atol=0)
    momentum = loaded["optimizer"]["state"][0]["momentum_buffer"]
    torch.testing.assert_close(momentum, state["optimizer"]["state"][0]["momentum_buffer"])
    assert loaded["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.1)
    assert loaded["scheduler"]["last_epoch"] == 1
    assert loaded["scheduler"]["milestones"] == {2: 1}
    assert loaded["scaler"] is None
    assert (loaded["version"], loaded["iteration"], loaded["iters_per_epoch"]) == (2, 7, 4)
    assert loaded["config"] == {"solver": {"lr": 0.1, "lr_steps": [2]}}
    assert loaded["loop"] == {"log_window": None, "skipped_steps": 0}
    assert len(loaded["rng"]["python"][1]) == 625
    assert sorted(loaded) == sorted(  # every field is read back on resume (config: by people)
        ["version", "model", "optimizer", "scheduler", "scaler", "iteration", "iters_per_epoch"]
        + ["rng", "rng_per_rank", "loop", "config"]
    )


def test_checkpointer_restores_every_part_exactly(tmp_path):
    trained = _checkpointer(tmp_path, seed=0, steps=3)
    loop = {"log_window": {"count": 1, "losses": {"loss": 0.5}, "time": 0.1, "data_time": 0.0}}
    path = trained.save(3, {**loop, "skipped_steps": 2})
    assert path == tmp_path / "model_0000003.pth"
    fresh = _checkpointer(tmp_path, seed=1, steps=0)
    point = fresh.load(path)
    assert (point.iteration, point.loop["skipped_steps"]) == (3, 2)
    assert point.loop["log_window"] == loop["log_window"]
    assert point.rng["torch"].equal(load_checkpoint(path)["rng_per_rank"][0]["torch"])
    for key, value in trained.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[key], value), key
    a, b = trained.optimizer.state_dict(), fresh.optimizer.state_dict()
    for index, buffers in a["state"].items():
        assert torch.equal(b["state"][index]["momentum_buffer"], buffers["momentum_buffer"])
    assert fresh.scheduler.state_dict() == trained.scheduler.state_dict()
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1)  # past milestone 2


def test_checkpoint_of_an_unknown_version_is_a_clear_error(tmp_path):
    saver = _checkpointer(tmp_path)
    state = saver.state_dict(1, [capture_rng_state()], {})
    path = save_checkpoint(tmp_path, "model_0000001.pth", {**state, "version": 9}, keep_last=0)
    with pytest.raises(ValueError) as info:
        _checkpointer(tmp_path).load(path)
    assert str(info.value) == (
        f"checkpoint '{path}' has format version 9; this rcnn-dropit reads versions 1, 2 "
        "(a newer rcnn-dropit wrote it?)"
    )


def test_unversioned_checkpoints_of_earlier_releases_still_resume(tmp_path):
    saver = _checkpointer(tmp_path, steps=2)
    v2 = saver.state_dict(6, [capture_rng_state()], {"skipped_steps": 1})
    window = {"count": 2, "losses": {"loss": 1.0}, "time": 0.2, "data_time": 0.1}
    v1 = {k: v2[k] for k in ("model", "optimizer", "scheduler", "scaler", "iteration", "config")}
    v1.update(
        epoch=1,
        rng=v2["rng"],
        sampler={"epoch": 1, "batches_done": 2, "iters_per_epoch": 4},
        log_window=window,
        skipped_steps=1,
    )
    path = save_checkpoint(tmp_path, "model_0000006.pth", v1, keep_last=0)
    point = _checkpointer(tmp_path, seed=3, steps=0).load(path)
    assert point.iteration == 6
    assert point.loop == {"log_window": window, "skipped_steps": 1}
    v1["sampler"]["iters_per_epoch"] = 5
    path = save_checkpoint(tmp_path, "model_0000006.pth", v1, keep_last=0)
    with pytest.raises(ValueError, match="written with 5 iterations per epoch, this run has 4"):
        _checkpointer(tmp_path).load(path)


def test_pointer_follows_latest_and_keep_last_prunes(tmp_path):
    for it in (10, 20, 30, 40):
        save_checkpoint(tmp_path, f"model_{it:07d}.pth", {"iteration": it}, keep_last=2)
        assert (tmp_path / "last_checkpoint").read_text() == f"model_{it:07d}.pth"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["last_checkpoint", "model_0000030.pth", "model_0000040.pth"]
    assert find_last_checkpoint(tmp_path) == tmp_path / "model_0000040.pth"
    # The file just written survives even when it is not the highest number.
    save_checkpoint(tmp_path, "model_0000005.pth", {"iteration": 5}, keep_last=1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["last_checkpoint", "model_0000005.pth"]
    # keep_last=0 keeps everything; non-numbered files are never pruned.
    save_checkpoint(tmp_path, "model_final.pth", {"iteration": 50}, keep_last=0)
    save_checkpoint(tmp_path, "model_0000060.pth", {"iteration": 60}, keep_last=0)
    assert len(list(tmp_path.glob("model_*.pth"))) == 3
    save_checkpoint(tmp_path, "model_0000070.pth", {"iteration": 70}, keep_last=1)
    assert sorted(p.name for p in tmp_path.glob("model_*.pth")) == [
        "model_0000070.pth",
        "model_final.pth",
    ]


def test_write_failure_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, "model_0000001.pth", {"iteration": 1}, keep_last=3)
    before = (tmp_path / "model_0000001.pth").read_bytes()

    def full_disk(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(RuntimeError, match=r"model_0000002\.pth.*No space left on device"):
        save_checkpoint(tmp_path, "model_0000002.pth", {"iteration": 2}, keep_last=3)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last_checkpoint", "model_0000001.pth"]
    assert (tmp_path / "model_0000001.pth").read_bytes() == before
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000001.pth"
    assert load_checkpoint(find_last_checkpoint(tmp_path))["iteration"] == 1


def test_load_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.pth"
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        load_checkpoint(missing)
    save_checkpoint(tmp_path, "model_0000001.pth", {"iteration": 1}, keep_last=0)
    good = (tmp_path / "model_0000001.pth").read_bytes()
    corrupt = tmp_path / "model_0000002.pth"
    corrupt.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="model_0000002.pth.*corrupt"):
        load_checkpoint(corrupt)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="garbage.pth"):
        load_checkpoint(garbage)


def test_find_last_falls_back_when_pointer_is_stale(tmp_path):
    assert find_last_checkpoint(tmp_path / "absent") is None
    assert find_last_checkpoint(tmp_path) is None
    for it in (100, 900, 1000):
        save_checkpoint(tmp_path, f"model_{it:07d}.pth", {"iteration": it}, keep_last=0)
    (tmp_path / "model_0001000.pth").unlink()
    # Pointer names a deleted file; the newest one is truncated: the next valid one wins.
    (tmp_path / "model_0000900.pth").write_bytes(b"trunc")
    assert find_last_checkpoint(tmp_path) == tmp_path / "model_0000100.pth"


def test_resolve_resume(tmp_path):
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None
    path = save_checkpoint(tmp_path, "model_0000003.pth", {"iteration": 3}, keep_last=0)
    assert resolve_resume("auto", tmp_path) == path
    assert resolve_resume(str(path), tmp_path / "elsewhere") == path
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        resolve_resume(str(tmp_path / "missing.pth"), tmp_path)
    # an empty --resume is neither: it once started a fresh run over a used folder
    with pytest.raises(UsageError, match="--resume: give 'auto'"):
        resolve_resume("", tmp_path)


def test_rng_state_survives_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()
    path = save_checkpoint(tmp_path, "model_0000001.pth", {"rng": capture_rng_state()}, 1)
    expected = (torch.rand(4), random.random(), np.random.rand(3), random.gauss(0, 1))
    torch.rand(10)
    random.random()
    np.random.rand(7)
    restore_rng_state(load_checkpoint(path)["rng"])
    got = (torch.rand(4), random.random(), np.random.rand(3), random.gauss(0, 1))
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert got[1] == expected[1]
    np.testing.assert_array_equal(got[2], expected[2])
    assert got[3] == expected[3]


def test_check_model_compat_message():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    check_model_compat(model, model.state_dict())
    other = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2), nn.Linear(2, 1)).state_dict()
    with pytest.raises(ValueError) as info:
        check_model_compat(model, other)
    message = str(info.value)
    assert "another model" in message
    assert "2 unexpected keys: 2.weight, 2.bias" in message
    assert "0.weight (5, 3) vs (4, 3)" in message
    assert "3 shape mismatches" in message
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="4 missing keys.*DDP"):
        check_model_compat(model, wrapped)


def test_name_must_be_a_plain_file_name(tmp_path):
    with pytest.raises(ValueError, match="plain file name"):
        save_checkpoint(tmp_path, "../model_1.pth", {}, keep_last=1)
    assert ckpt.POINTER_NAME == "last_checkpoint"


class _FakeCuda:
    """Stands in for torch.cuda's RNG calls: one generator state per device index."""

    def __init__(self, monkeypatch, current: int, initialized: bool = True) -> None:
        self.current = current
        self.restored: list[tuple[int, int]] = []  # (device index, state's marker)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)

        def every_device():
            raise AssertionError("only the current device's state may be read")

        monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_device)

    def get_rng_state(self, device="cuda"):
        return torch.tensor([100 + device], dtype=torch.uint8)

    def set_rng_state(self, state, device="cuda"):
        self.restored.append((device, int(state[0])))


def test_cuda_rng_is_saved_and_restored_for_the_current_device_only(tmp_path, monkeypatch):
    # saved by the rank that used cuda:3 of 8 visible GPUs ...
    cuda = _FakeCuda(monkeypatch, current=3)
    path = save_checkpoint(tmp_path, "model_0000001.pth", {"rng": capture_rng_state()}, 1)
    state = load_checkpoint(path)["rng"]
    assert state["cuda"].tolist() == [103]
    # ... resumed with one GPU visible per task: its only device gets that rank's stream
    cuda.current = 0
    restore_rng_state(state)
    assert cuda.restored == [(0, 103)]


def test_older_checkpoints_with_every_devices_cuda_rng_restore_the_current_entry(monkeypatch):
    cuda = _FakeCuda(monkeypatch, current=2)
    state = capture_rng_state()
    state["cuda"] = [torch.tensor([100 + i], dtype=torch.uint8) for i in range(4)]
    restore_rng_state(state)
    assert cuda.restored == [(2, 102)]


def test_cpu_run_on_a_gpu_node_does_not_touch_cuda_rng(monkeypatch):
    cuda = _FakeCuda(monkeypatch, current=0, initialized=False)
    state = capture_rng_state()
    assert state["cuda"] is None
    restore_rng_state(state)
    assert cuda.restored == []

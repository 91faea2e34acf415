"""train.compile: the key's choices, and the module compiled in place (its state_dict kept)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dropit_core.memory import saved_activations
from rcnn_dropit.config import load_config
from rcnn_dropit.engine.compiling import compile_model
from rcnn_dropit.errors import UsageError
from tests.helpers import REPO

CONFIGS = REPO / "configs"


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
        self.head = nn.Linear(4, 2)


def test_train_compile_takes_none_backbone_or_model():
    cfg = load_config(CONFIGS / "maskrcnn_baseline.yaml", ["train.compile=backbone"])
    assert cfg.train.compile == "backbone"
    assert load_config(CONFIGS / "maskrcnn_baseline.yaml").train.compile == "none"
    with pytest.raises(ValueError, match="train.compile"):
        load_config(CONFIGS / "maskrcnn_baseline.yaml", ["train.compile=heads"])


@pytest.mark.parametrize("mode", ["backbone", "model"])
def test_compile_model_keeps_the_modules_and_their_state_dict(mode: str):
    net = _Net()
    keys = list(net.state_dict())
    plain_forward = type(net.backbone).forward
    target = compile_model(net, mode)
    assert target is (net.backbone if mode == "backbone" else net)
    assert "forward" in vars(target)  # the compiled forward, on the instance
    assert type(net.backbone).forward is plain_forward
    assert list(net.state_dict()) == keys
    assert compile_model(_Net(), "none") is None


def test_compile_model_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="train.compile='heads'"):
        compile_model(_Net(), "heads")
    with pytest.raises(ValueError, match="train.compile_backend='tvm': allowed inductor"):
        compile_model(_Net(), "backbone", "tvm")
    with pytest.raises(ValueError, match="train.compile_mode='fast': allowed default"):
        compile_model(_Net(), "backbone", "inductor", "fast")
    with pytest.raises(ValueError, match="needs train.compile_backend=inductor"):
        compile_model(_Net(), "backbone", "aot_eager", "reduce-overhead")


def test_backend_and_mode_reach_torch_compile(monkeypatch):
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    compile_model(_Net(), "backbone")
    compile_model(_Net(), "model", "aot_eager")
    compile_model(_Net(), "model", "inductor", "reduce-overhead")
    # Inductor's mode reaches it as that mode's options, with the maps' layout kept
    assert calls == [
        {"dynamic": True, "options": {"layout_optimization": False}},
        {"dynamic": True, "backend": "aot_eager"},
        {"dynamic": True, "options": {"triton.cudagraphs": True, "layout_optimization": False}},
    ]


def test_train_compile_backend_and_mode_are_checked_together():
    cfg = load_config(
        CONFIGS / "maskrcnn_baseline.yaml",
        ["train.compile=backbone", "train.compile_mode=reduce-overhead"],
    )
    assert (cfg.train.compile_backend, cfg.train.compile_mode) == ("inductor", "reduce-overhead")
    with pytest.raises(UsageError, match="train.compile_backend = 'tvm' is not one of"):
        load_config(CONFIGS / "maskrcnn_baseline.yaml", ["train.compile_backend=tvm"])
    refused = r"compile_mode='max-autotune' needs train.compile_backend=inductor \(got 'aot_eager"
    with pytest.raises(UsageError, match=refused):
        load_config(
            CONFIGS / "maskrcnn_baseline.yaml",
            ["train.compile_backend=aot_eager", "train.compile_mode=max-autotune"],
        )


@pytest.mark.slow
def test_an_inductor_backbone_keeps_no_copy_of_its_weights():
    # On the CPU Inductor would run each conv channels-last: a copy of every 3x3 weight made in
    # the forward and saved for the backward beside the weight (here 9 KB each, against 4.5 KB
    # per map). compile_model keeps the maps' layout: the compiled backbone saves no more than
    # the eager one.
    torch.manual_seed(0)
    net = _Net()
    net.backbone = nn.Sequential(
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()
    )
    x = torch.randn(2, 16, 6, 6)
    eager = saved_activations(net.backbone, lambda: net.backbone(x))[1]
    compile_model(net, "backbone")
    net.backbone(x).sum().backward()  # compiles
    compiled = saved_activations(net.backbone, lambda: net.backbone(x))[1]
    assert 0 < compiled.total_bytes <= eager.total_bytes

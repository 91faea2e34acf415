"""train.compile: the key's choices, and the module compiled in place (its state_dict kept)."""

from __future__ import annotations

import pytest
from torch import nn

from rcnn_dropit.config import load_config
from rcnn_dropit.engine.compiling import compile_model
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

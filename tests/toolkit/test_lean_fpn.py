"""The lean FPN: torchvision's FPN bit for bit in fp32 and under CPU autocast, its top-down
upsample run outside autocast (which on CUDA would promote it to fp32), the same modules."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork, LastLevelMaxPool

from rcnn_dropit.config import config_from_dict
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models import LeanFeaturePyramidNetwork, build_backbone, lean_fpn

SIZES = [(13, 11), (7, 6), (4, 3)]  # odd sizes: the upsample goes to the lateral's own size


def _pair() -> tuple[FeaturePyramidNetwork, FeaturePyramidNetwork]:
    torch.manual_seed(0)
    theirs = FeaturePyramidNetwork([8, 16, 32], 8, extra_blocks=LastLevelMaxPool())
    return lean_fpn(copy.deepcopy(theirs)), theirs


def _features(requires_grad: bool = False) -> OrderedDict:
    gen = torch.Generator().manual_seed(1)
    return OrderedDict(
        (str(i), torch.randn(2, c, h, w, generator=gen).requires_grad_(requires_grad))
        for i, (c, (h, w)) in enumerate(zip([8, 16, 32], SIZES, strict=True))
    )


def test_fp32_outputs_and_gradients_are_torchvisions_bit_for_bit() -> None:
    ours, theirs = _pair()
    assert type(ours) is LeanFeaturePyramidNetwork and type(theirs) is FeaturePyramidNetwork
    results = []
    for model in (ours, theirs):
        x = _features(requires_grad=True)
        out = model(x)
        sum(v.square().sum() for v in out.values()).backward()
        results.append((out, [t.grad for t in x.values()], [p.grad for p in model.parameters()]))
    (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = results
    assert list(out_a) == list(out_b) == ["0", "1", "2", "pool"]
    assert all(torch.equal(out_a[k], out_b[k]) for k in out_a)
    assert all(map(torch.equal, gx_a, gx_b)) and all(map(torch.equal, gp_a, gp_b))


def test_under_cpu_autocast_the_outputs_are_torchvisions_bit_for_bit() -> None:
    ours, theirs = _pair()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_a, out_b = ours(_features()), theirs(_features())
    assert all(out_a[k].dtype == torch.bfloat16 and torch.equal(out_a[k], out_b[k]) for k in out_a)


def test_the_upsample_runs_outside_autocast_in_the_features_dtype(monkeypatch) -> None:
    """CUDA autocast runs F.interpolate in fp32; on the CPU it does not, so that promotion is
    played here: under autocast the upsample returns fp32, as it does on a GPU."""
    plain = F.interpolate
    seen: list[tuple[str, bool, torch.dtype]] = []

    def promoting(x, *args, **kwargs):
        on = torch.is_autocast_enabled("cpu")
        out = plain(x, *args, **kwargs)
        out = out.float() if on else out
        seen.append((tag, on, out.dtype))
        return out

    monkeypatch.setattr(torch.nn.functional, "interpolate", promoting)
    ours, theirs = _pair()
    outputs = {}
    for tag, model in (("lean", ours), ("torchvision", theirs)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs[tag] = model(_features())
    lean = [s for s in seen if s[0] == "lean"]
    tv = [s for s in seen if s[0] == "torchvision"]
    assert len(lean) == len(tv) == 2  # one upsample per level below the top
    assert all(not on and dtype == torch.bfloat16 for _, on, dtype in lean)
    assert all(on and dtype == torch.float32 for _, on, dtype in tv)  # torchvision's, on CUDA
    # the outputs stay in the autocast dtype either way (each ends in a conv)
    assert all(v.dtype == torch.bfloat16 for v in outputs["lean"].values())


def test_the_toolkit_builds_the_lean_fpn_unless_told_otherwise() -> None:
    torch.manual_seed(0)
    lean = build_backbone("resnet18", trainable_layers=5)
    torch.manual_seed(0)
    tv = build_backbone("resnet18", trainable_layers=5, fpn="torchvision")
    assert type(lean.fpn) is LeanFeaturePyramidNetwork and type(tv.fpn) is FeaturePyramidNetwork
    a, b = lean.state_dict(), tv.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert config_from_dict({}).model.fpn == "lean"
    with pytest.raises(UsageError, match=r"model\.fpn: 'fp32' is not one of lean, torchvision"):
        build_backbone("resnet18", fpn="fp32")


@pytest.mark.parametrize("bad", ["fp32", "Lean"])
def test_the_fpn_key_is_checked(bad: str) -> None:
    with pytest.raises(ValueError, match=r"model\.fpn"):
        config_from_dict({"model": {"fpn": bad}})


def test_lean_fpn_changes_a_model_in_place_and_keeps_its_parameters() -> None:
    _, theirs = _pair()
    params = list(theirs.parameters())
    nested = torch.nn.Sequential(theirs)
    assert lean_fpn(nested) is nested and type(nested[0]) is LeanFeaturePyramidNetwork
    assert all(a is b for a, b in zip(nested.parameters(), params, strict=True))
    lean_fpn(nested)  # twice: a no-op
    assert type(nested[0]) is LeanFeaturePyramidNetwork

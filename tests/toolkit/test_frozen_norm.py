"""The lean FrozenBatchNorm2d: torchvision's numbers in fp32, the input's dtype under autocast,
the same state_dict; the toolkit's detectors built with it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import resnet18
from torchvision.ops.misc import FrozenBatchNorm2d as TorchvisionFrozenBN

from dropit_core import FrozenBatchNorm2d, dropit_record, lean_frozen_batchnorm, to_dropit
from dropit_core.memory import saved_activations
from rcnn_dropit.config import config_from_dict
from rcnn_dropit.models import build_backbone, build_model


def _random_buffers(norm: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    c = norm.weight.numel()
    norm.weight.copy_(torch.randn(c, generator=gen))
    norm.bias.copy_(torch.randn(c, generator=gen))
    norm.running_mean.copy_(torch.randn(c, generator=gen))
    norm.running_var.copy_(torch.rand(c, generator=gen) + 0.1)
    return norm


@torch.no_grad()
def _pair(channels: int = 8) -> tuple[nn.Module, nn.Module]:
    theirs = _random_buffers(TorchvisionFrozenBN(channels))
    ours = FrozenBatchNorm2d(channels)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def test_fp32_output_and_input_gradient_are_torchvisions_bit_for_bit() -> None:
    ours, theirs = _pair()
    x = torch.randn(2, 8, 5, 7, requires_grad=True)
    y_ours, y_theirs = ours(x), theirs(x)
    assert torch.equal(y_ours, y_theirs)
    g = torch.randn_like(y_ours)
    (gx_ours,) = torch.autograd.grad(y_ours, x, g)
    (gx_theirs,) = torch.autograd.grad(y_theirs, x, g)
    assert torch.equal(gx_ours, gx_theirs)


def test_under_autocast_the_output_keeps_the_input_dtype() -> None:
    ours, theirs = _pair()
    x = torch.randn(2, 8, 5, 7, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ours(x).dtype == torch.bfloat16
        assert theirs(x).dtype == torch.float32  # the promotion this module exists to avoid
    # the same values as torchvision's, within bf16 rounding of scale, bias and the result
    torch.testing.assert_close(ours(x).float(), theirs(x), rtol=0.03, atol=0.03)


def test_state_dict_keys_are_torchvisions_and_imagenet_counters_load() -> None:
    ours, theirs = _pair()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    # an ImageNet BatchNorm file carries num_batches_tracked: loaded strictly, it is dropped
    state = {**theirs.state_dict(), "num_batches_tracked": torch.tensor(7)}
    FrozenBatchNorm2d(8).load_state_dict(state, strict=True)


def test_lean_frozen_batchnorm_swaps_every_torchvision_norm_in_place() -> None:
    torch.manual_seed(0)
    model = resnet18(norm_layer=TorchvisionFrozenBN)
    for m in model.modules():
        if isinstance(m, TorchvisionFrozenBN):
            _random_buffers(m, seed=m.weight.numel())
    before = {k: v for k, v in model.state_dict().items()}
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    assert lean_frozen_batchnorm(model) is model
    norms = [m for m in model.modules() if isinstance(m, (TorchvisionFrozenBN, FrozenBatchNorm2d))]
    assert len(norms) == 20 and all(type(m) is FrozenBatchNorm2d for m in norms)
    after = model.state_dict()
    assert list(after) == list(before)
    # the buffers are the same tensors, not copies
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    # a second call changes nothing; a bare norm comes back converted
    assert lean_frozen_batchnorm(model) is model
    assert type(lean_frozen_batchnorm(TorchvisionFrozenBN(4))) is FrozenBatchNorm2d


def test_dropit_converts_a_model_with_lean_norms() -> None:
    model = lean_frozen_batchnorm(resnet18(norm_layer=TorchvisionFrozenBN))
    model = to_dropit(model, strategy="quant", exclude=("conv1", "fc"))
    (applied,) = dropit_record(model).settings
    # every conv but the stem; every ReLU but the stem's, which feeds the plain max-pool
    assert applied.layers == 19 and applied.relus == 8
    model(torch.randn(1, 3, 64, 64)).sum().backward()
    assert model.layer1[0].conv1.weight.grad is not None


TINY = {
    "backbone": "resnet18",
    "num_classes": 4,
    "min_size": 96,
    "max_size": 96,
    "fpn_channels": 32,
    "box_head_width": 64,
    "mask_head_channels": 16,
    "mask_head_convs": 1,
    "box_batch_size_per_image": 64,
    "rpn_batch_size_per_image": 64,
}


def _detector(frozen_bn: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = config_from_dict({"model": {**TINY, "frozen_bn": frozen_bn, "trainable_layers": 3}})
    model, _ = build_model(cfg)
    return model.train()


def _batch():
    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(1, 96, 96, dtype=torch.uint8)
    mask[0, 20:70, 10:60] = 1
    target = {"boxes": torch.tensor([[10.0, 20.0, 60.0, 70.0]]), "labels": torch.tensor([2])}
    target["masks"] = mask
    return [torch.rand(3, 96, 96, generator=gen) for _ in range(2)], [target, target]


def _loss(model: nn.Module, amp: bool):
    torch.manual_seed(1)  # the same proposals sampled for both models
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        return saved_activations(model, lambda: sum(model(*_batch()).values()))


def test_detector_fp32_losses_and_gradients_equal_torchvisions_norm() -> None:
    lean, tv = _detector("lean"), _detector("torchvision")
    assert any(isinstance(m, FrozenBatchNorm2d) for m in lean.modules())
    assert any(isinstance(m, TorchvisionFrozenBN) for m in tv.modules())
    grads = []
    for model in (lean, tv):
        loss, _ = _loss(model, amp=False)
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    (loss_a, grads_a), (loss_b, grads_b) = grads
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b) and all(map(torch.equal, grads_a, grads_b))


def test_under_bf16_autocast_the_relus_keep_half_and_no_conv_keeps_a_second_copy() -> None:
    kept = {}
    for impl in ("lean", "torchvision"):
        torch.manual_seed(0)
        body = build_backbone("resnet18", trainable_layers=5, frozen_bn=impl).body.train()
        kept[impl] = _bf16_forward(body, torch.rand(2, 3, 96, 96))
    lean, tv = kept["lean"], kept["torchvision"]
    # every ReLU keeps its output: bf16 instead of the promoted fp32
    assert lean.by_type["ReLU"] * 2 == tv.by_type["ReLU"]
    # and a conv reading a ReLU's output keeps that very tensor, not a bf16 cast of its own
    # (torchvision's: one cast per conv, so a block input read by conv1 and the downsample
    # conv is kept three times: fp32 by the ReLU, twice in bf16)
    assert tv.by_type["Conv2d"] - lean.by_type["Conv2d"] > lean.by_type["ReLU"] // 2
    # (the bf16 weight casts, the same for both, are most of the total at 96 px; R50-FPN at
    # 2x384 px keeps 0.60x in all: tools/bench.py --amp bf16, on the untrained workload:
    # docs/results/archive/untrained_workload.md)


def _bf16_forward(body: nn.Module, x: torch.Tensor):
    """What autograd keeps over one bf16-autocast forward of a backbone body."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, report = saved_activations(body, lambda: sum(v.float().sum() for v in body(x).values()))
    return report


@pytest.mark.parametrize("bad", ["fp32", "Lean"])
def test_the_frozen_bn_key_is_checked(bad: str) -> None:
    with pytest.raises(ValueError, match=r"model\.frozen_bn"):
        config_from_dict({"model": {"frozen_bn": bad}})

"""checkpoint_modules / uncheckpoint_modules on a ResNet-18 FPN backbone (both norms) and toys:
exact outputs, gradients and running statistics, unchanged state, saved bytes and user errors.

Exact means torch.equal, not a tolerance: the recompute runs the forward's kernels on the same
inputs (RNG replayed), so the backward reads bit-identical saved tensors in the same order.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.models.resnet import BasicBlock
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork
from torchvision.ops.misc import FrozenBatchNorm2d

from dropit_core import to_dropit
from dropit_core.memory import saved_activations
from dropit_core.recompute import checkpoint_modules, is_checkpointed, uncheckpoint_modules

STAGES = ["body.layer2", "body.layer3", "body.layer4"]
BLOCKS = [f"body.layer{k}.{i}" for k in (2, 3, 4) for i in (0, 1)]
# norm layer and trainable stages: from scratch, and the fine-tune recipe (frozen stem + layer1)
RECIPES = {"bn": (nn.BatchNorm2d, 5), "frozen_bn": (FrozenBatchNorm2d, 3)}
UNITS = ["stages", "blocks"]


def backbone(recipe: str) -> nn.Module:
    """A seeded ResNet-18 FPN backbone in train mode."""
    norm, trainable = RECIPES[recipe]
    torch.manual_seed(0)
    model = resnet_fpn_backbone(
        backbone_name="resnet18", weights=None, norm_layer=norm, trainable_layers=trainable
    )
    return model.train()


def images() -> torch.Tensor:
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward and backward of a loss that weighs every FPN level; returns the levels."""
    out = model(x)
    sum((v * v).mean() for v in out.values()).backward()
    return out


def assert_same_step(plain: nn.Module, other: nn.Module, out_plain, out_other) -> None:
    for key in out_plain:
        assert torch.equal(out_plain[key], out_other[key]), key
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, p in other.named_parameters():
        if grads[name] is None:
            assert p.grad is None, name
        else:
            assert torch.equal(p.grad, grads[name]), name
    buffers = dict(plain.named_buffers())
    for name, b in other.named_buffers():
        assert torch.equal(b, buffers[name]), name


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("patterns", [STAGES + ["fpn"], ["body.layer[234].*"]], ids=UNITS)
def test_units_give_exactly_the_plain_outputs_gradients_and_statistics(recipe, patterns):
    plain = backbone(recipe)
    model = copy.deepcopy(plain)
    units = checkpoint_modules(model, patterns)
    assert units == (STAGES + ["fpn"] if "fpn" in patterns else BLOCKS)
    assert all(is_checkpointed(model.get_submodule(u)) for u in units)
    needs_grad = []
    model.body.layer2.register_forward_pre_hook(lambda m, a: needs_grad.append(a[0].requires_grad))
    x = images()
    assert_same_step(plain, model, step(plain, x), step(model, x))
    # fine-tune recipe: layer2 is fed by a frozen stem, and its parameters still get gradients
    assert needs_grad == [recipe == "bn"]
    assert model.body.layer2[0].conv1.weight.grad.abs().sum() > 0
    if recipe == "bn":  # once per step: the recompute does not update the statistics again
        counts = {n: int(b) for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
        assert len(counts) == 20 and set(counts.values()) == {1}


def test_running_stats_with_cumulative_average_are_updated_once():
    """momentum=None averages by num_batches_tracked: a second update would change the value."""
    plain = backbone("bn")
    for m in plain.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None
    model = copy.deepcopy(plain)
    checkpoint_modules(model, STAGES)
    for _ in range(2):
        x = torch.randn(2, 3, 64, 64)
        assert_same_step(plain, model, step(plain, x), step(model, x))
    assert int(model.body.layer3[1].bn2.num_batches_tracked) == 2


class Toy(nn.Module):
    """A unit with dropout, BatchNorm1d, keyword arguments and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, *, scale: float, bias=None):
        y = self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))
        return {"y": y * scale + (0 if bias is None else bias), "h": x.sum(1)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Toy()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        out = self.block(x, scale=2.0, bias=torch.ones(4))
        return self.head(out["y"]).sum() + out["h"].sum()


def test_dropout_is_replayed_and_keywords_and_dict_outputs_pass_through():
    torch.manual_seed(0)
    plain = Net().train()
    model = copy.deepcopy(plain)
    assert checkpoint_modules(model, ["block"]) == ["block"]
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    losses = []
    for m in (plain, model):
        torch.manual_seed(3)  # the same dropout mask in both forwards
        loss = m(x)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
    assert torch.equal(model.block.bn.running_mean, plain.block.bn.running_mean)
    assert int(model.block.bn.num_batches_tracked) == 1


def test_a_retained_graph_recomputes_again_on_a_second_backward():
    torch.manual_seed(0)
    plain = Net().train()
    model = copy.deepcopy(plain)
    checkpoint_modules(model, ["block"])
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    for m in (plain, model):
        torch.manual_seed(3)
        loss = m(x)
        loss.backward(retain_graph=True)
        loss.backward()
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
    assert int(model.block.bn.num_batches_tracked) == 1


def test_state_dict_parameters_and_hooks_are_unchanged():
    model = backbone("bn")
    before = model.state_dict()
    params = list(model.parameters())
    calls = []
    model.fpn.register_forward_hook(lambda m, a, o: calls.append(1))
    checkpoint_modules(model, STAGES + ["fpn"])
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    step(model, images())
    assert calls == [1]  # the unit's own hooks run once, outside the recompute


def test_eval_and_no_grad_run_the_plain_forward():
    plain = backbone("bn")
    model = copy.deepcopy(plain)
    checkpoint_modules(model, STAGES + ["fpn"])
    x = images()
    with torch.no_grad():  # training mode without grad: plain forward, statistics updated once
        a, b = plain(x), model(x)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert int(model.body.layer4[0].bn1.num_batches_tracked) == 1
    plain.eval(), model.eval()
    a, report_plain = saved_activations(plain, lambda: plain(x))
    b, report = saved_activations(model, lambda: model(x))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # eval with grad enabled: nothing is checkpointed, so autograd keeps what the plain one keeps
    assert report.total_bytes == report_plain.total_bytes > 0


def test_units_keep_only_their_inputs():
    """Fine-tune recipe, stages and FPN checkpointed: autograd keeps exactly the four stage
    outputs (the units' inputs: layer1's for layer2, ..., all four for the FPN)."""
    plain = backbone("frozen_bn")
    model = copy.deepcopy(plain)
    checkpoint_modules(model, STAGES + ["fpn"])
    x = images()
    _, report_plain = saved_activations(plain, lambda: plain(x))
    _, report = saved_activations(model, lambda: model(x))
    with torch.no_grad():
        stage_outputs = plain.body(x)
    assert report.total_bytes == sum(t.nbytes for t in stage_outputs.values())
    assert report.total_bytes < report_plain.total_bytes / 4
    assert set(report.by_module) <= set(STAGES + ["fpn"])


def test_undo_restores_plain_classes():
    plain = backbone("bn")
    model = copy.deepcopy(plain)
    checkpoint_modules(model, ["body.layer[234].*", "fpn"])
    assert type(model.body.layer2[0]).__name__ == "CheckpointedBasicBlock"
    assert sorted(uncheckpoint_modules(model)) == sorted(BLOCKS + ["fpn"])
    assert type(model.body.layer2[0]) is BasicBlock
    assert type(model.fpn) is FeaturePyramidNetwork
    assert not any(is_checkpointed(m) for m in model.modules())
    x = images()
    _, report_plain = saved_activations(plain, lambda: plain(x))
    _, report = saved_activations(model, lambda: model(x))
    assert report.total_bytes == report_plain.total_bytes
    assert checkpoint_modules(model, ["fpn"]) == ["fpn"]  # and it can be checkpointed again


def test_pickle_and_deepcopy_keep_units():
    plain = backbone("bn")
    model = copy.deepcopy(plain)
    checkpoint_modules(model, STAGES)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert [p for p, m in clone.named_modules() if is_checkpointed(m)] == STAGES
        reference = copy.deepcopy(plain)
        x = images()
        assert_same_step(reference, clone, step(reference, x), step(clone, x))


def test_nested_patterns_make_only_the_outermost_a_unit():
    model = backbone("bn")
    assert checkpoint_modules(model, []) == []
    assert checkpoint_modules(model, ["body.layer2.0", "body.layer2", "body.layer[1-4].1"]) == [
        "body.layer1.1",
        "body.layer2",
        "body.layer3.1",
        "body.layer4.1",
    ]
    assert not is_checkpointed(model.body.layer2[0])


def test_combines_with_dropit_on_the_layers_it_does_not_cover():
    """DropIT on the FPN changes its weight gradients, not the gradient it passes to the body:
    the body's gradients stay exactly those of the same DropIT model without checkpointing."""
    plain = backbone("bn")
    model = copy.deepcopy(plain)
    checkpoint_modules(model, STAGES)
    for m in (plain, model):
        to_dropit(m, "mink", 0.8, include=["fpn"])
    x = images()
    assert_same_step(plain, model, step(plain, x), step(model, x))


def test_a_pattern_that_matches_nothing_is_a_clear_error():
    model = backbone("bn")
    with pytest.raises(ValueError, match=r"'body\.layer5' matches no module; did you mean"):
        checkpoint_modules(model, ["body.layer5"])
    with pytest.raises(ValueError, match="must be a list, got the string 'fpn'"):
        checkpoint_modules(model, "fpn")
    assert not any(is_checkpointed(m) for m in model.modules())


def test_a_second_call_is_an_error():
    model = backbone("bn")
    checkpoint_modules(model, STAGES)
    with pytest.raises(ValueError, match=r"already has checkpointed modules \(e\.g\. body\.layer2"):
        checkpoint_modules(model, ["fpn"])
    assert not is_checkpointed(model.fpn)


def test_units_over_dropit_layers_or_replaced_forwards_are_refused():
    model = backbone("bn")
    to_dropit(model, "mink", 0.8, include=["body.layer3"])
    with pytest.raises(ValueError, match=r"body\.layer3 would contain the DropIT layer body\."):
        checkpoint_modules(model, ["body.layer2", "body.layer3"])
    assert not is_checkpointed(model.body.layer2)  # nothing was swapped
    model = backbone("bn")
    model.fpn.forward = lambda x: x
    with pytest.raises(ValueError, match="cannot checkpoint fpn: its instance overrides forward"):
        checkpoint_modules(model, ["fpn"])

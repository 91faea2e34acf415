"""The host bench: DropIT's kernel path runs with its launches stubbed, and everything is put
back afterwards; its rows are microseconds per layer (timing itself is not asserted)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dropit_core import current_settings, to_dropit
from dropit_core.backends.triton import quant as kq
from dropit_core.backends.triton import relu as kr
from instruments.measure import host_bench


def test_stubbed_launches_take_the_kernel_path_and_launch_nothing(monkeypatch) -> None:
    grids = []
    monkeypatch.setattr(
        host_bench._NoLaunch,
        "__getitem__",
        lambda self, grid: grids.append(grid) or (lambda *a, **k: None),
    )
    originals = (kq.quant_codes_kernel, kr.relu_mask_kernel)
    torch.manual_seed(0)
    model = to_dropit(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)),
                      strategy="quant", bits=4, strict=False)  # fmt: skip
    x = torch.randn(1, 3, 9, 9, requires_grad=True)
    with host_bench.stubbed_launches():
        assert current_settings().kernels == "triton"
        model(x).sum().backward()
    # each conv's pack and rebuild, the ReLU's forward and backward: every wrapper reached its
    # launch with its grid, and nothing ran
    assert len(grids) == 6 and all(isinstance(g, tuple) and g[0] >= 1 for g in grids)
    assert (kq.quant_codes_kernel, kr.relu_mask_kernel) == originals
    assert current_settings().kernels == "auto"


def test_stubbed_launches_put_everything_back_after_an_error() -> None:
    originals = [
        getattr(m, k) for m, k in ((kq, "quant_rebuild_kernel"), (kr, "relu_mask_grad_kernel"))
    ]
    with pytest.raises(RuntimeError, match="boom"), host_bench.stubbed_launches():
        raise RuntimeError("boom")
    assert [kq.quant_rebuild_kernel, kr.relu_mask_grad_kernel] == originals
    assert current_settings().kernels == "auto"


def test_host_costs_rows_are_per_unit_microseconds_and_launches() -> None:
    layers = 2
    rows = host_bench.host_costs(repeats=1, layers=layers, steps=2)
    assert [(r["stack"], r["dropit"]) for r in rows] == list(host_bench.STACKS)
    for r in rows:
        assert r["plain_us"] > 0 and r["dropit_us"] > 0 and r["layers"] == layers
        assert r["extra_us"] == pytest.approx(r["dropit_us"] - r["plain_us"], abs=0.11)

    def extra(stack: str, dropit: str) -> float:
        """Launches per step that DropIT adds to the plain stack."""
        (row,) = [r for r in rows if (r["stack"], r["dropit"]) == (stack, dropit)]
        return round((row["dropit_launches"] - row["plain_launches"]) * layers, 6)

    # A quant conv: one pack and one rebuild launch each; through its autograd Function also
    # one step's copy of the loss's expanded gradient, which aten's conv backward (the plain
    # conv's) reads as it is, and so does the masked ReLU's kernel, which otherwise launches as
    # many as the plain ReLU. A DropIT norm adds its pack and rebuild.
    assert extra("conv", "layers") == 2 * layers + 1
    assert extra("conv+relu", "layers") == 2 * layers + 1
    assert extra("conv+bn+relu", "layers+norm") - extra("conv+bn+relu", "layers") == 2 * layers
    # Saved hooks: each BatchNorm input and ReLU output packed in one launch (a ReLU output saved
    # by the ReLU and the next conv once), each use of it rebuilt in one: 5 per unit, less the
    # last unit's ReLU output, which no conv reads.
    assert extra("conv+bn+relu", "saved hooks") == 5 * layers - 1
    # Bare Functions launch what the plain layers launch: the rows differ by host time only.
    assert extra("conv", "bare Function") == extra("conv+relu", "bare Function") == 0


def _input_and_weight_grads(models: tuple[nn.Module, ...]) -> list[list[torch.Tensor]]:
    """Each model's input and parameter gradients of one loss on the same input."""
    x = torch.randn(2, host_bench.CHANNELS, 6, 6)
    grads = []
    for model in models:
        xi = x.clone().requires_grad_(True)
        model(xi).square().sum().backward()
        grads.append([xi.grad, *(p.grad for p in model.parameters())])
    return grads


def test_bare_functions_compute_the_plain_stacks_gradients() -> None:
    plain = host_bench._stack(3, "conv+relu")
    bare = host_bench._dropit(plain, "bare Function")
    assert {type(m).__name__ for m in bare} == {"_BareConv", "_BareReLU"}
    for a, b in zip(*_input_and_weight_grads((plain, bare)), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_host_markdown_keeps_the_columns_of_rows_measured_before_launch_counts() -> None:
    old = [{"stack": "conv", "plain_us": 44.1, "dropit_us": 149.0, "extra_us": 104.9}]
    assert host_bench.host_markdown(old).splitlines()[2] == "| conv | 44.1 | 149.0 | +104.9 |"
    new = [dict(old[0], dropit="layers", plain_launches=4.05, dropit_launches=6.1)]
    assert host_bench.host_markdown(new).splitlines()[2] == (
        "| conv | layers | 44.1 | 149.0 | +104.9 | 4.05 → 6.1 |"
    )

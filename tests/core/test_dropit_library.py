"""dropit_core as a library: torch alone is enough, a strategy of one's own plugs in by name or
class, and one list of exclusions fits models that lack some of its modules (strict=False)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dropit_core import (
    PAPER_EXCLUDE,
    REGISTRY,
    Packed,
    Strategy,
    build_strategy,
    dropit_record,
    register_strategy,
    to_dropit,
)
from dropit_core.formats.packed import QuantMeta

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_it_imports_and_converts_with_torch_alone() -> None:
    # torchvision, pycocotools and yaml hidden: importing any of them fails in this process
    script = textwrap.dedent(
        """
        import importlib.abc, sys
        HIDDEN = ("torchvision", "pycocotools", "yaml", "rcnn_dropit")
        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in HIDDEN:
                    raise ModuleNotFoundError(f"hidden: {name}")
        sys.meta_path.insert(0, Hide())
        import torch
        from torch import nn
        import dropit_core
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(),
                              nn.LazyLinear(2))
        model(torch.randn(1, 3, 8, 8))
        assert dropit_core.lean_detector(model) is model  # nothing of torchvision's: no import
        converted = dropit_core.to_dropit(model, strategy="quant",
                                          exclude=dropit_core.PAPER_EXCLUDE, strict=False)
        assert converted is model and len(dropit_core.dropit_record(model)) == 4
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        assert model[2].weight.grad is not None
        assert not any(m.split(".")[0] in HIDDEN for m in sys.modules)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


class _KeepHalf(Strategy):
    """A user's strategy: every value at half precision (bf16), the rest of the contract as ours."""

    name = "keep_bf16_test"
    options = ()
    keeps = "every element, in bf16"
    cache_bytes = "2 n"
    uses_gamma = False
    skips_common = ("values", "int8_chunk", "int4_chunk")

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        return Packed(QuantMeta(tuple(x.shape), x.dtype), values=x.to(torch.bfloat16))

    def _unpack(self, packed: Packed) -> torch.Tensor:
        return packed.values.to(packed.meta.dtype)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


@pytest.fixture
def own_strategy():
    """Takes _KeepHalf out of the registry after the test: the docs' tables list the built-in
    strategies only."""
    yield _KeepHalf
    REGISTRY._classes.pop(_KeepHalf.name, None)  # the registry has no remove: only tests need one


def test_a_strategy_of_ones_own_by_class_then_by_name(own_strategy) -> None:
    x = torch.randn(2, 3, 8, 8)
    plain = _net()
    plain(x).square().sum().backward()
    for strategy in (own_strategy, "keep_bf16_test"):  # the class registers itself on first use
        model = to_dropit(_net(), strategy=strategy)
        assert dropit_record(model).settings[0].strategy == "keep_bf16_test"
        model(x).square().sum().backward()
        for got, want in zip(model.parameters(), plain.parameters(), strict=True):
            # the weight gradients come from bf16 inputs: within bf16 rounding of the exact ones
            torch.testing.assert_close(got.grad, want.grad, rtol=2e-2, atol=2e-2)
    assert type(build_strategy("keep_bf16_test", 0.0)) is _KeepHalf
    with pytest.raises(ValueError, match="is taken"):
        register_strategy(type("Other", (_KeepHalf,), {}))


def test_strict_false_lets_patterns_match_nothing() -> None:
    with pytest.raises(ValueError, match="matches no module"):
        to_dropit(_net(), exclude=PAPER_EXCLUDE)
    model = to_dropit(_net(), exclude=PAPER_EXCLUDE, strict=False)
    assert [layer.path for layer in dropit_record(model)] == ["0", "1", "3"]

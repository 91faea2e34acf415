"""The host bench: DropIT's kernel path runs with its launches stubbed, and everything is put
back afterwards; its rows are microseconds per layer (timing itself is not asserted)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dropit_core import dispatch, to_dropit
from dropit_core.kernels import quant as kq
from dropit_core.kernels import relu as kr
from instruments.measure import host_bench


def test_stubbed_launches_take_the_kernel_path_and_launch_nothing(monkeypatch) -> None:
    grids = []
    monkeypatch.setattr(
        host_bench._NoLaunch,
        "__getitem__",
        lambda self, grid: grids.append(grid) or (lambda *a, **k: None),
    )
    originals = (kq._quant_codes_kernel, kr._relu_mask_kernel)
    torch.manual_seed(0)
    model = to_dropit(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)),
                      strategy="quant", bits=4, strict=False)  # fmt: skip
    x = torch.randn(1, 3, 9, 9, requires_grad=True)
    with host_bench.stubbed_launches():
        assert dispatch.kernel_mode() == "triton"
        model(x).sum().backward()
    # each conv's pack and rebuild, the ReLU's forward and backward: every wrapper reached its
    # launch with its grid, and nothing ran
    assert len(grids) == 6 and all(isinstance(g, tuple) and g[0] >= 1 for g in grids)
    assert (kq._quant_codes_kernel, kr._relu_mask_kernel) == originals
    assert dispatch.kernel_mode() == "auto"


def test_stubbed_launches_put_everything_back_after_an_error() -> None:
    originals = [
        getattr(m, k) for m, k in ((kq, "_quant_rebuild_kernel"), (kr, "_relu_mask_grad_kernel"))
    ]
    with pytest.raises(RuntimeError, match="boom"), host_bench.stubbed_launches():
        raise RuntimeError("boom")
    assert [kq._quant_rebuild_kernel, kr._relu_mask_grad_kernel] == originals
    assert dispatch.kernel_mode() == "auto"


def test_host_costs_rows_are_per_layer_microseconds() -> None:
    rows = host_bench.host_costs(repeats=1, layers=2, steps=2)
    assert [r["stack"] for r in rows] == ["conv", "conv+relu"]
    for r in rows:
        assert r["plain_us"] > 0 and r["dropit_us"] > 0 and r["layers"] == 2
        assert r["extra_us"] == pytest.approx(r["dropit_us"] - r["plain_us"], abs=0.11)


@pytest.mark.parametrize(
    "block, source",
    [("bench-host-before", "bench_host_cpu_before"), ("bench-host", "bench_host_cpu")],
)
def test_memory_md_host_tables_are_their_json_files(block: str, source: str) -> None:
    import json
    from pathlib import Path

    from instruments.measure.methods_table import splice

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "docs/results/memory.md").read_text()
    rows = json.loads((repo / f"docs/results/{source}.json").read_text())
    assert host_bench.is_host_rows(rows)
    assert splice(text, host_bench.host_markdown(rows), block=block) == text

"""The live-tensor probe: the forward's peak to the op, its storages by the line that made them,
split into what backward keeps, what stays alive otherwise, and the working set."""

from __future__ import annotations

import pytest
import torch

from instruments.measure.live_probe import MB, live_at_peak
from tests.toolkit.test_lean_forward import QUANT, _batch, _models

N = 1 << 18  # floats: 1 MiB each


def _forward(w: torch.Tensor) -> torch.Tensor:
    a = torch.ones(N) * 2.0  # line A: freed after b is made
    b = a * w  # line B: saved by nothing (w needs grad, a does not: mul saves a)
    del a
    c = torch.exp(b)  # line C: exp saves its output
    del b
    return c.sum()


def test_the_peak_and_its_split_are_exact_for_a_small_function() -> None:
    w = torch.ones(N, requires_grad=True)
    loss, report = live_at_peak(lambda: _forward(w), [w])
    # Peak after the exp: a (saved by mul), b (alive until exp has run) and c (saved by exp)
    assert report.op_name == "exp"
    assert report.peak_mb == 3.0
    assert report.saved_mb == 2.0 and report.transient_mb == 1.0 and report.held_mb == 0.0
    by_line = {g.where.split(" ")[0].rsplit(":", 1)[0]: g for g in report.groups}
    assert set(by_line) == {"tests/instruments/test_live_probe.py"}
    lines = {g.where for g in report.groups}
    assert len(lines) == 3  # ones*2 (the product's storage), a*w, exp
    freed = [g for g in report.groups if g.transient_mb]
    assert len(freed) == 1 and "b = a * w" not in freed[0].where and freed[0].mb == 1.0
    loss.backward()
    assert torch.equal(w.grad, torch.full((N,), 2.0).exp() * 2.0)
    text = "\n".join(report.lines())
    assert "forward peak 3.0 MB" in text and "working set (freed before the end) 1.0 MB" in text


def test_a_view_and_an_in_place_result_are_not_new_storages() -> None:
    def forward() -> torch.Tensor:
        x = torch.zeros(N)
        x.add_(1.0)  # in place: the same storage
        return x.view(-1, 2)  # a view: the same storage

    out, report = live_at_peak(forward)
    assert report.peak_mb == 1.0 and report.end_mb == 1.0 and report.held_mb == 1.0
    assert out.shape == (N // 2, 2)


@pytest.mark.slow
def test_the_lean_forward_holds_less_than_torchvisions_at_its_peak() -> None:
    """On a small Mask R-CNN with quant 4-bit and torchvision's FPN width (so that, as in the
    R50 recipe, the pyramid's maps outweigh the stem's): the same saved bytes, a smaller peak
    and working set."""
    reports = {}
    models = _models(
        dropit=QUANT, fpn_channels=256, min_size=256, max_size=256, box_batch_size_per_image=8
    )
    for name, model in zip(("lean", "torchvision"), models, strict=True):
        batch = _batch()
        model(*batch)  # warm
        given = [*model.parameters(), *model.buffers(), *batch[0]]
        given += [v for t in batch[1] for v in t.values()]
        torch.manual_seed(1)
        loss, reports[name] = live_at_peak(lambda m=model, b=batch: sum(m(*b).values()), given)
        loss.backward()
    lean, plain = reports["lean"], reports["torchvision"]
    assert abs(lean.end_mb - plain.end_mb) < 1e-6  # what backward gets is the same
    assert lean.transient_mb < 0.8 * plain.transient_mb, (lean.lines(), plain.lines())
    assert lean.peak_mb < plain.peak_mb
    assert plain.groups[0].mb * MB > 0

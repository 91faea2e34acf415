"""The live-tensor probe: the forward's peak to the op, its storages by the line that made them,
split into what backward keeps, what stays alive otherwise, and the working set."""

from __future__ import annotations

import pytest
import torch

from instruments.measure.live_probe import MB, Life, live_at_peak, live_through_step, peak_of
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


def test_a_step_peak_in_the_backward_names_the_nodes_that_made_its_tensors() -> None:
    w = torch.ones(N, requires_grad=True)

    def forward() -> torch.Tensor:
        b = w * 2.0  # saved by sin
        return torch.sin(b).sum()  # sin's output dies when the forward returns

    report = live_through_step(forward, [w])
    # Forward peak 2 MiB (b and sin(b)); the backward's 3 MiB: b (saved), cos(b) and the
    # product grad * cos(b), both made by SinBackward0's formula, no Python of ours
    assert (report.scope, report.phase, report.op_name) == ("step", "backward", "mul")
    # (and two fp32 scalars: the loss, and the gradient of 1 the backward starts from)
    assert report.peak_mb * MB == 3 * N * 4 + 2 * 4 and report.saved_mb == 1.0
    assert report.forward_ops < report.peak_op < report.ops
    by_line = {g.where: g for g in report.groups}
    assert by_line["[SinBackward0]"].mb == 2.0 and by_line["[SinBackward0]"].count == 2
    (forward_line,) = [g for g in report.groups if g.saved_mb]
    assert forward_line.where.startswith("tests/instruments/test_live_probe.py:")
    assert report.end_mb * MB == N * 4  # the weight's gradient
    assert torch.equal(w.grad, torch.full((N,), 2.0).cos() * 2.0)
    text = "\n".join(report.lines())
    assert "step peak 3.0 MB in the backward after op" in text and "(mul at [SinBackward0])" in text


def test_a_step_whose_backward_the_probe_cannot_see_is_refused(monkeypatch) -> None:
    # As a backward on a thread the dispatch mode does not reach would look: no op of any node
    monkeypatch.setattr(torch._C, "_current_autograd_node", lambda: None)
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="saw no op of the backward"):
        live_through_step(lambda: (w * 2.0).sum(), [w])


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


def test_the_peak_of_lives_keeps_those_alive_at_its_first_highest_point() -> None:
    lives = [Life(10, "a", 0, died=2), Life(20, "b", 1), Life(5, "c", 3), Life(15, "d", 4, 5)]
    lives.append(Life(9, "e", 6))  # after d is gone: 20 + 5 + 9 is less than 40
    peak, at, alive = peak_of(lives)
    assert (peak, at) == (40, 4) and [x.where for x in alive] == ["b", "c", "d"]


def test_bench_live_prints_a_report_per_setting_and_batch(monkeypatch, capsys) -> None:
    from instruments.commands import bench
    from instruments.measure import workload
    from rcnn_dropit.config import with_overrides
    from tests.instruments.rehearse_stage import WIDTHS

    recipe = workload.recipe_config

    def narrow(scratch, image_size, *args, **kwargs):
        return with_overrides(recipe(scratch, image_size, 16, "resnet18"), WIDTHS, source="test")

    monkeypatch.setattr(workload, "recipe_config", narrow)
    argv = ["live", "--device", "cpu", "--image-size", "64", "--images", "1", "2", "--step"]
    assert bench.main([*argv, "--settings", "baseline", "quant_4bit", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 4 and out.count("step peak") == 4
    assert "== quant_4bit, 2 images of 64 px, cpu amp none; the trained workload: " in out
    assert out.count(" positive RoIs per image") == 4  # what each probed step's heads saw

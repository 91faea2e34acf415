"""saved_activations counts exactly the bytes autograd keeps, baseline and DropIT, by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dropit_core import memory, to_dropit
from dropit_core.memory import MB, PeakMeter, measure_step, saved_activations

X_SHAPE = (2, 3, 6, 6)  # conv1 input: 216 elements
H_SHAPE = (2, 4, 6, 6)  # conv1 output / ReLU output / conv2 input: 288 elements
N1, N2 = math.prod(X_SHAPE), math.prod(H_SHAPE)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, padding=1))


def _x() -> torch.Tensor:
    return torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(1))


def _mink_bytes(n: int, gamma: float, value_bytes: int = 4) -> int:
    # strategies.py: ceil(n/8) mask bytes + kept values, kept = int((1-gamma)*n).
    return math.ceil(n / 8) + int((1.0 - gamma) * n) * value_bytes


def test_baseline_counts_inputs_and_relu_output_once() -> None:
    model = _model()
    x = _x()
    out, report = saved_activations(model, lambda: model(x))
    # conv1 keeps its input x; ReLU keeps its output, which conv2 keeps too (same storage, once);
    # the weights are parameters and are not counted.
    conv1_input, relu_output = N1 * 4, N2 * 4
    assert report.total_bytes == conv1_input + relu_output == 2016
    assert report.by_type == {"Conv2d": conv1_input, "ReLU": relu_output}
    assert report.by_module == {"0": conv1_input, "1": relu_output}
    assert report.converted_bytes == 0
    assert report.unconverted_bytes == report.total_bytes
    d = report.as_dict()
    assert d["saved_mb"] == pytest.approx(2016 / MB)
    assert d["by_type_mb"] == {"Conv2d": pytest.approx(864 / MB), "ReLU": pytest.approx(1152 / MB)}
    assert d["converted_mb"] == 0.0
    assert d["unconverted_mb"] == pytest.approx(2016 / MB)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_parameters_are_never_counted() -> None:
    torch.manual_seed(2)
    model = nn.Linear(50, 40)  # 2000 weights: would dwarf the 5*50 input if counted
    x = torch.randn(5, 50)
    _, report = saved_activations(model, lambda: model(x))
    assert report.total_bytes == 5 * 50 * 4


def test_dropit_mink_counts_masks_and_packed_caches() -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    to_dropit(model, strategy="mink", gamma=0.8)
    x = _x()
    # The conv2 input is a ReLU output: about half zeros, still more than the 57 values kept.
    assert int((plain[1](plain[0](x)) > 0).sum()) > int(0.2 * N2)
    out, report = saved_activations(model, lambda: model(x))
    conv1 = _mink_bytes(N1, 0.8)  # 27 + 43*4
    relu = math.ceil(N2 / 8)  # 36: one bit per element
    conv2 = _mink_bytes(N2, 0.8)  # 36 + 57*4
    assert (conv1, relu, conv2) == (199, 36, 264)
    assert report.total_bytes == conv1 + relu + conv2
    assert report.by_type == {"Conv2d": conv1 + conv2, "ReLU": relu}
    assert report.by_module == {"0": conv1, "1": relu, "2": conv2}
    assert report.converted_bytes == report.total_bytes
    assert report.unconverted_bytes == 0

    # The graph is alive in the result: backward works and non-weight gradients are exact.
    out.sum().backward()
    plain(x).sum().backward()
    for name in ("2.bias", "0.bias"):
        got, want = model.get_parameter(name).grad, plain.get_parameter(name).grad
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for p in model.parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all())


def test_converted_and_unconverted_split() -> None:
    model = _model()
    to_dropit(model, strategy="mink", gamma=0.8, exclude=("0",))
    _, report = saved_activations(model, lambda: model(_x()))
    conv1_plain = N1 * 4  # excluded: keeps its full input
    relu, conv2 = math.ceil(N2 / 8), _mink_bytes(N2, 0.8)
    assert report.total_bytes == conv1_plain + relu + conv2
    assert report.by_type == {"Conv2d": conv1_plain + conv2, "ReLU": relu}
    assert report.converted_bytes == relu + conv2
    assert report.unconverted_bytes == conv1_plain


def test_counts_are_per_forward_and_hooks_are_removed() -> None:
    model = _model()
    x = _x()
    _, first = saved_activations(model, lambda: model(x))
    _, second = saved_activations(model, lambda: model(x))
    assert first.total_bytes == second.total_bytes == 2016
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_int8_cache_storage_matches_the_formula() -> None:
    model = _model()
    to_dropit(model, strategy="mink", gamma=0.8, values="int8", int8_chunk=16)
    _, report = saved_activations(model, lambda: model(_x()))
    k1, k2 = int(0.2 * N1), int(0.2 * N2)  # 43 and 57 kept values
    conv1 = math.ceil(N1 / 8) + k1 + 4 * math.ceil(k1 / 16)
    conv2 = math.ceil(N2 / 8) + k2 + 4 * math.ceil(k2 / 16)
    assert report.total_bytes == conv1 + math.ceil(N2 / 8) + conv2


def test_peak_meter_on_the_cpu_counts_tensor_bytes_exactly() -> None:
    held = torch.ones(2**20)  # 4 MiB alive at the start

    def call() -> torch.Tensor:
        big = torch.ones(2 * 2**20)  # +8 MiB: 12 MiB at once
        del big
        small = torch.ones(2**19)  # +2 MiB after the big one is gone
        meter.mark()
        return small

    meter = PeakMeter("cpu", lambda: [held, held[:10]])  # a view counts its storage once
    out = meter.measure(call)
    assert out.numel() == 2**19 and meter.source == "cpu"
    assert meter.start_bytes == 4 * 2**20
    assert meter.peak_bytes == 12 * 2**20  # exact: the heap malloc keeps does not count
    assert meter.marks == [(6 * 2**20, 12 * 2**20)]  # alive at the mark, and the peak so far


def test_training_tensors_are_the_weights_gradients_state_and_batch() -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _linear_loss(model, 3).backward()
    optimizer.step()
    batch = [torch.zeros(3), {"boxes": torch.zeros(5), "id": 7}]
    held = memory.training_tensors(model, optimizer, batch)
    # weight and bias, their gradients, their momentum buffers, two batch tensors
    assert len(held) == 2 + 2 + 2 + 2
    assert memory.storage_bytes(held) == 3 * (8 + 2) * 4 + (3 + 5) * 4


def _fake_cuda(monkeypatch) -> list[tuple[str, object]]:
    """Pretend CUDA is there; record which device each statistics call is asked about."""
    calls: list[tuple[str, object]] = []

    def record(name: str, value: float = 0.0):
        def fn(device=None):
            if torch.device(device).type != "cuda":
                raise RuntimeError(f"Expected a cuda device, but got: {device}")
            calls.append((name, device))
            return value

        return fn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", record("peak", 3 * 1024 * 1024))
    monkeypatch.setattr(torch.cuda, "memory_allocated", record("now", 2 * 1024 * 1024))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset"))
    return calls


@pytest.mark.parametrize("device", [torch.device("cpu"), "cpu"])
def test_the_meters_leave_the_allocator_alone_for_a_cpu_device_on_a_gpu_node(
    monkeypatch, device
) -> None:
    # A train.device=cpu run on a GPU node used to die here with "Expected a cuda device".
    calls = _fake_cuda(monkeypatch)
    meter = PeakMeter(device)
    meter.measure(lambda: meter.mark())
    window = memory.WindowPeak(device)
    window.step(lambda: torch.ones(10), tuple, measure=True)
    assert window.take_mb() is not None
    assert calls == []


def test_the_meters_query_the_cuda_device_they_are_given(monkeypatch) -> None:
    calls = _fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    meter = PeakMeter(torch.device("cuda", 1))
    meter.measure(lambda: None)
    assert meter.peak_bytes == 3 * MB and meter.start_bytes == 2 * MB
    assert memory.WindowPeak("cuda").take_mb() == 3.0  # no index: the current CUDA device
    assert [name for name, _ in calls] == ["reset", "now", "peak", "reset", "peak", "reset"]
    assert {device for _, device in calls[:3]} == {torch.device("cuda", 1)}
    assert calls[3][1] == torch.device("cuda")


def _fake_allocator(monkeypatch) -> dict[str, float]:
    """A fake CUDA caching allocator: counters in MB that a test moves by hand."""
    state = {"allocated": 0.0, "peak": 0.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"] * MB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"] * MB)
    monkeypatch.setattr(
        torch.cuda,
        "reset_peak_memory_stats",
        lambda device=None: state.update(peak=state["allocated"]),
    )
    return state


def test_peak_meter_on_cuda_reads_the_allocator_from_its_own_start(monkeypatch) -> None:
    # Other models still hold 3000 MB: they are the start; an earlier, larger peak is forgotten.
    state = _fake_allocator(monkeypatch)
    state.update(allocated=3000.0, peak=5000.0)

    def call() -> None:
        state.update(allocated=3400.0, peak=3700.0)  # after the forward
        meter.mark()
        state.update(allocated=3100.0, peak=3900.0)  # after the backward

    meter = PeakMeter(torch.device("cuda", 0))
    meter.measure(call)
    assert meter.cuda and meter.source == "cuda" and meter.start_bytes == 3000 * MB
    assert meter.marks == [(3400 * MB, 3700 * MB)] and meter.peak_bytes == 3900 * MB


def test_peak_meter_on_the_cpu_ignores_the_allocator_on_a_gpu_node(monkeypatch) -> None:
    state = _fake_allocator(monkeypatch)
    state.update(allocated=3000.0, peak=5000.0)
    meter = PeakMeter("cpu")
    meter.measure(lambda: torch.ones(256))
    assert not meter.cuda and meter.start_bytes == 0 and meter.peak_bytes == 1024


def test_a_window_peak_is_read_then_reset_on_the_device(monkeypatch) -> None:
    state = _fake_allocator(monkeypatch)
    state.update(allocated=1.0, peak=3.0)
    window = memory.WindowPeak(torch.device("cuda", 1))  # a new window starts at the allocation
    state.update(peak=2.0)
    assert window.take_mb() == 2.0
    assert window.take_mb() == 1.0
    # a CPU window counts only the steps it measured, each as PeakMeter counts it
    cpu = memory.WindowPeak("cpu")
    cpu.step(lambda: torch.ones(2**20), tuple, measure=False)
    assert cpu.take_mb() is None
    for n in (2**18, 2**20, 2**19):
        cpu.step(lambda n=n: torch.ones(n), tuple, measure=True)
    assert cpu.take_mb() == 4.0 and cpu.take_mb() is None
    assert state["peak"] == 1.0  # the allocator's window left alone by the CPU's


def _linear_loss(model: nn.Module, rows: int) -> torch.Tensor:
    return model(torch.randn(rows, 4)).square().sum()


def test_measure_step_takes_each_figure_above_the_start_and_names_the_peaks(monkeypatch) -> None:
    state = _fake_allocator(monkeypatch)
    state.update(allocated=3000.0, peak=5000.0)  # other models, and an earlier, larger peak
    model = nn.Linear(4, 2)
    _linear_loss(model, 1).backward()  # gradients of an earlier step: freed before the start

    def forward() -> torch.Tensor:
        loss = _linear_loss(model, 3)
        state.update(allocated=3400.0, peak=3700.0)  # the graph alive, the transients gone
        loss.register_hook(lambda grad: state.update(peak=3900.0))  # the backward tops it
        return loss

    step = measure_step(model, [forward], torch.device("cuda", 0))
    assert step.source == "cuda" and step.held_at_start_mb == 3000.0
    assert (step.live_after_forward_mb, step.forward_peak_mb, step.step_peak_mb) == (
        400.0,
        700.0,
        900.0,
    )
    assert step.step_peak_total_mb == 3900.0  # what max_memory_allocated read
    assert step.peak_phase == "backward" and step.forward_transient_mb == 300.0
    assert step.saved.total_bytes == (3 * 4 + 3 * 2) * 4  # linear's input, square's input
    assert all(p.grad is None for p in model.parameters())  # none left behind
    assert step.as_dict() == {
        "memory_source": "cuda",
        "held_at_start_mb": 3000.0,
        "live_after_forward_mb": 400.0,
        "forward_peak_mb": 700.0,
        "step_peak_mb": 900.0,
        "step_peak_total_mb": 3900.0,
        "peak_phase": "backward",
    }


def test_measure_step_over_micro_batches_knows_no_forward_peak(monkeypatch) -> None:
    state = _fake_allocator(monkeypatch)
    model = nn.Linear(4, 2)

    def later() -> torch.Tensor:
        state.update(peak=state["peak"] + 50.0)  # a later forward may top the first one's
        return _linear_loss(model, 2)

    step = measure_step(model, [lambda: _linear_loss(model, 2), later], "cuda:0")
    assert step.step_peak_mb == 50.0 and step.forward_peak_mb is None
    assert step.peak_phase is None and step.forward_transient_mb is None
    assert step.saved.total_bytes == (2 * 4 + 2 * 2) * 4  # the first micro-batch's
    with pytest.raises(ValueError, match="at least one forward"):
        measure_step(model, [], "cpu")


def test_measure_step_on_the_cpu_counts_the_step_tensors() -> None:
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    step = measure_step(model, [lambda: model(x).square().sum()], "cpu", batch=[x])
    assert step.source == "cpu"
    assert step.held_at_start_mb * MB == (8 + 2 + 12) * 4  # weights, bias, the batch
    # alive for backward: the output (square's input); at the peak also both gradients
    assert step.live_after_forward_mb * MB >= 3 * 2 * 4
    assert step.step_peak_mb * MB >= (8 + 2) * 4 and step.peak_phase in ("forward", "backward")

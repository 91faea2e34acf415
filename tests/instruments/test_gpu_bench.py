"""The GPU bench (make bench-gpu) without a GPU: counting launches and host syncs from profiler
events (synthetic ones, as a CUDA run records them), the table's rows from step and batch rows,
its Markdown, the file and the command that write them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from instruments.commands.bench import main as bench_main
from instruments.measure import gpu_table as gpu
from instruments.measure.cuda_calls import CudaCalls, count_cuda_calls, profile_cuda_calls
from instruments.measure.methods_table import markers
from instruments.measure.workload import plan_settings
from tests.helpers import REPO

PLAN = REPO / "configs/study/plan.yaml"
# What issues 26 and 39 ask the GPU table to hold, in the Makefile's order (issue 39's first).
GPU_METHODS = [
    "baseline",
    "baseline_torchvision_forward",
    "quant_4bit",
    "quant_2bit",
    "checkpoint_stages",
    "checkpoint_stages_quant_4bit",
    "quant_4bit_torchvision_forward",
    "baseline_torchvision_bn",
    "baseline_torchvision_fpn",
    "mink_0.8",
    "threshold_0.8",
    "accumulate_2",
    "accumulate_4",
]


def _events(*names: str) -> list[SimpleNamespace]:
    """Events as the profiler records them: on the host (calls, ops), or on the device (what it
    ran: a name with a space, as "Memcpy DtoH (...)" or a kernel's signature)."""
    return [
        SimpleNamespace(name=n, device_type=DeviceType.CUDA if " " in n else DeviceType.CPU)
        for n in names
    ]


def test_launches_syncs_and_copies_are_counted_by_the_calls_names() -> None:
    # What one step with an .item() records: host-side runtime and driver calls, device-side
    # kernels and copies, and torch's own ops.
    events = _events(
        "aten::convolution",
        "cudaLaunchKernel",
        "void cudnn::conv_kernel<...>",
        "cudaLaunchKernelExC",
        "cuLaunchKernel",  # a Triton kernel
        "cuLaunchKernelEx",
        "cudaLaunchKernel_ptsz",
        "cudaGraphLaunch",  # a CUDA graph: one launch
        "cudaMemcpyAsync",  # a copy enqueued: no launch, no wait
        "Memcpy DtoH (Device -> Pageable)",
        "cudaStreamSynchronize",  # .item()'s wait
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",  # a synchronous copy
        "cuMemcpyDtoH_v2",
        "cudaStreamQuery",  # asks, does not wait
        "cudaEventRecord",
        "cudaMemsetAsync",
        "Memcpy HtoD (Pageable -> Device)",
    )
    assert count_cuda_calls(events) == CudaCalls(launches=6, syncs=5, dtoh_copies=1, kernels=1)
    # KinetoEvents give their fields by methods
    kineto = [
        SimpleNamespace(name=lambda n=n: n, device_type=lambda d=d: d)
        for n, d in [
            ("cuLaunchKernel", DeviceType.CPU),
            ("triton_quant_codes", DeviceType.CUDA),
            ("cudaMemcpy", DeviceType.CPU),
        ]
    ]
    assert count_cuda_calls(kineto) == CudaCalls(launches=1, syncs=1, kernels=1)
    assert count_cuda_calls([]) == CudaCalls()


def test_counts_per_step_and_less_the_profilers_own() -> None:
    calls = CudaCalls(launches=9000, syncs=129, dtoh_copies=4, kernels=9003) - CudaCalls(syncs=2)
    assert calls.per_step(3) == {
        "launches_per_step": 3000.0,
        "syncs_per_step": 42.3,
        "dtoh_copies_per_step": 1.3,
        "kernels_per_step": 3001.0,
    }
    assert (CudaCalls(syncs=1) - CudaCalls(syncs=3)).syncs == 0


def test_profiling_steps_on_the_cpu_runs_them_and_counts_nothing() -> None:
    ran = []
    calls = profile_cuda_calls(lambda: ran.append(torch.ones(4).sum()), 3, torch.device("cpu"))
    assert len(ran) == 3 and calls == CudaCalls()


def _step_row(setting: str, n: int, k: float) -> dict:
    return {
        "setting": setting,
        "overrides": [],
        "strategy": None,
        "device": "cuda",
        "amp": "fp16",
        "image_size": 800,
        "memory_source": "cuda",
        "step_s": 0.1 * n * k,
        "step_time_ratio": k,
        "peak_mb": 300.0 * n * k,
        "peak_ratio": k,
        "peak_phase": "forward",
        "saved_mb": 100.0 * n * k,
        "launches_per_step": 1000.0 * k,
        "syncs_per_step": 60.0,
        "dtoh_copies_per_step": 2.0,
        "grad_cosine": None if k == 1 else 0.99,
    }


def test_gpu_table_rows_join_each_batch_size_and_the_largest_batch(monkeypatch) -> None:
    calls = []

    def run(settings, *args, images, profile_steps, **kwargs):
        calls.append(("steps", images, profile_steps))
        yield _step_row("baseline", images, 1.0)
        yield _step_row("quant_4bit", images, 0.5)

    def batches(settings, budget, limit, *args, **kwargs):
        calls.append(("batches", budget, limit))
        yield {"setting": "baseline", "max_batch": 21, "peak_mb_at_max": 15800.0}
        yield {"setting": "quant_4bit", "max_batch": 64, "peak_mb_at_max": 9000.0}

    monkeypatch.setattr(gpu, "run_benchmark", run)
    monkeypatch.setattr(gpu, "largest_batches", batches)
    seen = []
    base, quant = gpu.gpu_table([], (2, 8), 16000.0, 64, progress=seen.append)
    assert calls == [("steps", 2, 3), ("steps", 8, 3), ("batches", 16000.0, 64)]
    assert len(seen) == 6  # every step and batch row as it came
    assert (base["setting"], quant["setting"]) == ("baseline", "quant_4bit")
    assert quant["step_s_2img"] == pytest.approx(0.1) and quant["step_ratio_8img"] == 0.5
    assert quant["peak_mb_8img"] == 1200.0 and quant["launches_per_step_2img"] == 500.0
    assert quant["syncs_per_step_8img"] == 60.0 and quant["grad_cosine_2img"] == 0.99
    assert (base["max_batch"], base["at_limit"]) == (21, False)
    assert (quant["max_batch"], quant["at_limit"]) == (64, True)  # reached the limit: >= 64
    assert quant["budget_mb"] == 16000.0 and quant["batch_limit"] == 64


def test_gpu_table_hands_over_its_step_columns_before_the_batch_search(monkeypatch) -> None:
    order = []

    def run(settings, *args, images, profile_steps, **kwargs):
        yield _step_row("baseline", images, 1.0)

    def batches(*args, **kwargs):
        order.append("search")
        yield {"setting": "baseline", "max_batch": 21, "peak_mb_at_max": 15800.0}

    monkeypatch.setattr(gpu, "run_benchmark", run)
    monkeypatch.setattr(gpu, "largest_batches", batches)
    (row,) = gpu.gpu_table([], (2, 8), 16000.0, 64, on_steps=lambda rows: order.append(rows))
    (early, search) = order
    assert search == "search" and early[0]["step_s_8img"] == row["step_s_8img"]
    assert "max_batch" not in early[0] and row["max_batch"] == 21
    order.clear()  # a limit of 0: the step columns alone, no search
    (row,) = gpu.gpu_table([], (2,), 16000.0, 0, on_steps=order.append)
    assert len(order) == 1 and "max_batch" not in row


def _table() -> dict:
    rows = [
        {
            "setting": "baseline",
            "memory_source": "cuda",
            "step_s_2img": 0.084,
            "step_ratio_2img": 1.0,
            "peak_mb_2img": 1500.0,
            "peak_ratio_2img": 1.0,
            "saved_mb_2img": 1000.0,
            "forward_peak_mb_2img": 1300.0,
            "working_set_mb_2img": 290.0,
            "launches_per_step_2img": 2100.0,
            "syncs_per_step_2img": 60.0,
            "max_batch": 21,
            "at_limit": False,
        },
        {
            "setting": "mink_0.8",
            "memory_source": "cuda",
            "step_s_2img": 0.294,
            "step_ratio_2img": 3.5,
            "peak_mb_2img": 705.0,
            "peak_ratio_2img": 0.47,
            "saved_mb_2img": 250.0,
            "launches_per_step_2img": 9000.0,
            "syncs_per_step_2img": 129.33,
            "max_batch": 48,
            "at_limit": True,
        },
    ]
    header = {
        "command": "python tools/bench.py --gpu-table",
        "commit": "abc123",
        "date": "2026-11-25",
        "gpu": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "triton": "3.6.0",
        "kernels": "auto",
        "amp": "fp16",
        "image_size": 800,
        "images": [2],
        "budget_mb": 16000.0,
        "batch_limit": 48,
        "repeats": 8,
        "profile_steps": 3,
    }
    return {**header, "rows": rows}


def test_gpu_markdown_rows_ratios_and_the_run_behind_them() -> None:
    text = gpu.gpu_markdown(_table())
    lines = text.splitlines()
    assert lines[0] == (
        "| setting | step, 2 img | peak, 2 img | saved, 2 img | forward peak (freed in it), "
        "2 img | largest batch in 16000 MB | launches / step, 2 img | host syncs / step, 2 img |"
    )
    assert lines[2] == (
        "| baseline | 84 ms (1.00x) | 1500 MB (1.00x) | 1000 MB (1.00x) | 1300 MB (290) | 21 "
        "| 2100 | 60.0 |"
    )
    assert lines[3] == (
        "| mink_0.8 | 294 ms (3.50x) | 705 MB (0.47x) | 250 MB (0.25x) | - | >= 48 (the limit) "
        "| 9000 | 129.3 |"
    )  # saved: its ratio to the baseline's saved bytes, computed from the two rows; a row
    # without the forward's figures: "-"
    assert "the CUDA allocator's peak" in text and "3 profiled steps per setting" in text
    assert "NVIDIA H100 80GB HBM3; torch 2.11.0+cu130 (CUDA 13.0), triton 3.6.0" in text
    assert "Largest batch: one SGD step" in text
    with pytest.raises(Exception, match="expected an object with 'rows'"):
        gpu.gpu_markdown({"setting": "baseline"})


def test_gpu_markdown_without_a_batch_search_has_no_batch_column() -> None:
    table = {**_table(), "batch_limit": 0}
    lines = gpu.gpu_markdown(table).splitlines()
    assert "largest batch" not in lines[0] and lines[0].count("|") == 8
    assert lines[3] == (
        "| mink_0.8 | 294 ms (3.50x) | 705 MB (0.47x) | 250 MB (0.25x) | - | 9000 | 129.3 |"
    )
    for row in table["rows"]:  # measured before the forward's columns: the table keeps its own
        row.pop("forward_peak_mb_2img", None), row.pop("working_set_mb_2img", None)
    lines = gpu.gpu_markdown(table).splitlines()
    assert "forward peak" not in lines[0] and lines[0].count("|") == 7
    assert "Largest batch" not in "\n".join(lines)


def test_gpu_summary_reads_every_ratio_from_the_rows(tmp_path, capsys) -> None:
    text = gpu.gpu_summary(_table())
    assert text.splitlines()[0] == (
        "- `mink_0.8`: step 3.50x, peak 0.47x, saved 0.25x the baseline's (at 2 images); "
        "largest batch 48 (the limit) against 21."
    )  # the baseline is the reference, not a line of its own
    assert "NVIDIA H100 80GB HBM3, AMP fp16, 800 px, commit `abc123`" in text
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(_table()))
    assert bench_main(["markdown", str(path), "--summary"]) == 0
    assert capsys.readouterr().out.startswith("- `mink_0.8`: step 3.50x")
    with pytest.raises(Exception, match="expected an object with rows"):
        gpu.gpu_summary({**_table(), "rows": []})


def test_make_bench_gpu_writes_one_file_of_the_issues_settings_and_its_table() -> None:
    text = (REPO / "Makefile").read_text()
    start = text.index("GPU_METHODS :=") + len("GPU_METHODS :=")
    names = text[start : text.index("\n", text.index("accumulate_4", start))]
    assert names.replace("\\", " ").split() == GPU_METHODS
    assert [s.name for s in plan_settings(PLAN, GPU_METHODS)] == GPU_METHODS
    recipe = text[text.index("bench-gpu: setup") : text.index("lint: setup")]
    assert "tools/bench.py gpu-table" in recipe and "--images 2 8" in recipe
    # one file in the lease's folder, then the results page that reads the newest folder
    assert recipe.count("--json") == 1 and "--json $(LEASE)/bench_gpu.json" in recipe
    assert "tools/results_page.py --lease-dir" in recipe
    assert recipe.rstrip().endswith("$(PY) tools/results_page.py")
    assert "bench_gpu_" not in text  # one file, not one per part


def test_the_lease_script_measures_make_bench_gpus_settings() -> None:
    """tools/gpu_session.sh runs a smaller make bench-gpu: every one of its settings, the current
    issue's first (with the largest-batch search), the rest later, each part with a baseline."""
    import re

    script = (REPO / "tools/gpu_session.sh").read_text()
    parts = {
        name: re.findall(rf'^{name}="(?:\${name} )?([^"]*)"', script, flags=re.M)
        for name in ("first", "rest")
    }
    first, rest = (" ".join(parts[name]).split() for name in ("first", "rest"))
    assert first[0] == rest[0] == "baseline"
    measured = first + rest[1:]
    assert sorted(measured) == sorted(GPU_METHODS) and len(set(measured)) == len(measured)
    assert script.index("--settings $first") < script.index("--settings $rest")


def test_cli_gpu_table_prints_rows_and_writes_one_file(monkeypatch, tmp_path, capsys) -> None:
    table = _table()
    got = {}

    def fake(settings, images, budget, limit, *args, **kwargs):
        got.update(images=images, budget=budget, limit=limit, settings=[s.name for s in settings])
        yield from table["rows"]

    monkeypatch.setattr(gpu, "gpu_table", fake)
    out = tmp_path / "bench_gpu.json"
    argv = ["gpu-table", "--device", "cpu", "--settings", "baseline", "mink_0.8"]
    assert bench_main([*argv, "--batch-limit", "48", "--json", str(out)]) == 0
    assert got == {"images": [2, 8], "budget": 16000.0, "limit": 48,
                   "settings": ["baseline", "mink_0.8"]}  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    assert json.loads(printed[0])["setting"] == "baseline"
    written = json.loads(out.read_text())
    assert written["rows"] == table["rows"] and written["images"] == [2, 8]
    assert written["gpu"] is None and written["torch"] == torch.__version__  # no GPU here
    assert {"command", "commit", "date", "machine", "cuda", "triton", "kernels"} <= set(written)
    assert written["command"].startswith("python ")  # this process's command line
    # --markdown knows the file, and writes its table into a document's block
    doc = tmp_path / "memory.md"
    begin, end = markers("bench-gpu")
    doc.write_text(f"{begin}\n{end}\n")
    assert bench_main(["markdown", str(out), "--into", str(doc), "--block", "bench-gpu"]) == 0
    assert "| mink_0.8 |" in doc.read_text()
    assert "batch search finished" not in doc.read_text()


def test_cli_gpu_table_writes_its_step_columns_before_the_batch_search(
    monkeypatch, tmp_path, capsys
) -> None:
    out = tmp_path / "bench_gpu.json"

    def fake(*args, on_steps, **kwargs):
        on_steps([{"setting": "baseline", "step_s_2img": 0.1}])
        raise KeyboardInterrupt  # the lease ends during the search

    monkeypatch.setattr(gpu, "gpu_table", fake)
    argv = ["gpu-table", "--device", "cpu", "--settings", "baseline", "--json", str(out)]
    assert bench_main(argv) != 0
    written = json.loads(out.read_text())
    assert written["complete"] is False and written["rows"][0]["step_s_2img"] == 0.1
    assert "before its batch search finished" in gpu.gpu_markdown(written)


def test_cli_refuses_what_the_gpu_table_does_not_take(capsys) -> None:
    base = ["gpu-table", "--device", "cpu", "--settings", "baseline"]
    with pytest.raises(SystemExit) as stopped:
        bench_main([*base, "--methods-json", "x.json"])  # a flag of steps, not of gpu-table
    assert stopped.value.code == 2 and "--methods-json" in capsys.readouterr().err
    steps = ["steps", "--settings", "baseline", "--images", "2", "8", "--methods-json", "x"]
    assert bench_main(steps) == 2
    assert "one --images value" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.usefixtures("narrow_bench")
def test_tiny_gpu_table_on_the_cpu() -> None:
    # The whole table's path on a small model: step rows at two batch sizes with a profiled
    # step each (no CUDA calls on the CPU), then the batch search.
    settings = plan_settings(PLAN, ["baseline", "quant_4bit"])
    rows = list(
        gpu.gpu_table(
            settings, (1, 2), budget_mb=1e6, batch_limit=2, image_size=64, repeats=1,
            device="cpu", amp="none", draws=1, profile_steps=1, rois_per_image=32,
            backbone="resnet18",
        )
    )  # fmt: skip
    assert [r["setting"] for r in rows] == ["baseline", "quant_4bit"]
    for r in rows:
        for n in (1, 2):
            # (the RSS of a 64 px step can stay flat: its peak ratio may be None, not its key)
            assert r[f"step_s_{n}img"] > 0 and f"peak_ratio_{n}img" in r
            assert r[f"launches_per_step_{n}img"] == 0.0 and r[f"syncs_per_step_{n}img"] == 0.0
            # timed in the table's default 5 alternating rounds: the median ratio within them
            low, high = r[f"step_ratio_spread_{n}img"]
            assert len(r[f"step_ratio_rounds_{n}img"]) == len(r[f"step_s_rounds_{n}img"]) == 5
            assert low <= r[f"step_ratio_{n}img"] <= high
        assert (r["max_batch"], r["at_limit"]) == (2, True)
    assert rows[0]["step_ratio_2img"] == 1.0 and rows[1]["strategy"] == "quant"
    assert rows[0]["step_ratio_rounds_2img"] == [1.0] * 5


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@NEEDS_CUDA
def test_profiled_cuda_steps_count_their_launches_and_host_syncs() -> None:
    # The names counted are the ones a real CUDA profile records: two kernels and an .item()
    x = torch.ones(1000, device="cuda")
    calls = profile_cuda_calls(lambda: (x * 2).sum().item(), 3, torch.device("cuda"))
    assert calls.launches >= 6 and calls.kernels >= 6
    assert calls.syncs >= 3 and calls.dtoh_copies >= 3


@pytest.mark.gpu
@NEEDS_CUDA
def test_tiny_gpu_table_on_cuda_quant_adds_no_host_sync() -> None:
    settings = plan_settings(PLAN, ["baseline", "quant_4bit"])
    base, quant = gpu.gpu_table(
        settings, (2,), budget_mb=16000.0, batch_limit=4, image_size=64, repeats=2,
        device="cuda", amp="fp16", draws=1, profile_steps=2, rois_per_image=32,
        backbone="resnet18",
    )  # fmt: skip
    assert base["memory_source"] == "cuda" and quant["peak_mb_2img"] > 0
    assert base["launches_per_step_2img"] > 0 and quant["launches_per_step_2img"] > 0
    # issue 26: quant's pack and rebuild (Triton kernels on CUDA) add no host sync to a step
    assert quant["syncs_per_step_2img"] == base["syncs_per_step_2img"]


def test_gpu_md_quotes_the_gpu_tiers_summary_line_from_its_log() -> None:
    """The tier's result in docs/gpu.md is the log's own line, not a retyped count."""
    text = (REPO / "docs/gpu.md").read_text()
    start = text.index("its log's last line is") + len("its log's last line is")
    quoted = text[text.index("`", start) + 1 : text.index("`", text.index("`", start) + 1)]
    log = (REPO / "docs/results/gpu_h200_2026-11-26/tests_gpu.log").read_text()
    assert quoted and quoted in log.splitlines()[-1]

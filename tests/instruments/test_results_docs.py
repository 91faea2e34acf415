"""Every generated block in the docs is what its tool writes from the file it names, and the
results page is current: no figure on a page is typed by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from instruments.commands.bench import markdown_of
from instruments.measure.methods_table import markers, splice
from instruments.report import results_page as rp
from rcnn_dropit.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs/results"


def _tables(doc: str, blocks: dict[str, str]) -> dict[tuple[str, str], tuple[str, bool]]:
    """Each of ``doc``'s full tables (not summaries): (doc, block) -> (its JSON file, False)."""
    return {(doc, block): (source, False) for block, source in blocks.items()}


# (document, block) -> the JSON file under docs/results it is generated from, and whether it
# is the one-line-per-method summary (`tools/bench.py markdown FILE [--summary] --into DOC
# --block BLOCK`)
BENCH_BLOCKS: dict[tuple[str, str], tuple[str, bool]] = {
    ("docs/results/memory.md", "methods-bench"): ("cpu_methods/methods.json", False),
    ("docs/results/memory.md", "methods-bench-trained"): ("cpu_trained_800/methods.json", False),
    ("docs/results/memory.md", "methods-bench-cap"): ("cpu_cap_800/methods.json", False),
    ("docs/results/memory.md", "step-peak-bf16-trained"): ("cpu_proxy8/methods.json", False),
    ("docs/results/memory.md", "bench-fusion"): ("cpu_fusion/bench.json", False),
    ("docs/results/memory.md", "bench-host"): ("cpu_host/bench.json", False),
    ("docs/results/memory.md", "methods-bench-speed"): ("cpu_speed_512/methods.json", False),
    **_tables(
        "docs/results/archive/untrained_workload.md",
        {
            "methods-bench-forward": "archive/untrained_forward_800/methods_bench_forward.json",
            "step-peak-bf16-rpn": "archive/rpn_head_grad/methods_rpn_head.json",
            "methods-bench-bf16": "archive/untrained_bf16_384/methods_bench_bf16.json",
            "methods-bench-v2": "archive/untrained_v2_512/methods_bench_v2.json",
            "methods-bench-scratch": "archive/untrained_scratch_512/methods_bench_scratch.json",
            "bench-scratch-gpu": "gpu_h200_2026-11-26/bench_scratch_gpu.json",
            "methods-bench-speed": "archive/untrained_speed_512/methods_bench_speed.json",
            "methods-bench-compiled": "archive/untrained_compiled_800/methods_bench_compiled.json",
        },
    ),
    ("docs/gpu.md", "gpu-scratch-summary"): ("gpu_h200_2026-11-26/bench_scratch_gpu.json", True),
    ("docs/results/archive/draws.md", "draws-generator"): (
        "archive/bench_draws_generator_cpu.json",
        False,
    ),
    ("docs/results/archive/draws.md", "draws-hash"): ("archive/bench_draws_hash_cpu.json", False),
    **_tables(
        "docs/results/archive/memory_log.md",
        {
            "methods-bench-backward": "archive/methods_bench_backward.json",
            "memory-pooler-5606795": "archive/bench_memory_pooler_5606795.json",
            "memory-pooler-45eaa61": "archive/bench_memory_pooler_45eaa61.json",
            "memory-pooler-a373cab": "archive/bench_memory_pooler_a373cab.json",
            "step-peak-bf16-after": "archive/step_peak_bf16_cpu/methods_after.json",
            "bf16-recheck-0326bda": "archive/bench_bf16_cpu_recheck_0326bda.json",
            "bf16-recheck-c3732d3": "archive/bench_bf16_cpu_recheck_c3732d3.json",
            "bf16-memory": "archive/bench_bf16_cpu_memory.json",
            "bf16-memory-checkpoint": "archive/bench_bf16_cpu_memory_checkpoint.json",
            "methods-bench-compiled-run2": "archive/methods_bench_compiled_run2.json",
            "methods-bench-compiled-run3": "archive/methods_bench_compiled_run3.json",
            "methods-bench-compiled-run4": "archive/methods_bench_compiled_run4.json",
            "methods-bench-compiled-0bd7ce5": "archive/methods_bench_compiled_0bd7ce5.json",
            "bench-fusion-run1": "archive/bench_fusion_cpu_run1.json",
            "bench-fusion-run2": "archive/bench_fusion_cpu_run2.json",
            "bench-gpu": "gpu_h200_2026-11-26/bench_gpu.json",
            "bench-gpu-eager": "gpu_h200_2026-11-26/bench_gpu_eager.json",
            "bench-host-before": "archive/bench_host_cpu_before.json",
            "bench-host-e941dbe": "archive/bench_host_cpu_e941dbe.json",
            "bench-host-cc74af4": "archive/bench_host_cpu_cc74af4.json",
            "bench-host-9b3b88c": "archive/bench_host_cpu_9b3b88c.json",
            "bench-host-saved-before": "archive/bench_host_cpu_saved_before.json",
            "bench-host-fd3fe5d": "archive/bench_host_cpu_fd3fe5d.json",
            "bench-host-72672ac": "archive/bench_host_cpu_72672ac.json",
            "bench-host-c3732d3": "archive/bench_host_cpu_c3732d3.json",
            "bench-host-86b6f85": "archive/bench_host_cpu_86b6f85.json",
            "memory-hooked": "archive/bench_memory_hooked_cpu.json",
            "memory-function": "archive/bench_memory_function_cpu.json",
            "bench-host-bfcf6e2": "archive/bench_host_cpu_bfcf6e2.json",
            "bench-host-db52677": "archive/bench_host_cpu_db52677.json",
        },
    ),
}
# Blocks left empty until their make target runs on the trained workload (memory.md's "Not yet
# measured on the trained workload"): (document, block) -> the JSON file the target writes. Once
# it exists, the entry moves to BENCH_BLOCKS.
NOT_YET_MEASURED: dict[tuple[str, str], str] = {
    ("docs/results/memory.md", "methods-bench-forward"): "cpu_forward_800/methods.json",
    ("docs/results/memory.md", "methods-bench-bf16"): "cpu_bf16_384/methods.json",
    ("docs/results/memory.md", "methods-bench-v2"): "cpu_v2_512/methods.json",
    ("docs/results/memory.md", "methods-bench-scratch"): "cpu_scratch_512/methods.json",
}
BENCH_MARKER = re.compile(r"<!-- ([a-z0-9-]+): generated by `tools/bench.py markdown`")


def _docs() -> list[Path]:
    skip = ("docs/results/shapes_runs/",)
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [p for p in docs if not p.relative_to(REPO).as_posix().startswith(skip)]


def test_every_bench_block_in_the_docs_is_registered_here() -> None:
    """A block added to a page without its source file here would go unchecked."""
    found = {
        (doc.relative_to(REPO).as_posix(), block)
        for doc in _docs()
        for block in BENCH_MARKER.findall(doc.read_text())
    }
    assert found == set(BENCH_BLOCKS) | set(NOT_YET_MEASURED)
    assert not set(BENCH_BLOCKS) & set(NOT_YET_MEASURED)


@pytest.mark.parametrize("doc, block", sorted(BENCH_BLOCKS))
def test_each_bench_block_is_its_json(doc: str, block: str) -> None:
    source, summary = BENCH_BLOCKS[doc, block]
    text = (REPO / doc).read_text()
    begin, end = markers(block)
    assert text.count(begin) == 1 and text.count(end) == 1
    table = markdown_of(RESULTS / source, summary)
    assert splice(text, table, block=block) == text, (
        f"run: python tools/bench.py markdown docs/results/{source}"
        f"{' --summary' if summary else ''} --into {doc} --block {block}"
    )


@pytest.mark.parametrize("doc, block", sorted(NOT_YET_MEASURED))
def test_a_block_not_yet_measured_is_empty_and_its_file_absent(doc: str, block: str) -> None:
    """A make target that has run wrote both: its entry then belongs in BENCH_BLOCKS."""
    source = NOT_YET_MEASURED[doc, block]
    text = (REPO / doc).read_text()
    begin, end = markers(block)
    assert text.count(begin) == 1 and text.count(end) == 1
    assert text.split(begin)[1].split(end)[0].strip() == "", f"{doc}: block {block} is not empty"
    assert not (RESULTS / source).exists(), (
        f"docs/results/{source} exists: move ({doc!r}, {block!r}) to BENCH_BLOCKS"
    )


def test_the_results_page_and_the_blocks_it_writes_are_current() -> None:
    stale = [p.relative_to(REPO).as_posix() for p in rp.stale(rp.render())]
    assert stale == [], f"run: {rp.COMMAND} (stale: {stale})"


def test_the_page_reads_the_newest_lease_and_every_lease_folder_is_named_by_gpu_and_date() -> None:
    folders = [p for p in RESULTS.iterdir() if p.is_dir() and p.name.startswith("gpu")]
    assert folders and all(rp.LEASE_NAME.match(p.name) for p in folders)
    newest = rp.newest_lease()
    assert newest is not None and newest.name[-10:] == max(p.name[-10:] for p in folders)
    assert f"({newest.name}/README.md)" in rp.PAGE.read_text()


def _table(rows: list[dict], **head) -> dict:
    return {"images": [2, 8], "budget_mb": 16000.0, "batch_limit": 128, "rows": rows, **head}


def _row(setting: str, peak8: float, step8: float, **more) -> dict:
    return {"setting": setting, "peak_ratio_8img": peak8, "step_ratio_8img": step8, **more}


def test_a_lease_takes_the_largest_batches_its_log_printed(tmp_path) -> None:
    # the 11-28 lease wrote its JSON's step columns, then ran out of time during the search:
    # the batches it found are only in the log's measured: lines
    folder = tmp_path / "gpu_h200_2026-11-28"
    folder.mkdir()
    rows = [_row("baseline", 1.0, 1.0), _row("quant_4bit", 0.58, 1.34), _row("mink_0.8", 0.6, 2)]
    (folder / "bench_gpu.json").write_text(json.dumps(_table(rows)))
    (folder / "bench_gpu.log").write_text(
        'measured: {"setting": "baseline", "images": 2, "peak_mb": 1.0}\n'
        'measured: {"setting": "baseline", "max_batch": 48}\n'
        'measured: {"setting": "quant_4bit", "max_batch": 128}\n'
    )
    lease = rp.read_lease(folder)
    assert lease.batches == {"baseline": 48, "quant_4bit": 128}
    assert rp._batch_cell(lease, "quant_4bit") == "128 (the search's limit)"
    assert rp._batch_cell(lease, "mink_0.8").startswith("not reached")


def test_the_newest_lease_is_the_latest_date_with_a_gpu_table(tmp_path) -> None:
    for name in ("gpu_h200_2026-11-26", "gpu_h100_2026-11-30", "gpu_h200_2026-12-01"):
        (tmp_path / name).mkdir()
    for name in ("gpu_h200_2026-11-26", "gpu_h100_2026-11-30"):
        (tmp_path / name / "bench_gpu.json").write_text("{}")
    (tmp_path / "gpu_h200_notes").mkdir()
    assert rp.newest_lease(tmp_path).name == "gpu_h100_2026-11-30"


def test_an_exact_method_lower_and_faster_than_the_pick_is_said_to_be_the_better_choice() -> None:
    points = {
        "quant_4bit": rp.Point("quant_4bit", 0.58, 1.34),
        "accumulate_2": rp.Point("accumulate_2", 0.56, 1.15),
        "checkpoint_stages": rp.Point("checkpoint_stages", 0.65, 1.05),
        "accumulate_4": rp.Point("accumulate_4", 0.33, 1.91),
    }
    text = rp.weigh(points, resolution=0.16)
    assert "`accumulate_2` 0.56x at 1.15x the step (**lower and faster" in text
    assert "`accumulate_4` 0.33x at 1.91x the step (lower but slower)" in text
    assert "checkpoint_stages" not in text  # higher in peak: not weighed as lower
    # within the timing's resolution a faster step is not claimed
    assert "does not tell apart" in rp.weigh(points, resolution=0.20)
    alone = rp.weigh({"quant_4bit": points["quant_4bit"]}, 0.0)
    assert alone.endswith("no exact method is lower in peak.")


def test_an_untimed_table_is_weighed_by_peak_alone() -> None:
    """A memory-only run (--repeats 0) has no step: the sentence says so and claims no speed."""
    points = {
        "quant_4bit": rp.Point("quant_4bit", 0.56, None),
        "accumulate_2": rp.Point("accumulate_2", 0.64, None),
        "accumulate_4": rp.Point("accumulate_4", 0.52, None),
    }
    text = rp.weigh(points, resolution=0.1)
    assert text == (
        "`quant_4bit` peaks at 0.56x of the baseline (steps not timed); lower in peak: "
        "`accumulate_4` at 0.52x."
    )
    assert "faster" not in text and "slower" not in text


def test_an_untimed_cpu_table_quotes_the_steps_timed_apart(tmp_path, monkeypatch) -> None:
    """The methods table without step times: make bench-speed's own run gives the step, named as
    its own run; a timed methods table, or no speed file, leaves the page as it was."""
    records = json.loads((RESULTS / "cpu_speed_512/methods.json").read_text())
    steps = {"baseline": (1.0, 10.0), "quant_4bit": (1.004, None), "mink_0.8": (1.306, None)}
    for r in records:
        r["step_ratio"], step_s = steps[r["setting"]]
        r["step_s"] = step_s if step_s is not None else r.get("step_s")
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps(records))
    monkeypatch.setattr(rp, "CPU_SPEED", speed)
    cpu = {r["setting"]: {**r, "step_s": None, "step_ratio": None} for r in records[:2]}
    assert list(rp.cpu_speed(cpu)) == ["baseline", "quant_4bit", "mink_0.8"]
    assert rp.cpu_speed({"baseline": {"step_s": 9.0}}) == {}
    verdict = rp.verdict_lines(None, cpu)[-1]
    assert verdict.endswith("Its step, timed apart (`make bench-speed`): 1.00x the baseline's.")
    table = "\n".join(rp.cpu_table_lines(cpu, {}, {}))
    expected = "timed `quant_4bit` 1.00x, `mink_0.8` 1.31x of the baseline's 10.00 s"
    assert expected in table
    monkeypatch.setattr(rp, "CPU_SPEED", tmp_path / "absent.json")
    assert "bench-speed" not in rp.verdict_lines(None, cpu)[-1]
    assert "bench-speed" not in "\n".join(rp.cpu_table_lines(cpu, {}, {}))


def test_the_timing_resolution_is_the_widest_same_kernel_ratio() -> None:
    rows = [
        {"setting": "baseline", "step_ratio_2img": 1.0, "step_ratio_8img": 1.0},
        {"setting": "baseline_torchvision_fpn", "step_ratio_2img": 1.02, "step_ratio_8img": 0.84},
        {"setting": "baseline_torchvision_forward", "step_ratio_2img": 1.04},
    ]
    lease = rp.Lease(Path("gpu_h200_2026-11-28"), _table(rows), {})
    assert rp.timing_resolution(lease) == pytest.approx(0.16)


@pytest.mark.parametrize(
    "name, folder",
    [
        ("NVIDIA H200", "gpu_h200_2026-12-02"),
        ("NVIDIA H100 80GB HBM3", "gpu_h100_2026-12-02"),
        ("NVIDIA A100-SXM4-40GB", "gpu_a100_2026-12-02"),
        ("Tesla T4", "gpu_t4_2026-12-02"),
    ],
)
def test_a_lease_folder_is_named_by_the_gpus_model_and_the_date(name: str, folder: str) -> None:
    assert rp.lease_folder(name, "2026-12-02") == rp.RESULTS / folder
    assert rp.LEASE_NAME.match(folder)


def test_a_gpu_name_without_a_model_number_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError, match="no model number.*LEASE="):
        rp.lease_folder("Some GPU", "2026-12-02")

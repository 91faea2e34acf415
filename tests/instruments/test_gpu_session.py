"""tools/gpu_session.sh without a GPU: every stage's own command rehearsed on the CPU at tiny
sizes (a stage that would fail on a lease for a reason the CPU can see fails here), the files of
its first stages read into the results page's words and tables (a recorded rehearsal under
tests/instruments/fixtures/gpu_pass/), and the instruments behind those stages."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from instruments.commands.results_page import main as results_page_main
from instruments.measure.budget_check import probe_config, table_choice
from instruments.measure.deterministic_pair import compare
from instruments.measure.graph_capture import bucket_batch, buckets_for
from instruments.report import gpu_pass
from instruments.report import results_page as rp
from tests.helpers import REPO

SCRIPT = REPO / "tools/gpu_session.sh"
FIXTURE = Path(__file__).parent / "fixtures" / "gpu_pass"
# The stage that runs only when another fails (a table that fails within a minute).
FALLBACKS = {"bench_gpu_eager"}
# The rehearsal in two parts side by side (two cores): the open questions and the test tier,
# then the earlier leases' tables.
SPLIT = "bench_gpu"


def _script_stages() -> list[str]:
    """Every stage the script calls (a call: a line that starts with it)."""
    return re.findall(r"(?m)^\s*(?:if ! )?(?:[A-Z_]+=\S+ )*stage (\w+) ", SCRIPT.read_text())


def _rehearse(out: Path, *where: str) -> subprocess.Popen:
    env = {**os.environ, "OUT": str(out), "WORK": str(out) + ".work", "PYTHON": sys.executable}
    log = (out.parent / f"{out.name}.txt").open("w")
    return subprocess.Popen(
        ["bash", str(SCRIPT), "--rehearse", *where], cwd=REPO, env=env, stdout=log, stderr=log
    )


# The whole pass at tiny sizes, in two processes side by side: 310 s on this project's 2 cores
# shared with other work (2026-12-07; about 320 s of CPU, of which a third is 22 interpreters'
# imports of torch), so near 3 minutes on 2 quiet cores.
@pytest.mark.slow
def test_every_stage_rehearses_on_the_cpu_and_writes_what_the_pages_read(tmp_path) -> None:
    first, rest = tmp_path / "first", tmp_path / "rest"
    runs = [_rehearse(first, "--until", SPLIT), _rehearse(rest, "--from", SPLIT)]
    assert [run.wait(timeout=1800) for run in runs] == [0, 0]
    ran = {}
    for out in (first, rest):
        logs = out / "logs"
        with tarfile.open(out / gpu_pass.ARCHIVE) as tar:
            tar.extractall(logs, filter="data")
        for stage in gpu_pass.stages((out / gpu_pass.SUMMARY).read_text()):
            if stage["outcome"].startswith("not run"):
                continue
            ran[stage["name"]] = stage["outcome"]
            assert stage["outcome"] == "completed", (stage, out)
    assert set(ran) == set(_script_stages()) - FALLBACKS

    # The first stages' files, into a lease folder, then into the pages' words and tables.
    folder = tmp_path / "gpu_cpu_2026-12-07"
    gpu_pass.import_lease(first, folder)
    graphed = gpu_pass.read_pass(folder)
    assert set(graphed.tables) == {1, 2} and graphed.capture and graphed.budget and graphed.pair
    text = "\n".join(gpu_pass.pass_lines(graphed))
    for setting in graphed.settings:
        assert f"| `{setting}` |" in text
    assert gpu_pass.graphed(graphed) == ["baseline_graphed", "quant_4bit_graphed"]
    # every row trained with the recipe's two buckets; a compiled row's first steps per bucket
    assert "Every row with size buckets" in text
    for n, table in graphed.tables.items():
        assert len(table["size_buckets"]) == 2
        for row in table["rows"]:
            setting, steps = row["setting"], row[f"bucket_steps_{n}img"]
            if setting.endswith("_graphed"):
                assert [s["bucket"] for s in steps] == table["size_buckets"]
                assert all(len(s["first_steps_s"]) == 3 for s in steps)
            else:
                assert steps is None, setting
    assert graphed.pair["pair"]["identical"]  # the CPU is bit-exact, with the key or without
    assert len(gpu_pass.verdict_lines(graphed)) == 2
    # ... and the earlier stages' table, as the page reads it
    gpu_pass.import_lease(rest, folder)
    lease = rp.read_lease(folder)
    assert len(rp.gpu_table_lines(lease, {})) > 5 and lease.batches


def test_the_rehearsal_changes_sizes_and_the_device_only() -> None:
    # Both branches of the script's if set the same variables, and the stage commands below
    # them use those variables, not a size or a device of their own.
    text = SCRIPT.read_text()
    branches = re.search(r'if \[ "\$rehearse" = 1 \]; then\n(.*?)\nelse\n(.*?)\nfi\n', text, re.S)
    code = [re.sub(r"(?m)#.*$", "", b).replace("\\\n", " ") for b in branches.groups()]
    names = [set(re.findall(r"\b([A-Z_]+)=", b)) for b in code]
    exported = set(re.findall(r"\b([A-Z_]+)=", " ".join(re.findall(r"export (.*)", code[0]))))
    assert exported and names[0] - exported == names[1]
    commands = text[branches.end() :]
    assert not re.search(r"--device cuda|--images [0-9]|--image-size [0-9]|--amp fp", commands)


def _fixture_pass(tmp_path: Path) -> gpu_pass.GpuPass:
    folder = tmp_path / "gpu_cpu_2026-12-07"
    gpu_pass.import_lease(FIXTURE, folder)
    return gpu_pass.read_pass(folder)


def test_a_recorded_pass_becomes_the_pages_gpu_section(tmp_path) -> None:
    graphed = _fixture_pass(tmp_path)
    page = rp.page(None, {}, graphed)
    section = page[page.index("### Eager and graphed") : page.index("### Every method")]
    for setting in ("baseline", "baseline_graphed", "quant_4bit", "quant_4bit_graphed"):
        assert f"| `{setting}` |" in section  # a row per method, eager and graphed
    for setting in ("accumulate_2", "checkpoint_stages", "quant_2bit"):
        assert f"| `{setting}` | - |" in section  # measured at the larger batch only
    assert "| `quant_4bit_graphed` |" in section.split("| graphed |")[1]  # against its eager
    assert "capture per batch and bucket" in section and "img 64x128: " in section
    assert "`train.memory_budget=16GB` chose" in section
    assert "two runs of one seed with the key logged the same losses" in section
    readme = rp.readme_block(None, {}, graphed)
    assert "- Graphed on the GPU (no GPU), 2 images: `baseline_graphed` steps" in readme
    status = rp.gpu_status_block(None, graphed)
    assert "`graphed_8img` completed" in status and "`bench_gpu` not run" in status
    readme_file = (graphed.folder / "README.md").read_text()
    assert "| `capture` | completed |" in readme_file


def test_a_lease_folder_is_named_from_its_summary(tmp_path) -> None:
    (tmp_path / gpu_pass.SUMMARY).write_text(
        "gpu_session.sh at 1a2b3c4, 2026-12-09T10:11:12Z\nNVIDIA H200, 143771 MiB, 580.159.04\n"
    )
    gpu, date = gpu_pass.lease_identity(tmp_path)
    assert rp.lease_folder(gpu, date).name == "gpu_h200_2026-12-09"
    shutil.copyfile(FIXTURE / gpu_pass.SUMMARY, tmp_path / gpu_pass.SUMMARY)
    assert gpu_pass.lease_identity(tmp_path)[0] is None  # a rehearsal names no GPU


def test_the_results_page_tool_refuses_a_folder_that_is_no_lease_output(tmp_path, capsys) -> None:
    assert results_page_main(["--lease", str(tmp_path), "--into", str(tmp_path / "x")]) == 2
    assert "has no summary.txt" in capsys.readouterr().err
    (tmp_path / gpu_pass.SUMMARY).write_text(FIXTURE.joinpath(gpu_pass.SUMMARY).read_text())
    assert results_page_main(["--lease", str(tmp_path)]) == 2  # no GPU to name it by
    assert "give --into FOLDER" in capsys.readouterr().err


def test_the_summary_lines_of_every_outcome_are_read() -> None:
    summary = "\n".join(
        [
            "probe_live: rc=0 in 22 s (limit 120 s): python3 tools/gpu_probe.py --what live",
            "bench_gpu: rc=124 in 251 s (limit 251 s): python3 tools/bench.py --gpu-table",
            "tests_gpu: rc=1 in 51 s (limit 49 s): python3 -m pytest -m gpu",
            "ops: skipped, -21 s left",
            "capture: not run (before --from budget_probe)",
        ]
    )
    assert [gpu_pass.stage_words(s) for s in gpu_pass.stages(summary)] == [
        "`probe_live` completed (22 s of 120)",
        "`bench_gpu` stopped at its time limit (251 s of 251)",
        "`tests_gpu` failed (rc=1) (51 s of 49)",
        "`ops` skipped (-21 s left)",
        "`capture` not run (before --from budget_probe)",
    ]


def _rounds_row(setting: str, overrides: list[str], times: list[float]) -> dict:
    return {"setting": setting, "overrides": overrides, "step_s_rounds_2img": times}


def test_a_graphed_row_is_weighed_against_its_eager_twin_round_by_round(tmp_path) -> None:
    quant = ["dropit.enabled=true", "dropit.strategy=quant"]
    graph = ["train.compile=backbone", gpu_pass.GRAPHED]
    rows = [
        _rounds_row("baseline", ["dropit.enabled=false"], [0.040, 0.042, 0.041]),
        _rounds_row("baseline_graphed", ["dropit.enabled=false", *graph], [0.028, 0.030, 0.027]),
        _rounds_row("quant_4bit", quant, [0.070, 0.069, 0.072]),
        _rounds_row("quant_4bit_graphed", [*quant, *graph], [0.033, 0.030, 0.031]),
    ]
    for r in rows:
        r.update(peak_mb_2img=100.0, step_ratio_2img=1.0)
    (tmp_path / "graphed_2img.json").write_text(json.dumps({"images": [2], "rows": rows}))
    graphed = gpu_pass.read_pass(tmp_path)
    assert gpu_pass.eager_twin(rows[3], rows) == "quant_4bit"
    (base, quant4) = gpu_pass.graphed_lines(graphed)[2:]
    # per round: 0.028/0.040, 0.030/0.042, 0.027/0.041 -> median 0.70, lowest 0.66, highest 0.71
    assert base.startswith("| `baseline_graphed` | 0.70x (0.66-0.71) | - | 1.00x |")
    # against the graphed baseline: 0.033/0.028, 0.030/0.030, 0.031/0.027
    assert quant4.startswith("| `quant_4bit_graphed` | 0.43x (0.43-0.47) | 1.15x (1.00-1.18) |")


def test_the_tables_choice_is_the_budgets_rule_on_the_tables_rows() -> None:
    cfg = probe_config(8, 64, "cpu", "fp16", "1GB")
    rows = {
        "baseline": {"peak_mb_8img": 900.0, "step_s_8img": 0.10},
        "quant_4bit": {"peak_mb_8img": 500.0, "step_s_8img": 0.13},
        "checkpoint_stages": {"peak_mb_8img": 600.0, "step_s_8img": 0.11},
    }
    held = 100 * 2**20
    # the baseline's 1000 MB with the 10% margin is over 1 GB; checkpointing fits and is faster
    assert table_choice(rows, 8, held, cfg, 2**30) == "checkpoint_stages"
    assert table_choice(rows, 8, held, cfg, 2**31) == "baseline"
    assert table_choice(rows, 8, held, cfg, 2**28) is None


def test_two_runs_are_compared_loss_by_loss() -> None:
    a = [{"iter": 1, "loss": 2.0, "loss_mask": 1.0}, {"iter": 2, "loss": 1.5, "loss_mask": 0.7}]
    assert compare(a, [dict(r) for r in a])["identical"]
    b = [dict(a[0]), {"iter": 2, "loss": 1.5, "loss_mask": 0.75}]
    assert compare(a, b) == {
        "identical": False,
        "iterations": 2,
        "first_difference_iter": 2,
        "largest_difference": pytest.approx(0.05),
    }
    assert not compare(a, a[:1])["identical"]  # a run that stopped early
    assert not compare([], [])["identical"]


def test_the_capture_buckets_are_the_recipes_two_orientations() -> None:
    assert buckets_for(800) == [(800, 1344), (1344, 800)]
    import torch

    images, targets = bucket_batch(64, 1, (128, 64), torch.device("cpu"))
    assert images[0].shape[-2:] == (128, 64) and targets[0]["masks"].shape[-2:] == (128, 64)
    boxes = targets[0]["boxes"]
    assert (boxes[:, 2] <= 64).all() and (boxes[:, 3] <= 128).all()  # x within the width

"""The GPU table's timing in alternating rounds, without a GPU: the order the steps run in, the
median of the rounds' ratios and their spread, the table's cell and resolution line, and the
results page reading the table's own resolution (and its older files' rule without one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from instruments.commands.bench import main as bench_main
from instruments.measure import gpu_table as gpu
from instruments.measure.step_bench import alternating_rounds, round_summary
from instruments.report import results_page as rp
from rcnn_dropit.errors import UsageError


def test_rounds_interleave_the_settings_and_a_turn_counts_its_median_step() -> None:
    calls: list[str] = []
    # each name's timed calls take these seconds, in order (the first of a turn the slowest)
    seconds = {"base": iter([9.0, 1.0, 1.1, 9.0, 2.0, 2.1]), "quant": iter([9.0, 1.5, 1.4] * 2)}

    def step(name: str):
        return lambda: calls.append(name)

    def timer(fn) -> float:
        fn()
        return next(seconds[calls[-1]])

    times = alternating_rounds(
        [step("base"), step("quant")], rounds=2, per_round=3, warmup=1, timer=timer
    )
    # one untimed warm-up round of one call each, then round by round every setting's turn
    assert calls == ["base", "quant"] + (["base"] * 3 + ["quant"] * 3) * 2
    assert times == [[1.1, 2.1], [1.5, 1.5]]  # each turn's median: its slow first call ignored


def test_rounds_of_one_step_without_a_warm_up_alternate_call_by_call() -> None:
    calls: list[int] = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    times = alternating_rounds(fns, rounds=2, per_round=1, warmup=0, timer=lambda fn: fn() or 0.5)
    assert calls == [0, 1, 2, 0, 1, 2] and times == [[0.5, 0.5]] * 3
    with pytest.raises(UsageError, match="rounds=0"):
        alternating_rounds(fns, rounds=0, per_round=1)


def test_a_ratio_is_the_median_of_the_rounds_ratios_with_their_spread() -> None:
    base = [1.0, 2.0, 1.0, 1.0, 1.0]
    quant = [1.5, 2.0, 1.2, 1.3, 1.4]  # round 2: both slow (the machine), the same ratio
    got = round_summary(quant, base)
    assert got["step_ratio_rounds"] == [1.5, 1.0, 1.2, 1.3, 1.4]
    assert got["step_time_ratio"] == 1.3  # median of the ratios; the ratio of medians is 1.4
    assert got["step_ratio_spread"] == [1.0, 1.5]
    assert got["step_s"] == 1.4 and got["baseline_step_s"] == 1.0
    assert got["step_s_rounds"] == quant
    own = round_summary(base, base)
    assert own["step_time_ratio"] == 1.0 and own["step_ratio_spread"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="3 rounds against the baseline's 2"):
        round_summary([1.0, 1.0, 1.0], [1.0, 1.0])


def _rounds(setting: str, times: list[float], base: list[float]) -> dict:
    """A step row as run_benchmark makes it with rounds."""
    return {"setting": setting, **round_summary(times, base), "rounds": len(times)}


def test_the_table_passes_its_rounds_and_keeps_each_batch_sizes_rounds(monkeypatch) -> None:
    got = []
    base = {2: [0.04, 0.05, 0.04], 8: [0.12, 0.13, 0.12]}

    def run(settings, *args, images, rounds, **kwargs):
        got.append((images, rounds))
        yield _rounds("baseline", base[images], base[images])
        yield _rounds("baseline_torchvision_fpn", [0.041, 0.05, 0.043], base[images])

    monkeypatch.setattr(gpu, "run_benchmark", run)
    _, fpn = gpu.gpu_table([], (2, 8), batch_limit=0, rounds=3)
    assert got == [(2, 3), (8, 3)]
    assert fpn["step_ratio_rounds_2img"] == [1.025, 1.0, 1.075]
    assert fpn["step_ratio_2img"] == 1.025 and fpn["step_ratio_spread_2img"] == [1.0, 1.075]
    assert fpn["step_s_rounds_8img"] == [0.041, 0.05, 0.043]
    assert fpn["step_ratio_spread_8img"] == [0.3417, 0.3846]


def _table(rows: list[dict], **head) -> dict:
    head = {"images": [8], "repeats": 4, "rounds": 5, "batch_limit": 0, **head}
    return {**head, "rows": rows}


def _row(setting: str, step_s: float, ratio: float, spread: list[float] | None, **more) -> dict:
    return {
        "setting": setting,
        "memory_source": "cuda",
        "step_s_8img": step_s,
        "step_ratio_8img": ratio,
        "step_ratio_spread_8img": spread,
        **more,
    }


BASE = _row(
    "baseline", 0.121, 1.0, [1.0, 1.0], step_s_rounds_8img=[0.12, 0.121, 0.125, 0.11],
    peak_mb_8img=1500.0, saved_mb_8img=1000.0,
)  # fmt: skip
QUANT = _row("quant_4bit", 0.162, 1.34, [1.30, 1.38])
FPN = _row("baseline_torchvision_fpn", 0.118, 0.98, [0.95, 1.05])
FORWARD = _row("baseline_torchvision_forward", 0.124, 1.03, [1.02, 1.05])


def test_the_resolution_is_the_widest_stray_of_the_same_kernel_rows() -> None:
    got = gpu.step_resolution(_table([BASE, QUANT, FPN, FORWARD]))
    # fpn: |0.98 - 1| = 0.02, half its rounds' range (1.05 - 0.95) / 2 = 0.05; forward: 0.03
    assert got["step_resolution"] == pytest.approx(0.05)
    assert got["step_resolution_from"] == [
        "baseline_torchvision_forward",
        "baseline_torchvision_fpn",
    ]
    assert got["step_resolution_note"] == (
        "step ratios within 0.05 of each other are not told apart; the rows that run the "
        "baseline's kernels (`baseline_torchvision_forward`, `baseline_torchvision_fpn`) stepped "
        "0.98x to 1.03x of the baseline (rounds 0.95x to 1.05x)"
    )
    # a median far from 1 counts more than a narrow spread
    far = _row("baseline_torchvision_fpn", 0.1, 0.84, [0.83, 0.86])
    assert gpu.step_resolution(_table([BASE, far]))["step_resolution"] == pytest.approx(0.16)


def test_without_same_kernel_rows_the_resolution_is_the_baselines_own_rounds() -> None:
    got = gpu.step_resolution(_table([BASE, QUANT]))
    # half the range of 0.11 to 0.125 s over their median, 0.1205 s
    assert got["step_resolution"] == pytest.approx(0.0622, abs=1e-4)
    assert got["step_resolution_from"] == ["baseline"]
    assert (
        "the baseline's own rounds strayed up to 0.06 of its median step"
        in (got["step_resolution_note"])
    )
    # rows from before the rounds: nothing to say (their readers keep their own rule)
    old = {k: v for k, v in BASE.items() if "spread" not in k and "rounds" not in k}
    assert gpu.step_resolution(_table([old, {**FPN, "step_ratio_spread_8img": None}])) == {}


def test_the_markdown_gives_each_ratio_its_rounds_spread_and_the_resolution() -> None:
    lines = gpu.gpu_markdown(_table([BASE, QUANT, FPN])).splitlines()
    assert lines[2].startswith("| baseline | 121 ms (1.00x) |")  # 1.00-1.00 says nothing
    assert lines[3].startswith("| quant_4bit | 162 ms (1.34x, 1.30-1.38) |")
    assert lines[4].startswith("| baseline_torchvision_fpn | 118 ms (0.98x, 0.95-1.05) |")
    text = "\n".join(lines)
    assert "in 5 alternating rounds after a warm-up round: in each, every setting takes 4 " in text
    assert lines[-1] == (
        "What the timing resolves: step ratios within 0.05 of each other are not told apart; the "
        "rows that run the baseline's kernels (`baseline_torchvision_fpn`) stepped 0.98x of the "
        "baseline (rounds 0.95x to 1.05x)."
    )


def test_the_written_table_holds_its_resolution(tmp_path) -> None:
    path = tmp_path / "bench_gpu.json"
    table = _table([BASE, QUANT, FPN])
    gpu.write_gpu_table(path, {k: v for k, v in table.items() if k != "rows"}, table["rows"])
    written = json.loads(path.read_text())
    assert written["step_resolution"] == pytest.approx(0.05)
    assert written["step_resolution_from"] == ["baseline_torchvision_fpn"]
    assert written["rows"][1]["step_ratio_spread_8img"] == [1.30, 1.38]
    # a table from before the rounds is written as it was: no resolution fields
    old = [{"setting": "baseline", "step_s_8img": 0.1, "step_ratio_8img": 1.0}]
    gpu.write_gpu_table(path, {"images": [8]}, old)
    assert json.loads(path.read_text()) == {"images": [8], "rows": old}


def test_the_bench_cli_takes_rounds_for_the_gpu_table_only(monkeypatch, tmp_path, capsys) -> None:
    got = {}

    def fake(settings, images, budget, limit, *args, rounds, **kwargs):
        got["rounds"] = rounds
        yield from _table([BASE, QUANT, FPN])["rows"]

    monkeypatch.setattr(gpu, "gpu_table", fake)
    out = tmp_path / "bench_gpu.json"
    argv = ["gpu-table", "--device", "cpu", "--settings", "baseline", "--images", "8"]
    assert bench_main([*argv, "--rounds", "3", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert got == {"rounds": 3} and written["rounds"] == 3
    assert written["step_resolution"] == pytest.approx(0.05)
    assert "162 ms (1.34x, 1.30-1.38)" in capsys.readouterr().out
    assert bench_main(argv) == 0 and got == {"rounds": 5}  # the default
    assert bench_main([*argv, "--rounds", "0"]) == 2
    assert "--rounds 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        bench_main(["steps", "--settings", "baseline", "--rounds", "3"])  # gpu-table's flag
    assert stopped.value.code == 2 and "unrecognized arguments: --rounds" in capsys.readouterr().err


def _lease(rows: list[dict], **head) -> rp.Lease:
    table = {
        "images": [8], "budget_mb": 16000.0, "batch_limit": 0, "repeats": 4, "gpu": "NVIDIA H200",
        "torch": "2.11", "cuda": "13.0", "triton": "3.6", "amp": "fp16", "image_size": 800,
        "commit": "abc", "date": "2026-12-01", "kernels": "auto", "command": "bench", **head,
        "rows": rows,
    }  # fmt: skip
    return rp.Lease(Path("gpu_h200_2026-12-01"), table, {})


def test_the_results_page_reads_the_tables_own_resolution() -> None:
    rows = [BASE, QUANT, FPN]
    fields = gpu.step_resolution(_table(rows))
    lease = _lease(rows, rounds=5, **fields)
    # the table's figure (half fpn's rounds' range), not the old rule's |0.98 - 1|
    assert rp.timing_resolution(lease) == pytest.approx(0.05)
    text = "\n".join(rp.gpu_table_lines(lease, {}))
    assert "Step: 5 alternating rounds of 4 steps per setting, the median round's time" in text
    assert (
        "What the timing can resolve: step ratios within 0.05 of each other are not told apart; "
        "the rows that run the baseline's kernels (`baseline_torchvision_fpn`) stepped 0.98x"
    ) in text
    assert text.endswith("(rounds 0.95x to 1.05x). Peaks do not move between runs of one commit.")


def test_an_older_table_keeps_the_pages_own_rule_and_words() -> None:
    rows = [BASE, QUANT, FPN]
    lease = _lease(rows)  # no rounds, no step_resolution: a file from before them
    assert rp.timing_resolution(lease) == pytest.approx(0.02)  # |0.98 - 1|
    text = "\n".join(rp.gpu_table_lines(lease, {}))
    assert "Step: median of 4 steps per setting, one setting after another." in text
    assert (
        "rows that run the baseline's kernels, give or take a few launches "
        "(`baseline_torchvision_fpn`), stepped 0.98x to 0.98x of the baseline in this run, so "
        "read step ratios that differ by less than 0.02 as not told apart."
    ) in text
    # the committed lease has no such field: the page's figure is still its rows' widest stray
    committed = rp.read_lease(rp.RESULTS / "gpu_h200_2026-11-28")
    assert "step_resolution" not in committed.table
    assert rp.timing_resolution(committed) == pytest.approx(1 - 0.8422)

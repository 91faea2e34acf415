"""Tests of the run-comparison report on fabricated run directories with known numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rcnn_dropit.report import NoUsableRuns, build_report, load_run, make_rows
from tests.helpers import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

BASE_BBOX = {"AP": 0.379, "AP50": 0.590, "AP75": 0.410, "APs": 0.210, "APm": 0.410, "APl": 0.490}
BASE_SEGM = {"AP": 0.345, "AP50": 0.560, "AP75": 0.365, "APs": 0.160, "APm": 0.370, "APl": 0.500}


def make_run(
    root: Path,
    name: str,
    *,
    dropit: bool = False,
    strategy: str = "mink",
    gamma: float = 0.8,
    seed: int = 42,
    bbox: dict | None = None,
    segm: dict | None = None,
    saved_mb: float = 1000.0,
    step_peak_total_mb: float | None = 3000.0,
    step_peak_mb: float | None = 1500.0,
    amp: str = "fp16",
    speeds: tuple[float, ...] = (10.0, 12.0, 11.0),
    options: dict | None = None,
    arch: str = "maskrcnn",
    iters: int = 100,
    metrics_tail: str = "",
) -> Path:
    """A run directory as the engine writes it (contract 'Run directory')."""
    run = root / name
    run.mkdir(parents=True)
    config = {
        "name": name,
        "model": {"arch": arch, "backbone": "resnet50"},
        "dropit": {
            "enabled": dropit,
            "strategy": strategy,
            "gamma": gamma,
            "options": options or {},
            "include": ["*"],
        },
        "solver": {"lr": 0.02, "max_iters": iters, "amp": amp},
        "train": {"seed": seed, "output_dir": str(run)},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    evaluation = {"bbox": bbox or BASE_BBOX, "num_images": 50, "iter": iters}
    if segm is not None or arch == "maskrcnn":
        evaluation["segm"] = segm or BASE_SEGM
    (run / "eval.json").write_text(json.dumps(evaluation))
    lines = []
    for i, ips in enumerate(speeds):
        record = {"type": "train", "iter": (i + 1) * 10, "epoch": 0, "lr": 0.02}
        record |= {"loss": 2.0 - 0.1 * i, "images_per_sec": ips, "peak_mem_mb": 2500.0 + i}
        lines.append(json.dumps(record))
    lines.append(json.dumps({"type": "eval", "iter": iters, "bbox": evaluation["bbox"]}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + metrics_tail)
    memory = {"saved_mb": saved_mb, "by_type": {}, "step_peak_total_mb": step_peak_total_mb}
    memory |= {"held_at_start_mb": 900.0, "step_peak_mb": step_peak_mb}
    (run / "memory.json").write_text(json.dumps(memory | {"images_per_sec": 1.0}))
    return run


def row_of(markdown: str, section: str, label: str) -> list[str]:
    """Cells of the table row starting with label in the section titled section."""
    part = markdown.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == label:
            return cells
    raise AssertionError(f"no row {label!r} in section {section!r}:\n{part}")


@pytest.fixture()
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A baseline and a DropIT run: box AP +0.6, AP50 -0.4, mask AP equal, 0.30x saved memory."""
    base = make_run(tmp_path, "base")
    drop = make_run(
        tmp_path,
        "g08",
        dropit=True,
        bbox=BASE_BBOX | {"AP": 0.385, "AP50": 0.586},
        segm=BASE_SEGM,
        saved_mb=300.0,
        step_peak_total_mb=2400.0,
        step_peak_mb=900.0,
        speeds=(8.0, 9.0, 100.0, 9.5, 1.0),
        options={"chunk": 16384, "values": "int8"},
    )
    return base, drop


def test_ap_tables_with_signed_deltas(pair: tuple[Path, Path]) -> None:
    md = build_report([str(p) for p in pair])
    assert "Baseline: **base**" in md
    assert row_of(md, "Box AP", "base (baseline)")[1:] == [
        "37.9",
        "59.0",
        "41.0",
        "21.0",
        "41.0",
        "49.0",
    ]
    box = row_of(md, "Box AP", "g08")
    assert box[1] == "38.5 (+0.6)"
    assert box[2] == "58.6 (-0.4)"
    assert box[3] == "41.0 (+0.0)"
    assert row_of(md, "Mask AP", "g08")[1] == "34.5 (+0.0)"


def test_memory_and_description_tables(pair: tuple[Path, Path]) -> None:
    md = build_report([str(p) for p in pair])
    # each peak says what it counts: the device's total, and the step's above its start
    assert row_of(md, "Memory", "run")[1:] == [
        "saved MB", "saved ratio", "peak MB (device total)", "peak ratio",
        "step peak MB (above start)", "step peak ratio", "images/s", "speed ratio",
    ]  # fmt: skip
    assert row_of(md, "Memory", "base (baseline)")[1:] == [
        "1000.0", "1.00", "3000.0", "1.00", "1500.0", "1.00", "11.00", "1.00"
    ]  # fmt: skip
    # images/s is the median of the train records (8, 9, 100, 9.5, 1 -> 9.0); the device total
    # the largest seen (a train record's 2504 over memory.json's 2400); the step's memory.json's
    assert row_of(md, "Memory", "g08")[1:] == [
        "300.0", "0.30", "2504.0", "0.83", "900.0", "0.60", "9.00", "0.82"
    ]  # fmt: skip
    desc = row_of(md, "Runs", "g08")
    assert desc[1:9] == [
        "maskrcnn",
        "resnet50",
        "fp16",
        "mink",
        "0.8",
        "chunk=16384, values=int8",
        "42",
        "100",
    ]
    assert row_of(md, "Runs", "base (baseline)")[4:7] == ["off", "-", "-"]


def test_a_memory_json_without_the_step_peak_leaves_that_cell_empty(tmp_path: Path) -> None:
    # memory.json of a run from before step_peak_mb was written, and a run on the CPU (fp32)
    old = make_run(tmp_path, "old", step_peak_mb=None)
    cpu = make_run(tmp_path, "cpu", dropit=True, step_peak_total_mb=None, amp="none")
    md = build_report([old, cpu])
    assert row_of(md, "Memory", "old (baseline)")[3:7] == ["3000.0", "1.00", "-", "-"]
    assert row_of(md, "Memory", "cpu")[3:7] == ["2502.0", "0.83", "1500.0", "-"]
    assert row_of(md, "Runs", "cpu")[3] == "none"


def test_a_run_whose_method_a_budget_chose_says_which_and_why(pair, tmp_path: Path) -> None:
    base, chosen = pair
    choice = {
        "method": "accumulate_2",
        "reason": "the fastest that fits",
        "budget_mb": 22528.0,
        "margin": 0.1,
        "device": "cuda",
        "methods": [
            {"method": "baseline", "peak_mb": 24576.0, "fits": False, "note": ""},
            {"method": "accumulate_2", "peak_mb": 14000.0, "fits": True, "note": ""},
            {"method": "quant_2bit", "peak_mb": None, "fits": False, "note": "out of memory"},
        ],
    }
    (chosen / "budget.json").write_text(json.dumps(choice))
    md = build_report([base, chosen])
    section = md.split("## Memory methods chosen by a budget", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("- ")]
    assert lines == [
        f"- g08 (`{chosen}`): `accumulate_2`, the fastest that fits; budget 22.00 GB (a 10% "
        "margin) per process on cuda; peaks: baseline 24.00 GB, accumulate_2 13.67 GB (fits), "
        "quant_2bit out of memory"
    ]
    (chosen / "budget.json").unlink()
    assert "chosen by a budget" not in build_report([base, chosen])  # none: no section


def test_explicit_baseline_and_no_baseline(tmp_path: Path) -> None:
    a = make_run(tmp_path, "a", dropit=True, gamma=0.8, bbox=BASE_BBOX | {"AP": 0.380})
    b = make_run(tmp_path, "b", dropit=True, gamma=0.9, bbox=BASE_BBOX | {"AP": 0.371})
    md = build_report([a, b])
    assert "No baseline" in md
    assert row_of(md, "Box AP", "b")[1] == "37.1"
    md = build_report([b], baseline=a)  # a baseline outside the run list is added as a row
    assert row_of(md, "Box AP", "a (baseline)")[1] == "38.0"
    assert row_of(md, "Box AP", "b")[1] == "37.1 (-0.9)"


def test_group_seeds_means_and_deltas(tmp_path: Path) -> None:
    runs = [
        make_run(tmp_path, "base_s1", seed=1, bbox=BASE_BBOX | {"AP": 0.378}),
        make_run(tmp_path, "base_s2", seed=2, bbox=BASE_BBOX | {"AP": 0.380}),
        make_run(tmp_path, "g08_s1", dropit=True, seed=1, bbox=BASE_BBOX | {"AP": 0.384}),
        make_run(tmp_path, "g08_s2", dropit=True, seed=2, bbox=BASE_BBOX | {"AP": 0.386}),
    ]
    md = build_report(runs, group_seeds=True)
    assert "4 runs in 2 settings" in md
    assert row_of(md, "Box AP", "base (baseline)")[1:3] == ["2", "37.9"]
    drop = row_of(md, "Box AP", "g08")
    assert drop[1:3] == ["2", "38.5 (+0.6)"]
    assert drop[-1] == "38.4, 38.6"
    assert row_of(md, "Runs", "g08")[7:9] == ["1, 2", "2"]
    # without grouping every seed is its own row, deltas against the first baseline seed
    md = build_report(runs)
    assert row_of(md, "Box AP", "g08_s2")[1] == "38.6 (+0.8)"


def test_grouping_keeps_different_settings_apart(tmp_path: Path) -> None:
    runs = [
        load_run(make_run(tmp_path, "x1", dropit=True, gamma=0.8, seed=1)),
        load_run(make_run(tmp_path, "x2", dropit=True, gamma=0.9, seed=2)),
    ]
    assert len(make_rows(runs, group_seeds=True)) == 2


def test_figures_written_and_linked(tmp_path: Path) -> None:
    runs = [make_run(tmp_path, "base")]
    runs += [
        make_run(
            tmp_path, f"g{g}", dropit=True, gamma=g / 10, bbox=BASE_BBOX | {"AP": 0.3 + g / 100}
        )
        for g in (5, 8, 9)
    ]
    out = tmp_path / "rep" / "report.md"
    md = build_report(runs, out=out)
    assert out.read_text() == md
    for name in ("loss_curves.png", "ap_vs_gamma.png"):
        data = (out.parent / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
        assert f"]({name})" in md


def test_no_gamma_plot_for_single_gamma(pair: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "r" / "report.md"
    md = build_report(pair, out=out)
    assert (out.parent / "loss_curves.png").exists()
    assert not (out.parent / "ap_vs_gamma.png").exists()
    assert "No AP-vs-gamma plot" in md


def test_missing_and_partial_runs_are_named(pair: tuple[Path, Path], tmp_path: Path) -> None:
    no_eval = make_run(tmp_path, "noeval")
    (no_eval / "eval.json").unlink()
    no_cfg = make_run(tmp_path, "nocfg")
    (no_cfg / "config.yaml").unlink()
    no_mem = make_run(tmp_path, "nomem", dropit=True)
    (no_mem / "memory.json").unlink()
    missing = tmp_path / "does_not_exist"
    md = build_report([*pair, no_eval, no_cfg, missing, no_mem])
    problems = md.split("## Runs not included / partial", 1)[1]
    assert f"`{missing}`: not included: directory does not exist" in problems
    assert f"`{no_eval}`: not included: no eval.json" in problems
    assert f"`{no_cfg}`: not included: no config.yaml" in problems
    assert "nomem" in problems and "no memory.json" in problems
    assert row_of(md, "Memory", "nomem")[1:3] == ["-", "-"]
    assert row_of(md, "Box AP", "g08")[1] == "38.5 (+0.6)"


def test_truncated_metrics_line_and_coco_minus_one(tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        "cut",
        bbox=BASE_BBOX | {"APs": -1.0},
        metrics_tail='{"type": "train", "iter": 40, "loss": 1.',
    )
    loaded = load_run(run)
    assert loaded.losses == ((10, 2.0), (20, 1.9), (30, 1.8))
    assert loaded.notes == ()
    assert loaded.metric("bbox", "APs") is None  # COCOeval's -1 means "no objects of that size"
    assert row_of(build_report([run]), "Box AP", "cut (baseline)")[4] == "-"


def test_no_usable_run_raises(tmp_path: Path) -> None:
    with pytest.raises(NoUsableRuns, match="directory does not exist"):
        build_report([tmp_path / "nope"])
    # a --baseline named but not usable: not a report without the baseline that was asked for
    run = make_run(tmp_path, "run", dropit=True)
    with pytest.raises(NoUsableRuns, match=r"--baseline '.*nope' is not usable: .*does not exist"):
        build_report([run], baseline=tmp_path / "nope")


def test_report_command_bad_out_is_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    from rcnn_dropit.commands.report import main

    run = make_run(tmp_path, "base")
    (tmp_path / "file").write_text("x")
    for out, message in (
        (tmp_path, "is a folder; give the report's file name"),
        (tmp_path / "file/report.md", "its folder cannot be made"),
    ):
        assert main([str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --out '") and message in err and "Traceback" not in err
    assert main([str(tmp_path / "nope")]) == 2
    assert "error: no usable run directory" in capsys.readouterr().err


def test_ten_runs_with_long_logs_are_each_one_row(tmp_path: Path) -> None:
    runs = [make_run(tmp_path, "base")]
    runs += [
        make_run(tmp_path, f"r{i}", dropit=True, gamma=0.5 + i / 20, speeds=(10.0,) * 500)
        for i in range(9)
    ]
    markdown = build_report(runs, out=tmp_path / "report.md", group_seeds=True)
    assert row_of(markdown, "Box AP", "base (baseline)")[0] == "base (baseline)"
    for i in range(9):  # different gammas: nothing to group, one row each
        assert row_of(markdown, "Box AP", f"r{i}")[0] == f"r{i}"
    assert (tmp_path / "report.md").read_text() == markdown


def run_cli(*args: object) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "report.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_cli_exit_codes(pair: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "cli" / "report.md"
    done = run_cli(*pair, tmp_path / "missing", "--out", out)
    assert done.returncode == 0, done.stderr
    assert str(out) in done.stdout
    assert "38.5 (+0.6)" in out.read_text()
    done = run_cli(pair[1], "--baseline", pair[0], "--group-seeds", "--out", "-")
    assert done.returncode == 0 and "38.5 (+0.6)" in done.stdout
    done = run_cli(tmp_path / "missing", "--out", out)
    assert done.returncode == 2
    assert "no usable run directory" in done.stderr and "does not exist" in done.stderr


def test_report_does_not_import_torch() -> None:
    # the library and its command (dropit-report, tools/report.py)
    code = "import sys, rcnn_dropit.commands.report; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "False", done.stderr


def test_delta_is_difference_of_shown_values(tmp_path: Path) -> None:
    base = make_run(tmp_path, "b", bbox=BASE_BBOX | {"AP": 0.3796})  # shown 38.0
    drop = make_run(tmp_path, "d", dropit=True, bbox=BASE_BBOX | {"AP": 0.3714})  # shown 37.1
    assert row_of(build_report([base, drop]), "Box AP", "d")[1] == "37.1 (-0.9)"

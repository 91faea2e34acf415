"""The bench of every method: settings by name from the study's plan, built by the toolkit's own
builder; the bias of an estimator over K draws; the methods table (JSON records, Markdown)."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from torch import nn

from dropit_core import checkpoint_modules, is_dropit, to_dropit
from dropit_core.memory import saved_activations
from instruments.commands.bench import main as bench_main
from instruments.measure import methods_table, timing
from instruments.measure.grad_fidelity import (
    approximated_layers,
    estimator_error,
    grad_draws,
    layer_grads,
    relative_error,
)
from instruments.measure.methods_table import (
    METHOD_KEYS,
    PROVENANCE_KEYS,
    markers,
    method_records,
    methods_by_setting,
    methods_markdown,
    read_methods_json,
    splice,
    write_methods_json,
)
from instruments.measure.step_bench import markdown_table, run_benchmark
from instruments.measure.study_plan import load_plan
from instruments.measure.workload import (
    Setting,
    Variant,
    describe,
    detector,
    draws_randomly,
    make_batch,
    parse_variant,
    plan_settings,
    recipe_config,
    setting_config,
    step_loss,
)
from rcnn_dropit import provenance
from rcnn_dropit.config import with_overrides
from rcnn_dropit.errors import UsageError
from tests.helpers import NARROW_BENCH, REPO

PLAN = REPO / "configs/study/plan.yaml"
# Every method of the toolkit, as the bench's make target measures them.
METHODS = [
    "baseline",
    "mink_0.8",
    "threshold_0.8",
    "random_0.8",
    "random_scaled_0.8",
    "importance_0.8",
    "quant_2bit",
    "quant_4bit",
    "quant_4bit_predictors",
    "quant_8bit",
    "mink_0.8_backbone",
    "mink_0.8_backbone_quant_4bit_heads",
    "checkpoint_stages",
    "checkpoint_stages_quant_4bit",
    "baseline_torchvision_bn",
    "accumulate_2",
]


def test_make_bench_methods_measures_every_method_by_its_plan_name() -> None:
    text = (REPO / "Makefile").read_text()
    start = text.index("METHODS :=") + len("METHODS :=")
    names = text[start : text.index("\n", text.index("accumulate_2", start))]
    assert names.replace("\\", " ").split() == METHODS
    assert [s.name for s in plan_settings(PLAN, METHODS)] == METHODS


def _tiny_recipe():
    return recipe_config(False, 64, 32, "resnet18")


# ------------------------------------------------------------------------------------ settings


@pytest.mark.slow  # a tiny bench of a whole model: seconds (test-fast < 90 s)
def test_every_plan_setting_builds_the_bench_model_from_the_same_weights() -> None:
    # The study's overrides, applied to the bench's recipe: each setting trains the same model
    # (the same parameters, bit for bit) in its own way.
    base_cfg = with_overrides(_tiny_recipe(), NARROW_BENCH)
    reference = detector(base_cfg).state_dict()
    names = list(load_plan(PLAN).settings)
    assert set(METHODS) <= set(names)
    for setting in plan_settings(PLAN, names):
        cfg = setting_config(base_cfg, setting)
        state = detector(cfg).state_dict()
        assert state.keys() == reference.keys(), setting.name
        assert all(torch.equal(state[k], reference[k]) for k in reference), setting.name


def test_what_each_method_changes() -> None:
    base_cfg = _tiny_recipe()
    cfg = {s.name: setting_config(base_cfg, s) for s in plan_settings(PLAN, METHODS)}
    assert cfg["baseline"] == base_cfg  # the bench's reference row is the plan's baseline
    assert describe(cfg["quant_4bit"])["strategy"] == "quant"
    assert describe(cfg["quant_4bit"])["options"] == {"bits": 4}
    assert describe(cfg["random_scaled_0.8"])["options"] == {"scale": True}
    rules = describe(cfg["mink_0.8_backbone_quant_4bit_heads"])
    assert rules["strategy"] is None and [r["strategy"] for r in rules["rules"]] == [
        "mink",
        "quant",
    ]
    stages = ["backbone.body.layer2", "backbone.body.layer3", "backbone.body.layer4"]
    for name in ("checkpoint_stages", "checkpoint_stages_quant_4bit"):
        assert describe(cfg[name])["activation_checkpointing"] == stages
    assert describe(cfg["checkpoint_stages"])["strategy"] is None
    # every method draws random numbers but the exact ones and the largest-magnitude ones; a
    # rule with one random group (the 4-bit heads) draws
    deterministic = {"baseline", "mink_0.8", "threshold_0.8", "mink_0.8_backbone"}
    deterministic |= {"checkpoint_stages", "baseline_torchvision_bn", "accumulate_2"}
    assert describe(cfg["baseline_torchvision_bn"])["frozen_bn"] == "torchvision"
    assert describe(cfg["accumulate_2"])["accumulate"] == 2
    assert {n for n, c in cfg.items() if draws_randomly(c)} == set(METHODS) - deterministic


def test_a_variant_is_the_overrides_of_one_dropit_setting() -> None:
    setting = parse_variant("mink:0.9:values=int8").setting
    assert setting.name == "mink 0.9 values=int8"
    d = setting_config(_tiny_recipe(), setting).dropit
    assert (d.enabled, d.strategy, d.gamma) == (True, "mink", 0.9)
    assert d.options == {"values": "int8"} and d.include == ["*"]
    assert setting_config(_tiny_recipe(), Variant("mink", 0.8).setting).dropit.options == {}


def test_unknown_setting_names_the_plan_and_a_close_name() -> None:
    with pytest.raises(UsageError, match=r"setting 'mink_08' is not in .*did you mean 'mink_0.8'"):
        plan_settings(PLAN, ["baseline", "mink_08"])


def test_a_setting_that_changes_the_model_is_refused() -> None:
    with pytest.raises(UsageError, match="model.backbone = 'resnet34' differs from the bench's"):
        setting_config(_tiny_recipe(), Setting("deeper", ("model.backbone=resnet34",)))
    with pytest.raises(UsageError, match="bench setting 'bad'.*dropit.gamma = 1.5"):
        setting_config(_tiny_recipe(), Setting("bad", ("dropit.gamma=1.5",)))


def test_quant_setting_stores_what_the_registry_states() -> None:
    # "n bits/8 + 8 n/group" (REGISTRY["quant"].cache_bytes) for every input a trainable DropIT
    # layer packs, counted by the bench's own accounting; a shared input is packed once.
    cfg = setting_config(_tiny_recipe(), plan_settings(PLAN, ["quant_4bit"])[0])
    model = detector(cfg).train()
    expected: dict[str, int] = {}
    packed: dict[int, torch.Tensor] = {}  # held, so that no later input reuses an address
    names = {m: n for n, m in model.named_modules()}

    def record(module, args) -> None:
        x = args[0]
        if x.untyped_storage().data_ptr() not in packed:
            packed[x.untyped_storage().data_ptr()] = x
            n = x.numel()
            expected[names[module]] = expected.get(names[module], 0) + (
                math.ceil(n * 4 / 8) + 8 * math.ceil(n / 256)
            )

    layers = [
        m
        for m in model.modules()
        if is_dropit(m) and isinstance(getattr(m, "weight", None), nn.Parameter)
    ]
    handles = [m.register_forward_pre_hook(record) for m in layers if m.weight.requires_grad]
    _, report = saved_activations(model, lambda: step_loss(model, make_batch(64, "cpu")))
    for h in handles:
        h.remove()
    assert len(expected) > 15
    assert {n: report.by_module.get(n) for n in expected} == expected


# ---------------------------------------------------------------------------- bias over draws


def _small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )


def _bias(model: nn.Module, exact: dict, draws: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 3, 8, 8, generator=gen), torch.randn(4, 10, generator=gen)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        (model(x) * w).sum().backward()

    if exact is None:
        step()
        return layer_grads(model)
    return estimator_error(grad_draws(model, step, draws), exact, approximated_layers(model))


# Tolerance: an unbiased estimator's mean of K draws misses by sqrt(tr C / K) in expectation, so
# from K = 4 to K = 64 its error falls 4x, and at K = 64 it is one draw's error / 8. Each figure is
# a mean over three layers of norms over hundreds to thousands of noisy entries, so it lands near
# its expectation: measured 4.36x / 8.1 (importance), 3.98x / 8.0 (2-bit quant), 4.33x / 7.9
# (scaled random). A factor 2 of margin on either side still tells 1/sqrt(K) from no shrinking
# at all. min-k draws nothing: its mean is its one rebuild, so its error cannot move.
@pytest.mark.parametrize(
    "strategy,options", [("importance", {}), ("quant", {"bits": 2}), ("random", {"scale": True})]
)
def test_bias_of_an_unbiased_estimator_shrinks_like_one_over_sqrt_k(strategy, options) -> None:
    plain = _small_net()
    exact = _bias(plain, None, 0)
    model = to_dropit(copy.deepcopy(plain), strategy, 0.8, **options)
    few, many = _bias(model, exact, 4), _bias(model, exact, 64)
    assert (few["grad_bias_draws"], many["grad_bias_draws"]) == (4, 64)
    assert many["grad_bias"] < few["grad_bias"] / 2
    # one draw's error stays what it is, and the mean of K sits near it / sqrt(K)
    assert many["grad_bias_single"] == pytest.approx(few["grad_bias_single"], rel=0.25)
    assert many["grad_bias"] == pytest.approx(many["grad_bias_single"] / 8, rel=0.5)


def test_bias_of_min_k_does_not_shrink() -> None:
    plain = _small_net()
    exact = _bias(plain, None, 0)
    model = to_dropit(copy.deepcopy(plain), "mink", 0.8)
    one, many = _bias(model, exact, 1), _bias(model, exact, 16)
    assert one["grad_bias"] > 0.05
    assert many["grad_bias"] == pytest.approx(one["grad_bias"], abs=1e-4)
    assert many["grad_bias"] == pytest.approx(many["grad_bias_single"], abs=1e-4)


def test_estimator_error_by_hand() -> None:
    exact = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, 2.0])}
    draws = [
        {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0, 2.0])},
        {"a": torch.tensor([1.0, -1.0]), "b": torch.tensor([0.0, 3.0])},
    ]
    first = draws[0]["a"].clone()
    out = estimator_error(iter(draws), exact, {"a", "b"})
    # a: mean exact (0), one draw off by 1 of 1; b: mean off by 0.5 of 2, draws by 0 and 0.5
    assert out == {
        "grad_bias": round((0.0 + 0.25) / 2, 4),
        "grad_bias_single": round((1.0 + 1.0 + 0.0 + 0.5) / 4, 4),
        "grad_bias_draws": 2,
    }
    assert torch.equal(draws[0]["a"], first)  # the caller's gradients are left as they were
    assert relative_error(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])) == pytest.approx(
        math.sqrt(10) / 5
    )


def test_approximated_layers_are_dropit_layers_and_everything_recomputed() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)),
        nn.Conv2d(4, 4, 3),
        nn.Conv2d(4, 4, 3),
    )
    checkpoint_modules(model, ["0"])
    to_dropit(model, "mink", 0.8, include=["1", "0.*"])
    assert approximated_layers(model) == {"0", "0.0", "0.1", "0.2", "1"}


# ------------------------------------------------------------------------------ the bench rows


@pytest.mark.slow  # a tiny bench of a whole model: seconds (test-fast < 90 s)
@pytest.mark.usefixtures("narrow_bench")
def test_tiny_bench_of_methods_exact_where_it_must_be(monkeypatch, tmp_path) -> None:
    # The timer says 1 s for everything (timings are the real bench's business); memory and
    # gradients are measured.
    monkeypatch.setattr(timing, "timed", lambda fn, device=None: (None, 1.0))
    names = ["baseline", "mink_0.8", "quant_4bit", "checkpoint_stages"]
    rows = list(
        run_benchmark(
            plan_settings(PLAN, names), image_size=64, repeats=1, rois_per_image=32,
            backbone="resnet18", draws=3,
        )
    )  # fmt: skip
    base, mink, quant, ckpt = rows
    assert [r["setting"] for r in rows] == names
    for key in ("saved_ratio", "step_time_ratio", "eval_time_ratio"):
        assert base[key] == 1.0, key
    # RSS growth of a 64 px step can be 0 in a process whose heap earlier tests warmed (then no
    # ratio is defined); when it is measured, the baseline's own ratio is 1
    for key in ("live_ratio", "peak_ratio"):
        assert base[key] in (1.0, None), key
        assert (base[key] is None) == (not base[key.replace("_ratio", "_mb")]), key
    assert base["grad_cosine"] is None and base["overrides"] == ["dropit.enabled=false"]
    # recomputation is exact: the gradients of every recomputed layer, bit for bit
    assert ckpt["compared_layers"] > 10 and ckpt["converted_layers"] == 0
    assert (ckpt["grad_cosine"], ckpt["grad_norm_ratio"]) == (1.0, 1.0)
    assert (ckpt["grad_bias"], ckpt["grad_bias_single"], ckpt["grad_bias_draws"]) == (0, 0, 1)
    assert ckpt["saved_ratio"] < 1.0
    # min-k is deterministic: one draw, its error is its bias
    assert mink["grad_bias_draws"] == 1 and mink["grad_bias"] == mink["grad_bias_single"] > 0.05
    # 4-bit stochastic rounding: the mean of 3 draws is closer than one draw
    assert quant["grad_bias_draws"] == 3 and quant["grad_bias"] < quant["grad_bias_single"]
    assert quant["saved_ratio"] < mink["saved_ratio"] < 1.0
    header = {"command": "python tools/bench.py", "commit": "abc", "machine": "m", "threads": 1}
    records = method_records(rows, {**header, "quiet": False, "date": "2026-11-24"})
    path = tmp_path / "methods_bench.json"
    write_methods_json(path, records)
    again = read_methods_json(path)
    assert again == json.loads(json.dumps(records))
    assert [r["setting"] for r in again] == names
    for r in again:
        assert set(r) == set(METHOD_KEYS) | set(PROVENANCE_KEYS)
        assert r["quiet"] is False and r["commit"] == "abc"
    assert again[3]["cosine"] == 1.0 and again[3]["bias"] == 0 and again[0]["step_ratio"] == 1.0
    table = methods_markdown(again)
    assert "| checkpoint_stages |" in table and "NOT quiet" in table


# ----------------------------------------------------------------------------- methods table


def _record(setting: str, **values) -> dict:
    record = {key: None for key in METHOD_KEYS}
    record.update(
        setting=setting, command="python tools/bench.py --settings x", commit="0123abcd",
        machine="a CPU", threads=2, quiet=True, date="2026-11-24", saved_ratio=1.0, peak_ratio=1.0,
    )  # fmt: skip
    record.update(values)
    return record


def test_methods_markdown_rows_and_the_run_behind_them() -> None:
    records = [
        _record(
            "baseline", saved_mb=436.64, saved_ratio=1.0, live_ratio=1.0, peak_ratio=1.0,
            peak_phase="backward", step_ratio=1.0, eval_ratio=1.0, live_mb=437.2, peak_mb=577.0,
            step_s=3.771, images=2, image_size=512, device="cpu", amp="none",
            memory_source="rss",
        ),
        _record(
            "quant_4bit", saved_mb=60.123, saved_ratio=0.13771, live_ratio=0.141,
            peak_ratio=0.5512, peak_phase="backward", step_ratio=1.3049, eval_ratio=0.99,
            cosine=0.99712, norm_ratio=1.0004, bias=0.0251, bias_single=0.0712, bias_draws=8,
        ),
    ]  # fmt: skip
    lines = methods_markdown(records).splitlines()
    assert lines[0].startswith("| setting | saved MB | saved | live | peak | peak in |")
    assert lines[2] == (
        "| baseline | 436.6 | 1.000 | 1.000 | 1.000 | backward | 1.00 | 1.00 | - | - | - | - | - |"
    )
    assert lines[3] == (
        "| quant_4bit | 60.1 | 0.138 | 0.141 | 0.551 | backward | 1.30 | 0.99 | 0.997 | 1.000 "
        "| 0.025 | 0.071 | 8 |"
    )
    assert lines[5] == (
        "Measured 2026-11-24 by `python tools/bench.py --settings x` at commit `0123abcd`; "
        "a CPU; torch threads: 2; machine quiet; 2 images of 512 px on cpu (amp none), "
        "baseline saved 436.6 MB, live 437 MB, peak 577 MB (rss), step 3.77 s; workload "
        "untrained (random weights; recorded before the workloads had names)."
    )


BEGIN, END = markers()  # the default block, the methods table's


def test_the_table_goes_between_the_markers_only() -> None:
    doc = f"# Title\n\ntext before\n{BEGIN}\nold table\n{END}\ntext after\n"
    out = splice(doc, "| new |")
    assert out == f"# Title\n\ntext before\n{BEGIN}\n\n| new |\n\n{END}\ntext after\n"
    assert splice(out, "| new |") == out  # writing it again changes nothing
    with pytest.raises(UsageError, match="no .* block"):
        splice("no markers here", "| new |", "memory.md")


def test_a_named_block_leaves_the_other_blocks_alone() -> None:
    bf16_begin, bf16_end = markers("methods-bench-bf16")
    doc = f"{BEGIN}\nfp32\n{END}\n{bf16_begin}\nold\n{bf16_end}\n"
    out = splice(doc, "| bf16 |", block="methods-bench-bf16")
    assert out == f"{BEGIN}\nfp32\n{END}\n{bf16_begin}\n\n| bf16 |\n\n{bf16_end}\n"


def test_reading_a_methods_file_checks_its_keys_and_ratios(tmp_path) -> None:
    path = tmp_path / "m.json"
    record = _record("mink_0.8")
    del record["bias"]
    path.write_text(json.dumps([record]))
    with pytest.raises(UsageError, match=r"record 0 lacks \['bias'\]"):
        read_methods_json(path)
    path.write_text(json.dumps({"setting": "x"}))
    with pytest.raises(UsageError, match="expected a JSON list of objects"):
        read_methods_json(path)
    with pytest.raises(UsageError, match="does not exist"):
        read_methods_json(tmp_path / "none.json")
    assert methods_by_setting(tmp_path / "none.json") is None
    for bad, message in (
        (
            {**_record("q", saved_ratio=0.2, peak_ratio=0.6), "setting": None},
            "record 0 has no 'setting'",
        ),
        (_record("q", saved_ratio="low", peak_ratio=1), "(q): 'saved_ratio' must be a number"),
        (_record("q", saved_ratio=0.2, peak_ratio=-1), "(q): 'peak_ratio' -1 must be > 0"),
    ):
        path.write_text(json.dumps([bad]))
        with pytest.raises(UsageError, match=re.escape(message)):
            read_methods_json(path)
    path.write_text(json.dumps([_record("q", saved_ratio=0.2, peak_ratio=0.6)]))
    assert methods_by_setting(path)["q"]["peak_ratio"] == 0.6
    path.write_text("[{")
    with pytest.raises(UsageError, match="not JSON"):
        read_methods_json(path)


def test_cli_markdown_of_json_rows_is_the_table_the_run_printed(tmp_path, capsys) -> None:
    rows = [
        {"variant": "baseline", "saved_mb": 400.0, "step_time_ratio": 1.0},
        {"variant": "quant_4bit", "saved_mb": 70.25, "step_time_ratio": 1.0764},
    ]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    assert bench_main(["markdown", str(path)]) == 0
    out = capsys.readouterr().out
    assert out == markdown_table(rows) + "\n"
    assert "| quant_4bit | 70.2 | - |" in out and "| 1.076 |" in out
    assert bench_main(["markdown", str(path), "--summary"]) == 2
    assert "not steps rows" in capsys.readouterr().err
    # a list of objects that are not rows is still read as a methods table, which names what
    # its records lack
    path.write_text(json.dumps([{"setting": "x"}]))
    assert bench_main(["markdown", str(path)]) == 2
    assert "record 0 lacks" in capsys.readouterr().err


def test_provenance_names_the_run() -> None:
    header = methods_table.provenance("python tools/bench.py", quiet=True)
    assert set(header) == set(PROVENANCE_KEYS)
    assert header["quiet"] is True and header["threads"] == torch.get_num_threads()
    assert header["commit"]  # a short hash (with -dirty), or says that it is unknown


def test_provenance_takes_the_commit_it_is_given(monkeypatch) -> None:
    monkeypatch.setenv(provenance.COMMIT_ENV, "c8deef3")  # a copy whose .git is not its own
    assert methods_table.provenance("python tools/bench.py", quiet=True)["commit"] == "c8deef3"
    monkeypatch.setenv(provenance.COMMIT_ENV, "")
    assert methods_table.provenance("python tools/bench.py", quiet=True)["commit"] != ""


def test_cli_markdown_into_a_document(tmp_path, capsys) -> None:
    path = tmp_path / "methods.json"
    write_methods_json(path, [_record("baseline"), _record("mink_0.8", cosine=0.93)])
    assert bench_main(["markdown", str(path)]) == 0
    assert "| mink_0.8 |" in capsys.readouterr().out
    doc = tmp_path / "memory.md"
    doc.write_text(f"before\n{BEGIN}\n{END}\n")
    assert bench_main(["markdown", str(path), "--into", str(doc)]) == 0
    assert "| mink_0.8 | - | 1.000 | - | 1.000 | - | - | - | 0.930 |" in doc.read_text()


def test_cli_unknown_setting_is_one_line(capsys) -> None:
    assert bench_main(["steps", "--settings", "quant_3bit", "--plan", str(PLAN)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: setting 'quant_3bit' is not in") and "did you mean" in err


@pytest.mark.slow  # a tiny bench of a whole model: seconds (test-fast < 90 s)
@pytest.mark.usefixtures("narrow_bench")
def test_tiny_bench_of_the_baselines_a_gpu_user_compares_with(monkeypatch) -> None:
    monkeypatch.setattr(timing, "timed", lambda fn, device=None: (None, 1.0))
    names = ["baseline", "baseline_torchvision_bn", "accumulate_2"]
    base, torchvision_bn, accumulate = run_benchmark(
        plan_settings(PLAN, names), image_size=64, repeats=1, rois_per_image=32,
        backbone="resnet18",
    )  # fmt: skip
    assert (base["frozen_bn"], torchvision_bn["frozen_bn"]) == ("lean", "torchvision")
    # in fp32 torchvision's norm is the baseline, bit for bit (test_frozen_norm.py): same bytes
    assert torchvision_bn["saved_mb"] == base["saved_mb"]
    # two micro-batches of one image: one image's activations at a time (plus the weights')
    assert accumulate["accumulate"] == 2 and 0.4 < accumulate["saved_ratio"] < 0.65
    # nothing is approximated in either: no gradient columns
    assert torchvision_bn["grad_cosine"] is None and accumulate["grad_cosine"] is None

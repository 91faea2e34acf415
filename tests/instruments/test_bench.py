"""tools/bench.py's library side: variant parsing, one tiny end-to-end row, the table."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dropit_core import current_settings, is_dropit
from dropit_core.memory import SavedReport, StepMemory
from instruments.measure import max_batch, step_bench, timing
from instruments.measure.grad_fidelity import cosine, mean_fidelity, norm_ratio
from instruments.measure.max_batch import largest_batches, largest_fitting
from instruments.measure.step_bench import is_step_rows, markdown_table, run_benchmark
from instruments.measure.workload import (
    Setting,
    Variant,
    detector,
    make_batch,
    parse_variant,
    recipe_config,
    setting_config,
)
from rcnn_dropit.config import load_config
from rcnn_dropit.errors import UsageError
from tests.helpers import REPO


@pytest.mark.parametrize("scratch", [False, True])
def test_the_bench_model_is_the_coco_recipe_without_its_config_file(scratch: bool) -> None:
    # Built from the schema so that an installed package needs no configs/ folder.
    overrides = [
        "model.pretrained_backbone=false",
        "model.min_size=512",
        "model.max_size=512",
        "model.box_batch_size_per_image=256",
    ]
    if scratch:
        overrides += ["model.norm=bn", "model.trainable_layers=5"]
    recipe = load_config(REPO / "configs/maskrcnn_baseline.yaml", overrides)
    built = recipe_config(scratch, 512, 256)
    assert built.model == recipe.model and built.test == recipe.test
    assert not built.dropit.enabled


def test_variants_keep_the_papers_exclusions_exact() -> None:
    base = detector(recipe_config(False, 64, 32, "resnet18"))
    recipe = recipe_config(False, 64, 32, "resnet18")
    model = detector(setting_config(recipe, Variant("mink", 0.8).setting))
    converted = {n for n, m in model.named_modules() if is_dropit(m)}
    assert "backbone.body.layer1.0.conv1" in converted and "roi_heads.box_head.fc6" in converted
    for exact in (
        "backbone.body.conv1",
        "roi_heads.box_predictor.cls_score",
        "roi_heads.box_predictor.bbox_pred",
        "roi_heads.mask_predictor.mask_fcn_logits",
    ):
        assert exact not in converted
    assert not any(is_dropit(m) for m in base.modules())
    state, reference = model.state_dict(), base.state_dict()  # the same weights, converted
    assert all(torch.equal(state[k], reference[k]) for k in reference)


def test_gradient_fidelity_of_hand_made_gradients() -> None:
    exact = {"a": torch.tensor([[3.0, 4.0]]), "b": torch.tensor([1.0, 0.0]), "c": torch.ones(2)}
    grads = {"a": torch.tensor([[1.5, 2.0]]), "b": torch.tensor([1.0, 1.0]), "c": torch.ones(2)}
    assert cosine(grads["a"], exact["a"]) == pytest.approx(1.0)
    assert norm_ratio(grads["a"], exact["a"]) == pytest.approx(0.5)  # same direction, half length
    assert cosine(grads["b"], exact["b"]) == pytest.approx(2**-0.5)
    assert norm_ratio(grads["b"], exact["b"]) == pytest.approx(2**0.5)
    row = mean_fidelity(grads, exact, {"a", "b"})  # "c" is not a converted layer
    assert row == {
        "grad_cosine": round((1.0 + 2**-0.5) / 2, 4),
        "grad_norm_ratio": round((0.5 + 2**0.5) / 2, 4),
        "compared_layers": 2,
    }
    assert mean_fidelity(grads, exact, set()) == {
        "grad_cosine": None,
        "grad_norm_ratio": None,
        "compared_layers": 0,
    }


def test_parse_variant_reads_strategy_gamma_and_typed_options() -> None:
    v = parse_variant("parallel_mink:0.8:chunk=4096,values=int8")
    assert v == Variant("parallel_mink", 0.8, {"chunk": 4096, "values": "int8"})
    assert v.label == "parallel_mink 0.8 chunk=4096 values=int8"
    assert parse_variant("mink:0.9").options == {}
    assert parse_variant("mink:0.8:relu=false").options == {"relu": False}


@pytest.mark.parametrize("text", ["mink", "mink:high"])
def test_parse_variant_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ValueError, match="variant"):
        parse_variant(text)


@pytest.mark.slow
@pytest.mark.usefixtures("narrow_bench")
def test_tiny_benchmark_rows_show_a_real_saving() -> None:
    # A ResNet-18 keeps it quick; tools/bench.py runs the real R50 recipe.
    variants = [Variant("mink", 0.8)]
    rows = list(
        run_benchmark(variants, image_size=64, repeats=1, rois_per_image=32, backbone="resnet18")
    )
    base, row = rows
    assert base["variant"] == "baseline" and base["saved_mb"] > 0
    # ReLU outputs become bit masks and conv inputs 20% values + bits; at 64 px the unconverted
    # predictor inputs weigh more than at 512 px (where the ratio is about 0.27).
    assert 0.1 < row["saved_ratio"] < 0.7
    assert row["saved_mb"] == pytest.approx(base["saved_mb"] * row["saved_ratio"], rel=1e-3)
    assert row["converted_mb"] > 0 and base["converted_mb"] == 0
    assert 0.3 < row["grad_cosine"] <= 1.0
    assert 0.3 < row["grad_norm_ratio"] <= 1.0  # min-k drops the small values: a shorter gradient
    assert row["converted_layers"] > 20  # every trainable conv/linear but the excluded ones
    for r in rows:  # PeakMeter's bytes (torch's CPU allocations), above the model's own start
        assert r["memory_source"] == "cpu" and "cuda_peak_mb" not in r  # no device total
        assert r["peak_phase"] in ("forward", "backward")
        assert r["live_mb"] > 0 and r["peak_mb"] >= r["live_mb"]
        assert r["peak_mb"] >= r["peak_forward_mb"]
        assert (r["peak_phase"] == "forward") == (r["peak_forward_mb"] >= r["peak_mb"])
        assert r["amp"] == "none" and r["images"] == 2
    table = markdown_table(rows)
    assert table.splitlines()[2].startswith("| baseline |")
    assert "| mink 0.8 |" in table


def test_a_rows_memory_columns_are_the_step_measurement_under_the_rows_names(monkeypatch):
    # committed results and their readers use live_mb and peak_mb: both above the model's start
    step = StepMemory("cuda", 3000.0, 400.0, 700.0, 900.0, SavedReport(total_bytes=2 * 1024**2))
    calls = []

    def measured(model, forwards, device, batch):
        calls.append((len(forwards), device))
        return step

    monkeypatch.setattr(step_bench, "measure_step", measured)
    cuda = torch.device("cuda", 0)
    assert step_bench._memory(torch.nn.Linear(1, 1), ([], []), cuda) == {
        "saved_mb": 2.0,
        "by_type_mb": {},
        "converted_mb": 0.0,
        "unconverted_mb": 0.0,
        "norm_mb": 0.0,
        "positive_rois_per_image": None,  # a model without a box sampler
        "memory_source": "cuda",
        "live_mb": 400.0,
        "peak_mb": 900.0,
        "peak_forward_mb": 700.0,
        "peak_phase": "backward",
        "forward_transient_mb": 300.0,
    }
    assert calls == [(1, cuda)]


# Seconds the fake clock gives each timed call, in call order: 1 untimed + 2 timed rounds of
# (baseline, mink, threshold), steps first, then evaluations.
STEP_SECONDS = [9.0, 9.0, 9.0, 1.0, 3.0, 1.5, 2.0, 6.0, 3.5]  # medians 1.5, 4.5, 2.5
EVAL_SECONDS = [9.0, 9.0, 9.0, 0.5, 0.5, 1.0, 0.5, 1.5, 1.0]  # medians 0.5, 1.0, 1.0


@pytest.mark.slow  # a tiny bench of a whole model: seconds (test-fast < 90 s)
@pytest.mark.usefixtures("narrow_bench")
def test_timings_come_last_in_rounds_against_one_baseline(monkeypatch) -> None:
    # Every variant's memory is taken before any timing (the timing switches the allocator),
    # and every ratio divides by the same baseline median.
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)  # not a measuring process
    order = []
    seconds = iter(STEP_SECONDS + EVAL_SECONDS)

    def memory(*args, **kwargs):
        order.append("memory")
        return real_memory(*args, **kwargs)

    def timed(fn, device=None):
        order.append("timed")
        return fn(), next(seconds)

    real_memory = step_bench._memory
    monkeypatch.setattr(step_bench, "_memory", memory)
    monkeypatch.setattr(timing, "timed", timed)
    variants = [Variant("mink", 0.8), Variant("threshold", 0.8)]
    base, mink, threshold = run_benchmark(
        variants, image_size=64, repeats=2, rois_per_image=32, backbone="resnet18"
    )
    assert order == ["memory"] * 3 + ["timed"] * 18  # (1 untimed + 2) rounds x 3, twice
    assert (mink["step_s"], mink["baseline_step_s"], mink["step_time_ratio"]) == (4.5, 1.5, 3.0)
    assert (threshold["step_s"], threshold["baseline_step_s"]) == (2.5, 1.5)
    assert threshold["step_time_ratio"] == round(2.5 / 1.5, 4)
    assert mink["eval_time_ratio"] == threshold["eval_time_ratio"] == 2.0
    for row in (mink, threshold):
        assert row["timing_allocator"] == "as started"


@pytest.mark.slow  # a tiny bench of a whole model: seconds (test-fast < 90 s)
@pytest.mark.usefixtures("narrow_bench")
def test_memory_only_rows_of_part_of_the_model() -> None:
    # --repeats 0: no timing; dropit.include converts only part of the model, which keeps more.
    mink = Variant("mink", 0.8).setting
    part = Setting("mink 0.8 heads", (*mink.overrides, "dropit.include=[roi_heads.*]"))
    variants = [mink, part]
    base, whole, heads = run_benchmark(
        variants, image_size=64, repeats=0, rois_per_image=32, backbone="resnet18"
    )
    for row in (whole, heads):
        assert "step_time_ratio" not in row and "eval_time_ratio" not in row
    assert heads["include"] == ["roi_heads.*"] and whole["include"] == ["*"]
    assert heads["converted_layers"] == 7  # box fc6, fc7, four mask convs, the mask upsampling
    assert whole["saved_ratio"] < heads["saved_ratio"] < 1.0
    assert "| mink 0.8 heads |" in markdown_table([base, whole, heads])


@pytest.mark.slow  # a tiny bench of a whole model: seconds (test-fast < 90 s)
@pytest.mark.usefixtures("narrow_bench")
def test_tiny_benchmark_under_bf16_autocast() -> None:
    # The --amp path (fp16 on GPUs) on the CPU, where autocast runs bf16; memory only (repeats 0):
    # bf16 steps on a CPU without bf16 instructions take seconds each, and no timing is asserted.
    rows = list(
        run_benchmark(
            [Variant("threshold", 0.8)], image_size=64, repeats=0, rois_per_image=32,
            backbone="resnet18", amp="bf16", images=1, draws=2,
        )
    )  # fmt: skip
    base, row = rows
    assert row["amp"] == "bf16" and row["images"] == 1
    # At 64 px bf16 copies of the weights (kept by baseline and DropIT alike) outweigh the
    # activations; the ReLU outputs that only DropIT layers read still shrink to bit masks. The
    # mask predictor's ReLU (about half their bytes here) stays plain: the excluded
    # mask_fcn_logits keeps its output whole anyway, charged to the ReLU that saves it first.
    assert row["saved_ratio"] < 1.0
    assert row["by_type_mb"]["ReLU"] < 0.6 * base["by_type_mb"]["ReLU"]
    assert 0.3 < row["grad_cosine"] <= 1.0


def test_bad_amp_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="amp='fp8' is invalid: allowed fp16, bf16"):
        list(run_benchmark([Variant("mink", 0.8)], image_size=64, amp="fp8"))


@pytest.mark.parametrize(
    "budget,limit,expected",
    [(1000.0, 64, 30), (1000.0, 16, 16), (130.0, 64, 1), (100.0, 64, 0), (1e9, 64, 64)],
)
def test_largest_fitting_batch(budget: float, limit: int, expected: int) -> None:
    tried = []

    def peak(n: int) -> float:  # 100 MB of weights and state, 30 MB per image
        tried.append(n)
        return 100.0 + 30.0 * n

    assert largest_fitting(peak, budget, limit) == expected
    assert len(tried) <= 2 * limit.bit_length() + 1  # doubling, then bisection


def test_largest_fitting_treats_out_of_memory_as_too_big() -> None:
    assert largest_fitting(lambda n: None if n > 5 else 10.0 * n, 1e9, 64) == 5


def test_largest_batches_rows_per_setting() -> None:
    # The measured step replaced by a model of it: DropIT layers make each image cheaper.
    def peak_of(model, n: int, floor: float) -> float:
        dropit = any(is_dropit(m) for m in model.modules())
        assert next(model.parameters()).device.type == "cpu"
        return 200.0 + n * (40.0 if dropit else 100.0)

    rows = list(
        largest_batches(
            [Variant("mink", 0.8)], budget_mb=1000.0, image_size=64, rois_per_image=32,
            backbone="resnet18", peak_of=peak_of,
        )
    )  # fmt: skip
    assert [(r["variant"], r["max_batch"], r["peak_mb_at_max"]) for r in rows] == [
        ("baseline", 8, 1000.0),
        ("mink 0.8", 20, 1000.0),
    ]


def test_step_peak_is_measured_and_out_of_memory_is_none(monkeypatch) -> None:
    events = []

    real_step = max_batch.train_step
    monkeypatch.setattr(max_batch, "train_step", lambda *a: events.append("step") or real_step(*a))
    model = detector(recipe_config(False, 64, 32, "resnet18")).train()
    cpu = torch.device("cpu")
    # PeakMeter's peak above the start; the first step also makes the gradients and momentum
    first, second, third = (max_batch._step_peak_mb(model, 64, cpu, "none", 1, 0.0) for _ in "abc")
    assert events == ["step"] * 3 and first > second > 0
    assert abs(third - second) < 0.5  # the same step, measured exactly (not RSS with its noise)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None for p in trainable)  # gradients stay allocated, as in training
    momentum = model._bench_optimizer.state
    assert all("momentum_buffer" in momentum[p] for p in trainable)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(max_batch, "train_step", oom)
    assert max_batch._step_peak_mb(model, 64, cpu, "none", 64, 0.0) is None


def test_unknown_strategy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="bench setting 'mink2 0.8'.*dropit.strategy = 'mink2'"):
        list(run_benchmark([Variant("mink2", 0.8)], image_size=64, repeats=1))


# The first shapes study's model: torchvision's FPN and head widths, 32 sampled RoIs per image.
TORCHVISION_WIDTHS = (
    "model.fpn_channels=256",
    "model.box_head_width=1024",
    "model.mask_head_channels=256",
    "model.mask_head_convs=4",
    "model.box_batch_size_per_image=32",
)


def test_step_time_comparison_of_widths(tiny_shapes, monkeypatch):
    """Both models train on the same batch, in rounds; the first is the 1x reference; narrow
    has fewer parameters."""
    from instruments.measure.demo_bench import compare_step_time
    from tests.helpers import tiny_opts

    seconds = iter([9.0] * 4 + [2.0, 0.5, 3.0, 0.25])  # rounds of (torchvision widths, narrow)
    monkeypatch.setattr(timing, "timed", lambda fn, device=None: (fn(), next(seconds)))
    rows = compare_step_time(
        "configs/demo/maskrcnn_shapes_baseline.yaml",
        [("torchvision widths", TORCHVISION_WIDTHS), ("narrow", ())],
        common=tiny_opts(tiny_shapes),
        repeats=2,
    )
    assert [r["model"] for r in rows] == ["torchvision widths", "narrow"]
    assert [r["step_s"] for r in rows] == [2.5, 0.375]  # medians of the two rounds
    assert [r["step_ratio"] for r in rows] == [1.0, 0.15]
    assert rows[1]["params_m"] < rows[0]["params_m"] - 10  # 1024-wide fc6 over 256x7x7 features
    assert rows[0]["overrides"] == list(TORCHVISION_WIDTHS) and rows[1]["images"] == 2


def test_demo_mode_times_the_demo_against_itself_without_dropit(monkeypatch, capsys, tmp_path):
    """demo: the demo's config with its DropIT section and with `dropit.enabled=false`, side
    by side, and DropIT again with eager packs instead of the C loops (switched before each of
    its steps); the rows say the config, whether the machine was quiet and the command."""
    from instruments.commands import bench
    from instruments.measure import demo_bench

    calls, switched = [], {}

    def fake(config, variants, repeats, setups):
        calls.append((config, variants, repeats))
        for label, setup in setups.items():
            setup()
            switched[label] = current_settings().native
        return [
            {"model": label, "step_ratio": 1.0 + i / 10} for i, (label, _) in enumerate(variants)
        ]

    monkeypatch.setattr(demo_bench, "compare_step_time", fake)
    out = tmp_path / "demo.json"
    args = ["demo", "--repeats", "3", "--quiet-machine", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["tools/bench.py", *args])  # the command the rows record
    assert bench.main(args) == 0
    [(config, variants, repeats)] = calls
    assert config == bench.DEMO_CONFIG and repeats == 5  # at least 5 timed rounds
    assert variants == [
        ("baseline", ("dropit.enabled=false",)), ("dropit", ()), ("dropit_eager_packs", ())
    ]  # fmt: skip
    assert switched == {"baseline": True, "dropit": True, "dropit_eager_packs": False}
    assert current_settings().native  # back as it was
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["model"] for r in rows] == ["baseline", "dropit", "dropit_eager_packs"]
    assert all(r["quiet"] and r["config"] == config and " demo " in r["command"] for r in rows)
    assert json.loads(out.read_text()) == rows


@pytest.mark.slow  # a fresh interpreter
def test_bench_tool_says_when_cuda_is_missing() -> None:
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    tool = REPO / "tools" / "bench.py"
    done = subprocess.run(
        [sys.executable, str(tool), "steps", "--device", "cuda", "--variants", "mink:0.8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "--device cuda: CUDA is not available on this machine" in done.stderr


def test_memory_only_rows_make_a_table_of_megabytes() -> None:
    # --repeats 0 rows have no step times: their table gives the bytes themselves.
    row = {
        "variant": "baseline", "saved_mb": 221.55, "live_mb": 221.69, "peak_forward_mb": 251.79,
        "peak_mb": 479.23, "peak_phase": "backward", "saved_ratio": 1.0, "peak_ratio": 1.0,
        "memory_source": "rss",
    }  # fmt: skip
    assert is_step_rows([row])
    assert markdown_table([row]).splitlines()[2] == (
        "| baseline | 221.6 | 221.7 | 251.8 | 479.2 | backward | 1.000 | 1.000 | rss |"
    )
    assert not is_step_rows([{"variant": "baseline", "saved_mb": 1.0}])  # nothing measured


def test_the_untrained_workload_is_the_first_benches_batch() -> None:
    images, targets = make_batch(64, torch.device("cpu"), 2, "untrained")
    gen = torch.Generator().manual_seed(0)
    for image, target in zip(images, targets, strict=True):
        assert torch.equal(image, torch.rand(3, 64, 64, generator=gen))
        assert target["labels"].tolist() == [1, 2, 3] and "rpn_jitter" not in target
    assert targets[0]["boxes"][0].tolist() == [6.0, 8.0, 26.0, 28.0]


@pytest.mark.slow  # three steps of a narrow bench model at 512 RoIs per image
@pytest.mark.usefixtures("narrow_bench")
def test_a_workloads_positive_rois_are_counted_in_the_measured_step() -> None:
    # 512 RoIs per image, as the recipe: the sampler keeps at most 128 positives (0.25)
    model = detector(recipe_config(False, 64, 512, "resnet18")).train()
    positives = {}
    for name in ("untrained", "trained", "cap"):
        batch = make_batch(64, torch.device("cpu"), 2, name)
        positives[name] = step_bench._memory(model, batch, torch.device("cpu"))[
            "positive_rois_per_image"
        ]
    # at 64 px an untrained RPN's proposals hit the three large boxes too, but a trained
    # one's around 7 objects give many more, and the cap workload fills the sampler
    assert 3 <= positives["untrained"] < 40 < positives["trained"] < 128 == positives["cap"]
    with pytest.raises(UsageError, match="workload 'trainde' is not one of trained, cap"):
        make_batch(64, torch.device("cpu"), 2, "trainde")

"""tools/bench.py's library side: variant parsing, one tiny end-to-end row, the table."""

from __future__ import annotations

import pytest

from rcnn_dropit.benchmark import Variant, markdown_table, parse_variant, run_benchmark


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
    assert row["converted_layers"] > 20  # every trainable conv/linear but the excluded ones
    table = markdown_table(rows)
    assert table.splitlines()[2].startswith("| baseline |")
    assert "| mink 0.8 |" in table


def test_unknown_strategy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown DropIT strategy 'mink2'"):
        list(run_benchmark([Variant("mink2", 0.8)], image_size=64, repeats=1))


def test_step_time_comparison_of_widths(tmp_path):
    """Both models train on the same batch; the first is the 1x reference; narrow has fewer
    parameters."""
    from rcnn_dropit.step_cost import TORCHVISION_WIDTHS, compare_step_time
    from tests.conftest import tiny_opts

    rows = compare_step_time(
        "configs/demo/maskrcnn_shapes_baseline.yaml",
        [("torchvision widths", TORCHVISION_WIDTHS), ("narrow", ())],
        common=tiny_opts(tmp_path / "shapes"),
        repeats=1,
        warmup=0,
    )
    assert [r["model"] for r in rows] == ["torchvision widths", "narrow"]
    assert rows[0]["step_ratio"] == 1.0 and rows[1]["step_s"] > 0
    assert rows[1]["params_m"] < rows[0]["params_m"] - 10  # 1024-wide fc6 over 256x7x7 features
    assert rows[0]["overrides"] == list(TORCHVISION_WIDTHS) and rows[1]["images"] == 2

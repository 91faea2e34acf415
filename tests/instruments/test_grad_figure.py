"""The gradient-fidelity study behind tools/grad_figure.py, on a tiny ResNet-18 Mask R-CNN."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from instruments.measure.grad_figure import gradient_study, plot, save_json

LAYERS = ("backbone.body.layer2.0.conv2", "roi_heads.box_head.fc6")


@pytest.mark.slow
@pytest.mark.usefixtures("narrow_bench")
def test_cosine_falls_with_gamma_and_figures_are_written(tmp_path: Path) -> None:
    result = gradient_study([0.0, 0.9], ["mink"], LAYERS, image_size=64, backbone="resnet18")
    exact, dropped = result["cosine"]["mink"]
    # Keeping everything reproduces the exact gradient; dropping 90% moves it away.
    assert exact["mean"] == pytest.approx(1.0, abs=1e-6)
    assert 0.0 < dropped["mean"] < exact["mean"]
    # mink keeps the largest 10%: the gradient shrinks, but far less than to 10% of its norm
    assert exact["norm_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert 0.1 < dropped["norm_ratio"] < 1.0
    assert set(dropped["layers"]) == set(LAYERS) == set(dropped["layers_norm_ratio"])
    paths = plot(result, tmp_path, hist_gamma=0.9)
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    save_json(result, tmp_path / "grad_cosine.json")
    saved = json.loads((tmp_path / "grad_cosine.json").read_text())
    assert saved["gammas"] == [0.0, 0.9] and "_grads" not in saved


@pytest.mark.slow
@pytest.mark.usefixtures("narrow_bench")
def test_unknown_layer_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="have no weight gradient"):
        gradient_study([0.8], ["mink"], ["backbone.nope"], image_size=64, backbone="resnet18")

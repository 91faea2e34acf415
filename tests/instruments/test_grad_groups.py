"""Per-group gradient fidelity of a DropIT model against the exact one (tools/grad_groups.py)."""

from __future__ import annotations

import pytest

from instruments.measure.grad_groups import group_fidelity, markdown_table, training_batches
from rcnn_dropit.config import load_config
from tests.helpers import MASK_CFG, assert_one_line_error, call_tool, tiny_opts


@pytest.fixture(scope="module")
def setup(tiny_shapes):
    cfg = load_config(MASK_CFG, tiny_opts(tiny_shapes))
    return cfg, training_batches(cfg, 2)


@pytest.mark.slow  # a whole model's gradients, four times
def test_group_fidelity_is_exact_at_gamma_0_and_bent_at_0_8(setup) -> None:
    cfg, batches = setup
    result = group_fidelity(
        cfg,
        None,
        {
            "g0": {"strategy": "mink", "gamma": 0.0},
            "g0.8": {"strategy": "mink", "gamma": 0.8},
            "g0.8 norm": {"strategy": "mink", "gamma": 0.8, "rescale": "norm"},
        },
        batches,
    )
    groups = ["backbone body", "FPN", "RPN head", "box head", "mask head", "all"]
    assert list(result["g0"]) == groups
    for group in groups:
        exact, dropped, norm = (result[s][group] for s in ("g0", "g0.8", "g0.8 norm"))
        assert exact["cosine"] == pytest.approx(1.0, abs=1e-6)
        assert exact["norm_ratio"] == pytest.approx(1.0, abs=1e-6)
        assert 0.3 < dropped["cosine"] < 0.9999
        # the same kept elements, rescaled: closer norm, about the same direction
        assert norm["norm_ratio"] > dropped["norm_ratio"]
        assert norm["cosine"] == pytest.approx(dropped["cosine"], abs=0.05)
    table = markdown_table(result)
    assert table[0] == "| setting | " + " | ".join(groups) + " |"
    assert table[2].startswith("| g0 | 1.000 / 1.00 |")


def test_too_many_batches_is_an_error(setup) -> None:
    cfg, _ = setup
    with pytest.raises(ValueError, match=r"5 batches of 2 need more than the \d+ images"):
        training_batches(cfg, 5)


def test_tool_names_a_missing_run(tmp_path, capsys) -> None:
    proc = call_tool("grad_groups.py", "--run", str(tmp_path / "nope"), capsys=capsys)
    assert_one_line_error(proc, "--run", "does not exist")

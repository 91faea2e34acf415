"""train.compile through the runner: a compiled DropIT run killed mid-run resumes to the very
weights of the uninterrupted run.

The runs compile with ``train.compile_backend=aot_eager``: Dynamo and AOTAutograd trace the
backbone's forward and backward as for Inductor (the DropIT layers as torch.library operators),
without Inductor's code generation, whose C++ build costs minutes per run on 2 cores. Inductor's
kernels are checked against eager on a small model (tests/core/test_dropit_compile.py).
"""

from __future__ import annotations

import pytest
import torch

from rcnn_dropit.checkpoint.files import load_checkpoint
from rcnn_dropit.engine.runner import train
from tests.helpers import FASTER_CFG, tiny_opts, train_killed_at, train_records

QUANT_4BIT = ("dropit.enabled=true", "dropit.strategy=quant", "dropit.options={bits: 4}")
COMPILED = ("train.compile=backbone", "train.compile_backend=aot_eager")


@pytest.mark.slow  # two compiled runs and an eager one of a few steps: about a minute
def test_a_compiled_dropit_run_resumes_bit_for_bit(tmp_path, tiny_shapes) -> None:
    # The uninterrupted run is eager: under aot_eager the compiled backbone runs the eager ops
    # of its traced graphs, and the compiled run trains bit for bit as eager does (asserted
    # below through the resumed run, whose first two steps are the killed run's). A compile
    # fewer: each costs about half a minute on 2 cores.
    eager_opts = tiny_opts(
        tiny_shapes, "solver.max_iters=3", "train.checkpoint_every_iters=1", *QUANT_4BIT
    )
    opts = [*eager_opts, *COMPILED]
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(FASTER_CFG, eager_opts, output_dir=straight)

    train_killed_at(FASTER_CFG, opts, run, 3)  # after the checkpoint at 2
    assert "train.compile=backbone (aot_eager): first forward" in (run / "log.txt").read_text()
    train(FASTER_CFG, opts, output_dir=run, resume="auto")

    assert [r["iter"] for r in train_records(run)] == [1, 2, 3]
    assert [r["loss"] for r in train_records(run)] == [r["loss"] for r in train_records(straight)]
    resumed = load_checkpoint(run / "checkpoints/model_0000003.pth")["model"]
    uninterrupted = load_checkpoint(straight / "checkpoints/model_0000003.pth")["model"]
    start = load_checkpoint(straight / "checkpoints/model_0000001.pth")["model"]
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key
    # the steps after the checkpoint moved the weights (a resume that trained nothing would not)
    assert any(not torch.equal(value, start[key]) for key, value in uninterrupted.items())

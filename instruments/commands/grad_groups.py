"""Where DropIT bends the gradient of a trained model: per layer group (backbone body, FPN, RPN
head, box head, mask head), the cosine and norm ratio of DropIT weight gradients to the exact
ones, on the run's own training images, at its initialisation and at its newest checkpoint.

Example: python tools/grad_groups.py --run docs/results/shapes_runs/finetune/baseline_s1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rcnn_dropit.cli import run_cli

# name -> to_dropit arguments: the study's gamma-0.8 settings and the norm-compensated option
# (the default), and the gamma sweep's mink settings
SETTINGS = {
    "mink_0.8": {"strategy": "mink", "gamma": 0.8},
    "mink_0.8_normcomp": {"strategy": "mink", "gamma": 0.8, "rescale": "norm"},
    "parallel_mink_0.8": {"strategy": "parallel_mink", "gamma": 0.8},
    "threshold_0.8": {"strategy": "threshold", "gamma": 0.8},
    "random_0.8": {"strategy": "random", "gamma": 0.8},
    "mink_0.5": {"strategy": "mink", "gamma": 0.5},
    "mink_0.7": {"strategy": "mink", "gamma": 0.7},
    "mink_0.9": {"strategy": "mink", "gamma": 0.9},
}
DEFAULT_SETTINGS = [name for name in SETTINGS if "_0.8" in name]


def main(argv: list[str] | None = None) -> int:
    """Entry point of tools/grad_groups.py."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", required=True, help="a run directory (config.yaml, checkpoints/)")
    parser.add_argument("--batches", type=int, default=4, help="training batches averaged over")
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)

    def go() -> None:
        from instruments.measure.grad_groups import group_fidelity, markdown_table, training_batches
        from rcnn_dropit.checkpoint.files import load_checkpoint
        from rcnn_dropit.config import load_config
        from rcnn_dropit.inference import resolve_model_files

        config, checkpoint = resolve_model_files(args.run, None, None)
        cfg = load_config(config)
        state = load_checkpoint(checkpoint)
        batches = training_batches(cfg, args.batches)
        settings = {name: SETTINGS[name] for name in args.settings}
        out = {}
        for label, weights in (("init", None), (f"iter {state['iteration']}", state["model"])):
            out[label] = group_fidelity(cfg, weights, settings, batches)
            print(f"\n{label} (cosine / norm ratio to the exact weight gradient):")
            print("\n".join(markdown_table(out[label])))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"run": str(args.run), **out}, indent=2) + "\n")
            print(f"wrote {args.json}")

    return run_cli(go)


if __name__ == "__main__":
    sys.exit(main())

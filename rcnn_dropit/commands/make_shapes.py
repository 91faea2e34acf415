"""Write the synthetic shapes set to a folder in COCO 2017's layout: train2017/ and val2017/
images with annotations/instances_train2017.json and annotations/instances_val2017.json (COCO's
instances format), so that data.dataset=coco with its default paths, or any COCO reader, reads
it as it reads COCO; data.dataset=shapes reads it too."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rcnn_dropit.cli import run_cli
from rcnn_dropit.data import make_shapes
from rcnn_dropit.errors import UsageError


def main(argv: list[str] | None = None) -> int:
    """Entry point (``dropit-make-shapes``): parse arguments and generate the dataset."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True, help="output folder")
    parser.add_argument("--num-train", type=int, default=200)
    parser.add_argument("--num-val", type=int, default=50)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--num-classes", type=int, default=3, help="object classes, 1..6")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def go() -> None:
        root = Path(args.root)
        if root.exists() and not root.is_dir():
            raise UsageError(f"--root '{root}' exists and is not a folder")
        if root.is_dir() and any(root.iterdir()):  # a set of other sizes would mix with it
            raise UsageError(f"--root '{root}' is not empty; give a new or empty folder")
        make_shapes(
            args.root, args.num_train, args.num_val, args.image_size, args.num_classes, args.seed
        )
        print(
            f"wrote the shapes set to {args.root}: train2017/, val2017/ and "
            "annotations/instances_{train,val}2017.json (COCO 2017's layout)"
        )

    return run_cli(go)


if __name__ == "__main__":
    sys.exit(main())

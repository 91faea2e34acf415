"""Draw a trained detector's boxes and masks over images (like detectron2's demo), and optionally
write its detections as COCO results; or draw validation images next to their ground truth.

    python tools/infer.py --run outputs/NAME --input photos/ [--json]
    python tools/infer.py --config CFG.yaml --checkpoint model.pth --input image.png
    python tools/infer.py --run outputs/NAME --val 4      # writes outputs/NAME/predictions.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rcnn_dropit.cli import add_opts_argument, run_cli
from rcnn_dropit.engine.runner import resolve_output_dir
from rcnn_dropit.errors import UsageError, make_folder
from rcnn_dropit.inference import (
    find_images,
    image_ids_for,
    load_predictor,
    predict_images,
    val_gallery,
)
from rcnn_dropit.visualize import DISPLAY_OVERLAP


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = parser.add_argument_group("model (a run directory, or a config and a checkpoint)")
    model.add_argument("--run", help="run directory: its config.yaml and newest checkpoint")
    model.add_argument("--config", help="config the checkpoint was trained with")
    model.add_argument(
        "--checkpoint", help="checkpoint file (.pth); with --run, instead of the newest"
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--input", help="an image file, or a folder of images")
    what.add_argument(
        "--val",
        type=int,
        metavar="N",
        help="draw the first N validation images of the run's data set next to their ground "
        "truth, in one picture (OUTPUT/predictions.png)",
    )
    parser.add_argument(
        "--output",
        help="folder for the pictures (default: RUN/infer for --input, RUN for --val, "
        "where RUN is --run or the config's output folder)",
    )
    parser.add_argument(
        "--score-thresh",
        type=float,
        default=0.5,
        help="draw detections scoring at least this (default 0.5)",
    )
    parser.add_argument(
        "--overlap",
        type=float,
        default=DISPLAY_OVERLAP,
        help="do not draw a detection whose intersection with a better one exceeds this fraction "
        "of the smaller box, whatever the classes: one box per object (default "
        f"{DISPLAY_OVERLAP}; 1 draws all; --json results keep every detection)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="resize pictures by this factor (default 1)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="also write OUTPUT/coco_results_bbox.json (and _segm.json for Mask R-CNN) with "
        "every detection down to the config's test.score_thresh",
    )
    parser.add_argument(
        "--image-ids",
        metavar="FILE",
        help="JSON giving the COCO image id of each input by file name: a COCO annotation file "
        "or {name: id} (default: 1..N in file-name order)",
    )
    add_opts_argument(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    """Load the model, then draw (and write results for) the requested images."""
    if not 0.0 <= args.score_thresh <= 1.0:
        raise UsageError(f"--score-thresh: {args.score_thresh} is not in [0, 1]")
    if not 0.0 <= args.overlap <= 1.0:
        raise UsageError(f"--overlap: {args.overlap} is not in [0, 1]")
    if args.scale <= 0:
        raise UsageError(f"--scale: {args.scale} must be > 0")
    if args.image_ids and not args.json:
        raise UsageError("--image-ids numbers the images of --json results; add --json")
    paths, ids = None, None
    if args.input is not None:  # inputs first: a bad path fails before the model loads
        paths = find_images(args.input)
        ids = image_ids_for(paths, args.image_ids) if args.json else None
    elif args.json or args.image_ids:
        raise UsageError("--json and --image-ids go with --input, not --val")
    if args.output is not None:  # checked before the model loads, as the inputs are
        make_folder(args.output, "--output")
    predictor = load_predictor(args.run, args.config, args.checkpoint, args.opts)
    run_dir = Path(args.run) if args.run else resolve_output_dir(predictor.cfg)
    if args.val is not None:
        out = Path(args.output) if args.output else run_dir
        path = val_gallery(
            predictor, args.val, out / "predictions.png", args.score_thresh, overlap=args.overlap
        )
        print(f"prediction (left) next to ground truth (right): {path}")
        return
    out = Path(args.output) if args.output else run_dir / "infer"
    result = predict_images(
        predictor,
        paths,
        out,
        score_thresh=args.score_thresh,
        scale=args.scale,
        image_ids=ids,
        overlap=args.overlap,
    )
    print(f"wrote {len(result.pictures)} picture(s) to '{out}'")
    for path in result.results_files:
        print(f"COCO results: {path}")


def main(argv: list[str] | None = None) -> int:
    """Entry point (``dropit-infer``)."""
    args = parse_args(argv)
    return run_cli(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())

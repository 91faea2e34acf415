"""A trained detector loaded from a run directory (or config + checkpoint), run on image files."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import nn
from torchvision.transforms.functional import pil_to_tensor

from rcnn_dropit.atomic import write_json_atomic
from rcnn_dropit.checkpoint.files import find_last_checkpoint
from rcnn_dropit.config import Config, load_config
from rcnn_dropit.data import build_dataset, dataset_paths, ensure_dataset, load_coco_json
from rcnn_dropit.data.coco import read_json_file
from rcnn_dropit.distributed import resolve_device
from rcnn_dropit.engine.evaluator_loop import iou_types_for
from rcnn_dropit.errors import MissingPathError, UsageError, require_path
from rcnn_dropit.evaluation import coco_results
from rcnn_dropit.models import build_model
from rcnn_dropit.models.weights import check_detector_kind, load_state_dict_file, load_strict
from rcnn_dropit.visualize import (
    DISPLAY_OVERLAP,
    draw_ground_truth,
    draw_prediction,
    fit_scale,
    prediction_vs_truth,
    save_png,
)

IMAGE_SUFFIXES = (".bmp", ".gif", ".jpeg", ".jpg", ".png", ".ppm", ".tif", ".tiff", ".webp")


@dataclass
class Predictor:
    """A detector in eval mode, with the names and COCO category ids of its labels."""

    model: nn.Module
    cfg: Config
    device: torch.device
    checkpoint: Path
    class_names: list[str]  # by label; 0 is the background
    cat_ids: list[int]  # COCO category id of label k at index k - 1

    def label_to_cat_id(self, label: int) -> int:
        """COCO category id of a contiguous label (1..K)."""
        return self.cat_ids[int(label) - 1]

    @torch.inference_mode()
    def __call__(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """Detections for one uint8 CHW image, on the CPU, in the image's pixel coordinates."""
        x = image.to(self.device, torch.float32) / 255
        output = self.model([x])[0]
        return {k: v.to("cpu") for k, v in output.items()}


def resolve_model_files(
    run: str | Path | None, config: str | Path | None, checkpoint: str | Path | None
) -> tuple[Path, Path]:
    """(config, checkpoint) from --run DIR (its config.yaml, newest checkpoint) or as given."""
    if run is not None and config is not None:
        raise UsageError("give either --run DIR or --config FILE --checkpoint FILE, not both")
    if run is None:
        if config is None or checkpoint is None:
            raise UsageError("give --run DIR (a run directory), or both --config and --checkpoint")
        return Path(config), Path(checkpoint)
    run = require_path(run, "folder", "--run: folder")
    if not (run / "config.yaml").is_file():
        raise MissingPathError(
            f"--run: '{run}' has no config.yaml; expected a run directory such as outputs/NAME"
        )
    if checkpoint is not None:
        return run / "config.yaml", Path(checkpoint)
    newest = find_last_checkpoint(run / "checkpoints")
    if newest is None:
        raise MissingPathError(
            f"--run: '{run / 'checkpoints'}' holds no checkpoint; train first or pass --checkpoint"
        )
    return run / "config.yaml", newest


def class_names_for(cfg: Config) -> tuple[list[str], list[int]]:
    """(names by label, category ids) from the config's validation annotation file.

    Falls back to 'class N' and category id N when that file is absent or its categories do
    not match model.num_classes (e.g. a checkpoint used away from its data set).
    """
    fallback = (
        ["__background__"] + [f"class {k}" for k in range(1, cfg.model.num_classes)],
        list(range(1, cfg.model.num_classes)),
    )
    _images, ann_file, _k1, ann_key = dataset_paths(cfg, "val")
    if not ann_file.is_file():
        return fallback
    cats = sorted(load_coco_json(ann_file, ann_key)["categories"], key=lambda c: c["id"])
    if len(cats) + 1 != cfg.model.num_classes:
        return fallback
    names = ["__background__"] + [str(c.get("name", c["id"])) for c in cats]
    return names, [int(c["id"]) for c in cats]


def load_predictor(
    run: str | Path | None = None,
    config: str | Path | None = None,
    checkpoint: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> Predictor:
    """The detector of a run directory or of config + checkpoint, weights loaded, in eval mode."""
    config_path, ckpt = resolve_model_files(run, config, checkpoint)
    require_path(config_path, "file", "--config: file")
    cfg = load_config(config_path, overrides)
    weights = load_state_dict_file(ckpt, "--checkpoint")
    check_detector_kind(weights, cfg.model.arch, cfg.model.num_classes, ckpt)
    model, _record = build_model(cfg)
    load_strict(model, weights, "--checkpoint", str(ckpt))
    device = resolve_device(cfg.train.device, 0)
    model.to(device).eval()
    names, cat_ids = class_names_for(cfg)
    return Predictor(model, cfg, device, ckpt, names, cat_ids)


def list_images(path: str | Path) -> list[Path]:
    """An image file as given, or a folder's image files (by suffix, sorted by name)."""
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"--input: '{path}' does not exist")
    if path.is_file():
        return [path]
    found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not found:
        raise UsageError(
            f"--input: folder '{path}' holds no images (looked for {', '.join(IMAGE_SUFFIXES)})"
        )
    return found


def _not_an_image(path: Path, err: Exception) -> UsageError:
    return UsageError(
        f"--input: '{path}' is not an image that can be read "
        f"(allowed: {', '.join(IMAGE_SUFFIXES)}; {err})"
    )


def read_image(path: str | Path) -> torch.Tensor:
    """An image file as uint8 RGB CHW, upright per its EXIF orientation (as photos are shown)."""
    path = Path(path)
    try:
        with Image.open(path) as pil:
            return pil_to_tensor(ImageOps.exif_transpose(pil).convert("RGB"))
    except FileNotFoundError:
        raise MissingPathError(f"--input: '{path}' does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise _not_an_image(path, err) from None


def check_images(paths: Sequence[Path]) -> None:
    """Read each image's header, so a bad file stops the run before anything is written."""
    for path in paths:
        try:
            with Image.open(path) as pil:
                pil.verify()
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise _not_an_image(path, err) from None


def image_ids_for(paths: Sequence[Path], mapping: str | Path | None = None) -> list[int]:
    """COCO image ids: 1..N in file order, or looked up by file name in a mapping file.

    The mapping is a COCO file (its "images" give file_name and id) or a JSON object
    {file name: id}.
    """
    if mapping is None:
        return list(range(1, len(paths) + 1))
    mapping = Path(mapping)
    data = read_json_file(mapping, "--image-ids")
    if isinstance(data, dict) and isinstance(data.get("images"), list):
        table = {Path(str(im["file_name"])).name: im["id"] for im in data["images"]}
    elif isinstance(data, dict):
        table = {Path(str(k)).name: v for k, v in data.items()}
    else:
        raise UsageError(
            f"--image-ids: '{mapping}' must be a COCO file with 'images' or an object "
            "{file name: image id}"
        )
    ids = []
    for path in paths:
        value = table.get(path.name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise UsageError(
                f"--image-ids: '{mapping}' gives no integer id for '{path.name}' "
                f"({len(table)} file names in it)"
            )
        ids.append(value)
    return ids


def picture_names(paths: Sequence[Path]) -> list[str]:
    """Output picture names: stem.png, or name.png for inputs whose stems collide (a.jpg, a.png)."""
    stems = [p.stem for p in paths]
    return [f"{p.stem if stems.count(p.stem) == 1 else p.name}.png" for p in paths]


@dataclass
class InferResult:
    """What an inference run wrote."""

    pictures: list[Path]
    results_files: list[Path]


def write_results(results: dict[str, list[dict]], output_dir: Path) -> list[Path]:
    """COCO results per iou type as output_dir/coco_results_<type>.json, like a run directory."""
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for iou_type, entries in results.items():
        path = output_dir / f"coco_results_{iou_type}.json"
        write_json_atomic(path, entries, indent=None)
        written.append(path)
    return written


def find_images(input_path: str | Path) -> list[Path]:
    """The images under --input (a file or a folder), each checked to be readable."""
    paths = list_images(input_path)
    check_images(paths)
    return paths


def predict_images(
    predictor: Predictor,
    paths: Sequence[Path],
    output_dir: str | Path,
    score_thresh: float = 0.5,
    scale: float = 1.0,
    image_ids: Sequence[int] | None = None,
    overlap: float = DISPLAY_OVERLAP,
) -> InferResult:
    """Draw the detections of each image into output_dir/<stem>.png (score_thresh and overlap:
    which are shown, see visualize.shown_detections).

    With image_ids (one per path, see image_ids_for), also write every detection, down to
    test.score_thresh rather than only the drawn ones, as COCO results.
    """
    output_dir = Path(output_dir)
    iou_types = iou_types_for(predictor.cfg.model.arch)
    results: dict[str, list[dict]] = {t: [] for t in iou_types}
    pictures = []
    ids = list(image_ids) if image_ids is not None else [None] * len(paths)
    for path, name, image_id in zip(paths, picture_names(paths), ids, strict=True):
        image = read_image(path)
        output = predictor(image)
        picture = draw_prediction(
            image, output, predictor.class_names, score_thresh, scale=scale, overlap=overlap
        )
        pictures.append(save_png(picture, output_dir / name))
        if image_id is not None:
            found = coco_results(output, image_id, iou_types, predictor.label_to_cat_id)
            for iou_type, entries in found.items():
                results[iou_type].extend(entries)
    files = write_results(results, output_dir) if image_ids is not None else []
    return InferResult(pictures, files)


def val_gallery(
    predictor: Predictor,
    num_images: int,
    path: str | Path,
    score_thresh: float = 0.5,
    panel_size: int = 256,
    overlap: float = DISPLAY_OVERLAP,
) -> Path:
    """The first num_images validation images of the run's data set, each row prediction | truth,
    saved as one PNG at path."""
    if num_images < 1:
        raise UsageError(f"--val: {num_images} images; give a number >= 1")
    cfg = predictor.cfg
    ensure_dataset(cfg)
    dataset = build_dataset(cfg, "val")
    if len(dataset) == 0:
        raise UsageError(f"data: the validation set of '{cfg.data.root}' holds no images")
    pairs = []
    for index in range(min(num_images, len(dataset))):
        image, target = dataset[index]
        image = (image * 255).round().to(torch.uint8)  # the dataset gives floats in [0, 1]
        scale = fit_scale(image.shape[1], image.shape[2], panel_size)
        prediction = predictor(image)
        pairs.append(
            (
                draw_prediction(
                    image,
                    prediction,
                    dataset.class_names,
                    score_thresh,
                    scale=scale,
                    overlap=overlap,
                ),  # fmt: skip
                draw_ground_truth(image, target, dataset.class_names, scale=scale),
            )
        )
    return save_png(prediction_vs_truth(pairs), path)

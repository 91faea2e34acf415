"""State dicts: loading them from local files, and whether one fits a model, each with one
clear error message (the only place that compares keys and shapes)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from rcnn_dropit.atomic import write_atomic
from rcnn_dropit.errors import UsageError, load_failure, require_path

_SHOW = 8  # key names listed in an error message
_CLS_SCORE = "roi_heads.box_predictor.cls_score.weight"  # (num_classes, features)
_MASK_HEAD = "roi_heads.mask_predictor."


def load_state_dict_file(path: str | Path, key: str) -> dict[str, torch.Tensor]:
    """Tensors from a raw state_dict file or from a checkpoint dict holding one under "model"."""
    path = require_path(path, "file", f"{key}: file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        why = load_failure(err)
        raise UsageError(f"{key}: '{path}' is not a loadable torch file ({why})") from err
    for nested in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(nested), dict):
            obj = obj[nested]
            break
    if not isinstance(obj, dict) or not all(torch.is_tensor(v) for v in obj.values()):
        raise UsageError(f"{key}: '{path}' holds no state_dict (a mapping of names to tensors)")
    if obj and all(k.startswith("module.") for k in obj):  # saved from a DDP-wrapped model
        obj = {k[len("module.") :]: v for k, v in obj.items()}
    return obj


def compare_state_dict(
    own: dict[str, torch.Tensor], state: dict[str, torch.Tensor], ignore=lambda key: False
) -> tuple[list[str], list[str], list[str]]:
    """Keys of ``own`` missing from ``state``, keys ``own`` lacks, and "key (shape) vs (shape)"
    for keys whose shapes differ; keys for which ``ignore`` is true are left out."""
    missing = [k for k in own if k not in state and not ignore(k)]
    unexpected = [k for k in state if k not in own and not ignore(k)]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    return missing, unexpected, shapes


def load_strict(
    module: nn.Module, state: dict[str, torch.Tensor], key: str, path: str, ignore_prefix: str = ""
) -> None:
    """Load every tensor; any missing, unexpected or mis-shaped key is a UsageError naming them."""
    own = module.state_dict()
    missing, unexpected, shapes = compare_state_dict(
        own, state, lambda k: _ignored(k, ignore_prefix)
    )
    problems = [
        f"{label} ({len(keys)}): {', '.join(keys[:_SHOW])}{' ...' if len(keys) > _SHOW else ''}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape", shapes))
        if keys
    ]
    if problems:
        raise UsageError(f"{key}: '{path}' does not match the model: {'; '.join(problems)}")
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def check_detector_kind(
    weights: dict[str, torch.Tensor], arch: str, num_classes: int, path: str | Path
) -> None:
    """Name an architecture or class-count mismatch of a detector's weights before the
    key-by-key comparison (whose list of keys would bury it)."""
    has_mask = any(k.startswith(_MASK_HEAD) for k in weights)
    if _CLS_SCORE in weights:
        found = "maskrcnn" if has_mask else "fasterrcnn"
        if found != arch:
            raise UsageError(
                f"--checkpoint '{path}' is a {found} "
                f"({'with' if has_mask else 'without'} a mask head), "
                f"config model.arch {arch}"
            )
        classes = int(weights[_CLS_SCORE].shape[0])
        if classes != num_classes:
            raise UsageError(
                f"--checkpoint '{path}' has {classes} classes, "
                f"config model.num_classes {num_classes}"
            )


def check_model_compat(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise a UsageError if state_dict's keys or shapes do not fit model (a checkpoint of
    another model)."""
    missing, unexpected, mismatched = compare_state_dict(model.state_dict(), state_dict)
    if not (missing or unexpected or mismatched):
        return
    parts = []
    for label, keys in (
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("shape mismatches", mismatched),
    ):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            parts.append(f"{len(keys)} {label}: {', '.join(keys[:3])}{more}")
    hint = ""
    if unexpected and all(k.startswith("module.") for k in unexpected):
        hint = " (keys start with 'module.': saved from the DDP wrapper, save model.module)"
    raise UsageError(
        "checkpoint is from another model (checkpoint shape vs model shape): "
        + "; ".join(parts)
        + hint
    )


def _ignored(name: str, prefix: str) -> bool:
    # BatchNorm counters are absent from FrozenBatchNorm2d and from old ImageNet files
    return name.endswith("num_batches_tracked") or (bool(prefix) and name.startswith(prefix))


_BODY = "backbone.body."  # where a detector keeps its ResNet body


def export_backbone(checkpoint: str | Path, out: str | Path) -> str:
    """Write the ResNet body of a detector checkpoint as a model.backbone_weights file.

    The file holds what torchvision's ImageNet files hold (the body without the classifier), so a
    config loads it exactly as it would load ImageNet weights. Written atomically; returns the
    file's SHA-256.
    """
    state = load_state_dict_file(checkpoint, "checkpoint")
    body = {k[len(_BODY) :]: v.clone() for k, v in state.items() if k.startswith(_BODY)}
    if not body:
        raise UsageError(f"checkpoint: '{checkpoint}' holds no '{_BODY}*' tensors (no detector)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda f: torch.save(body, f))
    return hashlib.sha256(out.read_bytes()).hexdigest()

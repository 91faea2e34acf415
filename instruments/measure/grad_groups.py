"""Where DropIT bends the gradient: per layer group, how close the weight gradient of a DropIT
model stays to the exact one, on a study model's own weights and training images.

The forward pass of a DropIT model is bit-identical to the plain one, and every sampling step of
the R-CNN (anchors, RoIs) draws from the global generator, which the benchmark's step re-seeds:
so the exact and the DropIT step see the same proposals, and only the weight gradients of the
converted layers differ. A group's gradient is the concatenation of its layers' weight gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dropit_core import to_dropit
from instruments.measure.grad_fidelity import cosine, norm_ratio, weight_grads
from rcnn_dropit.config import Config
from rcnn_dropit.data.loader import build_dataset, ensure_dataset
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models import build_model, fitting_exclude

# (label, module-path prefix); "all" is every trained conv/linear weight.
GROUPS = (
    ("backbone body", "backbone.body."),
    ("FPN", "backbone.fpn."),
    ("RPN head", "rpn."),
    ("box head", "roi_heads.box_head."),
    ("mask head", "roi_heads.mask_head."),
    ("all", ""),
)


def training_batches(cfg: Config, count: int) -> list[tuple[list[torch.Tensor], list[dict]]]:
    """The first ``count`` batches of ``cfg``'s training images, in file order (no shuffle)."""
    ensure_dataset(cfg)
    dataset = build_dataset(cfg, "train", seed=0, as_float=True)
    size = int(cfg.solver.batch_size)
    if count * size > len(dataset):
        raise UsageError(f"{count} batches of {size} need more than the {len(dataset)} images")
    batches = []
    for b in range(count):
        items = [dataset[i] for i in range(b * size, (b + 1) * size)]
        batches.append(([img for img, _ in items], [t for _, t in items]))
    return batches


def _group_vector(grads: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor | None:
    parts = [g.flatten() for name, g in sorted(grads.items()) if name.startswith(prefix)]
    return torch.cat(parts) if parts else None


def group_fidelity(
    cfg: Config,
    weights: Mapping[str, torch.Tensor] | None,
    settings: Mapping[str, Mapping[str, Any]],
    batches: Sequence[tuple[list[torch.Tensor], list[dict]]],
) -> dict[str, dict[str, dict[str, float]]]:
    """For each setting (``to_dropit`` keyword arguments), per group: the cosine and norm ratio
    of the DropIT weight gradient to the exact one, averaged over ``batches``.

    ``cfg`` builds the model (its DropIT section is ignored; ``cfg.dropit.exclude`` is the
    default exclude of every setting); ``weights`` replaces the built weights (a checkpoint's
    model state), None keeps the initialisation of ``cfg``.
    """
    plain_cfg = copy.deepcopy(cfg)
    plain_cfg.dropit.enabled = False
    torch.manual_seed(cfg.train.seed)
    base, _ = build_model(plain_cfg)
    if weights is not None:
        base.load_state_dict(weights)
    base.train()
    exact = [weight_grads(base, batch) for batch in batches]
    result: dict[str, dict[str, dict[str, float]]] = {}
    for name, options in settings.items():
        options = {"exclude": fitting_exclude(base, cfg.dropit.exclude), **options}
        model = to_dropit(copy.deepcopy(base), **options)
        sums: dict[str, list[float]] = {}
        for i, batch in enumerate(batches):
            approx = weight_grads(model, batch)
            for label, prefix in GROUPS:
                a, e = _group_vector(approx, prefix), _group_vector(exact[i], prefix)
                if a is None or e is None:
                    continue
                acc = sums.setdefault(label, [0.0, 0.0])
                acc[0] += cosine(a, e)
                acc[1] += norm_ratio(a, e)
        result[name] = {
            label: {"cosine": c / len(batches), "norm_ratio": r / len(batches)}
            for label, (c, r) in sums.items()
        }
    return result


def markdown_table(result: Mapping[str, Mapping[str, Mapping[str, float]]]) -> list[str]:
    """One row per setting, one 'cosine / norm ratio' cell per group."""
    labels = [label for label, _ in GROUPS if any(label in r for r in result.values())]
    lines = [
        "| setting | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for name, groups in result.items():
        cells = [
            f"{groups[g]['cosine']:.3f} / {groups[g]['norm_ratio']:.2f}" if g in groups else "-"
            for g in labels
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines

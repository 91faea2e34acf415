"""What the instruments measure: the COCO recipe's Mask R-CNN with random weights, a fixed
batch, one training step, and the settings compared with it.

The recipe's model is built from the config schema (the defaults are torchvision's Mask R-CNN
R50-FPN; 80 classes and background as configs/maskrcnn_baseline.yaml), so it needs no config
files; tests/instruments/test_bench.py checks that the two agree. A setting is a name and config
overrides, exactly as the accuracy study's plan writes them (configs/study/plan.yaml), and
its model comes from the toolkit's own builder (``build_model``), so the bench and the study
cannot disagree about what a setting is. A variant (``mink:0.9:values=int8``) is a short way to
write the overrides of one DropIT setting.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rcnn_dropit.config import Config, config_from_dict, with_overrides
from rcnn_dropit.config_schema import dropit_rules
from rcnn_dropit.engine.amp import autocast
from rcnn_dropit.engine.compiling import compile_model
from rcnn_dropit.errors import UsageError
from rcnn_dropit.models import build_model
from rcnn_dropit.models.sampling import join_proposals_around, propose_around

RECIPE_CLASSES = 81  # configs/maskrcnn_baseline.yaml: COCO's 80 and the background
# The model keys a setting may change: the others would make a different model, not another
# way to train the same one.
SETTING_MODEL_KEYS = ("activation_checkpointing", "frozen_bn", "fpn", "forward")


@dataclass(frozen=True)
class Setting:
    """One way to train the bench's model: a name and the config overrides that make it."""

    name: str
    overrides: tuple[str, ...] = ()


@dataclass
class Variant:
    """One DropIT setting to compare with the baseline."""

    strategy: str
    gamma: float
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``mink 0.9 values=int8``."""
        opts = " ".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.strategy} {self.gamma:g}" + (f" {opts}" if opts else "")

    @property
    def setting(self) -> Setting:
        """The variant as config overrides (``dropit.*``), named by its label."""
        overrides = [
            "dropit.enabled=true",
            f"dropit.strategy={self.strategy}",
            f"dropit.gamma={self.gamma!r}",
        ]
        if self.options:  # JSON is YAML's flow style, which the overrides parse
            overrides.append("dropit.options=" + json.dumps(self.options))
        return Setting(self.label, tuple(overrides))


def plan_settings(plan: str | Path, names: Sequence[str]) -> list[Setting]:
    """The settings ``names`` of a study plan (its ``settings:`` overrides), in the given order."""
    from instruments.measure.study_plan import load_plan

    known = load_plan(plan).settings
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UsageError(
                f"setting '{name}' is not in {plan}{hint} (settings there: {', '.join(known)})"
            )
    return [Setting(name, known[name]) for name in names]


def parse_variant(text: str) -> Variant:
    """Parse ``strategy:gamma[:key=value,...]``, e.g. ``mink:0.9:values=int8`` (a study plan's
    settings convert part of the model: ``--settings mink_0.8_backbone``)."""
    parts = text.split(":")
    if len(parts) < 2:
        raise UsageError(f"variant {text!r}: expected strategy:gamma[:key=value,...]")
    try:
        gamma = float(parts[1])
    except ValueError:
        raise UsageError(f"variant {text!r}: gamma {parts[1]!r} is not a number") from None
    options: dict[str, Any] = {}
    for item in ":".join(parts[2:]).split(",") if len(parts) > 2 else []:
        key, _, value = item.partition("=")
        options[key] = _option_value(value)
    return Variant(parts[0], gamma, options)


def _option_value(text: str) -> Any:
    """``4096`` -> int, ``true``/``false`` -> bool, anything else stays text."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def recipe_config(
    scratch: bool,
    image_size: int,
    rois_per_image: int = 512,
    backbone: str = "resnet50",
    heads: str = "v1",
) -> Config:
    """The config of the bench's model (:func:`detector`): the COCO recipe without downloaded
    weights, at ``image_size``; ``scratch``: BatchNorm and every stage trainable; ``heads``:
    ``model.heads`` (v2: a BatchNorm after every FPN and head conv, torchvision's v2 models)."""
    model: dict[str, Any] = {
        "num_classes": RECIPE_CLASSES,
        "backbone": backbone,
        "pretrained_backbone": False,
        "min_size": image_size,
        "max_size": image_size,
        "box_batch_size_per_image": rois_per_image,
        "heads": heads,
    }
    if scratch:
        model.update(norm="bn", trainable_layers=5)
    return config_from_dict({"model": model})


def setting_config(base: Config, setting: Setting) -> Config:
    """``base`` with the setting's overrides, checked to train the same model as ``base``."""
    cfg = with_overrides(base, setting.overrides, source=f"bench setting '{setting.name}'")
    for f in dataclasses.fields(cfg.model):
        mine, theirs = getattr(cfg.model, f.name), getattr(base.model, f.name)
        if f.name not in SETTING_MODEL_KEYS and mine != theirs:
            raise UsageError(
                f"bench setting '{setting.name}': model.{f.name} = {mine!r} differs from the "
                f"bench's {theirs!r}; a setting may change dropit.* and "
                f"model.{', model.'.join(SETTING_MODEL_KEYS)} only (the bench compares ways to "
                "train one model)"
            )
    return cfg


def resolve_settings(
    settings: Sequence[Setting | Variant], base: Config
) -> tuple[Setting, list[tuple[Setting, Config]]]:
    """Each setting with its config (:func:`setting_config`: every one resolved before minutes
    of model building, so a bad override fails at once), the baseline's apart: its setting (the
    first given one whose config is ``base`` itself, e.g. the plan's ``baseline``; else one
    named so) and the settings left to compare with it."""
    resolved = [
        (s, setting_config(base, s))
        for s in (x.setting if isinstance(x, Variant) else x for x in settings)
    ]
    for i, (setting, cfg) in enumerate(resolved):
        if cfg == base:
            return setting, [*resolved[:i], *resolved[i + 1 :]]
    return Setting("baseline"), list(resolved)


def draws_randomly(cfg: Config) -> bool:
    """Whether a step of ``cfg``'s model draws random numbers in DropIT (so that two steps give
    two different weight gradients): a drawing strategy, or saved tensors rounded at random."""
    if cfg.dropit.saved_bits:
        return True
    return cfg.dropit.enabled and any(r.strategy.draws for r in dropit_rules(cfg.dropit))


def describe(cfg: Config) -> dict[str, Any]:
    """What a setting changes, for the rows: DropIT's strategy, gamma, options, layers and
    rules (None without DropIT) and the checkpointed modules."""
    d = cfg.dropit
    one = d.enabled and not d.rules  # one strategy for every converted layer
    return {
        "strategy": d.strategy if one else None,
        "gamma": d.gamma if one else None,
        "options": dict(d.options) if one else {},
        "include": list(d.include) if one else None,
        "rules": [dict(r) for r in d.rules] if d.enabled and d.rules else None,
        "activation_checkpointing": list(cfg.model.activation_checkpointing),
        "frozen_bn": cfg.model.frozen_bn,
        "fpn": cfg.model.fpn,
        "forward": cfg.model.forward,
        "heads": cfg.model.heads,
        "accumulate": cfg.solver.accumulate,
        "saved_bits": d.saved_bits,
        "compile": cfg.train.compile,
    }


def detector(cfg: Config) -> nn.Module:
    """The model of ``cfg`` as training builds it, with the bench's random weights (seed 0):
    every setting of one recipe starts from the same weights; compiled as ``train.compile``
    says (in place: it compiles in the first, untimed, step)."""
    torch.manual_seed(0)
    model, _ = build_model(cfg)
    model.rpn.register_forward_hook(join_proposals_around)  # for a workload that proposes
    compile_model(model, cfg.train.compile, cfg.train.compile_backend, cfg.train.compile_mode)
    return model


@dataclass(frozen=True)
class Workload:
    """What a bench step's RoI heads see: ``objects`` ground-truth objects per image and,
    around each, ``proposals_per_object`` boxes a trained RPN would propose (jittered copies,
    joined to the proposals as torchvision joins the ground truth). An untrained RPN proposes
    nothing near the objects: its heads' only positives are the ground-truth boxes."""

    name: str
    objects: int
    proposals_per_object: int


# COCO train2017 holds 7.3 objects per image (860k instances in 118k images); a trained R50-FPN
# sampler's positives per image: docs/results/memory.md's workload section cites the figures.
WORKLOADS = {
    w.name: w
    for w in (
        # a trained detector's RoIs: COCO-like objects (16 px to 0.6 of the image, aspect 1:2
        # to 2:1), trained-RPN proposals around each
        Workload("trained", 7, 12),
        # the sampler's cap: more positives than it keeps (box_batch_size_per_image x 0.25)
        Workload("cap", 7, 24),
        # an untrained detector (random weights, the RPN's proposals nowhere near): 3 fixed
        # boxes per image, whose ground truth is the heads' only positives
        Workload("untrained", 3, 0),
    )
}
DEFAULT_WORKLOAD = "trained"


def workload_named(name: str) -> Workload:
    """The workload called ``name``; a UsageError naming the choices otherwise."""
    if name not in WORKLOADS:
        raise UsageError(f"workload '{name}' is not one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


# The untrained workload's objects, relative to the image side (the first benches' batch).
UNTRAINED_BOXES = torch.tensor(
    [[0.1, 0.12, 0.4, 0.43], [0.5, 0.2, 0.8, 0.75], [0.06, 0.6, 0.35, 0.94]]
)


def make_batch(
    image_size: int, device: torch.device, n_images: int = 2, workload: str = DEFAULT_WORKLOAD
):
    """Images with ``workload``'s objects (boxes, box-shaped masks, labels), deterministic; each
    target carries ``rpn_jitter`` (rcnn_dropit.models.sampling) when the workload proposes
    around its objects."""
    w = workload_named(workload)
    gen = torch.Generator().manual_seed(0)
    images, targets = [], []
    s = image_size
    for _ in range(n_images):
        images.append(torch.rand(3, s, s, generator=gen).to(device))
        if w.proposals_per_object == 0:  # the first benches' three boxes, as they were
            b = (UNTRAINED_BOXES * s).round()
            labels = torch.tensor([1, 2, 3])
        else:
            side = torch.empty(w.objects).uniform_(math.log(16), math.log(0.6 * s), generator=gen)
            aspect = torch.empty(w.objects).uniform_(-0.7, 0.7, generator=gen).exp()
            bw = (side.exp() * aspect).clamp(max=s - 2)
            bh = (side.exp() / aspect).clamp(max=s - 2)
            x0 = torch.rand(w.objects, generator=gen) * (s - 1 - bw)
            y0 = torch.rand(w.objects, generator=gen) * (s - 1 - bh)
            b = torch.stack([x0, y0, x0 + bw, y0 + bh], 1).round()
            labels = torch.randint(1, RECIPE_CLASSES, (w.objects,), generator=gen)
        masks = torch.zeros(len(b), s, s, dtype=torch.uint8)
        for j, (x0, y0, x1, y1) in enumerate(b.int().tolist()):
            masks[j, y0:y1, x0:x1] = 1
        target = {"boxes": b.to(device), "labels": labels.to(device), "masks": masks.to(device)}
        targets.append(target)
    if w.proposals_per_object:
        targets = propose_around(targets, w.proposals_per_object, gen)
    return images, targets


def step_loss(model: nn.Module, batch, amp: str = "none") -> torch.Tensor:
    """The training loss of ``batch``, the graph kept for backward.

    Proposal sampling draws from the global RNG: re-seeded here, every variant samples the same
    proposals, so only the weight gradients of converted layers differ.
    """
    torch.manual_seed(1)
    device = batch[0][0].device
    with autocast(amp, device):
        return sum(model(*batch).values())


def train_step(model: nn.Module, batch, amp: str = "none", accumulate: int = 1) -> None:
    """One forward and backward (gradients set to None first); with ``accumulate`` > 1, the
    batch in that many micro-batches, each forward and backward in turn, as training does."""
    model.zero_grad(set_to_none=True)
    # Under fp16 a real run scales the loss (GradScaler); the scale changes neither memory nor
    # time of the backward, so the bench leaves it out.
    if accumulate == 1:
        step_loss(model, batch, amp).backward()
        return
    for part in micro_batch_parts(batch, accumulate):
        (step_loss(model, part, amp) * (len(part[0]) / len(batch[0]))).backward()


def micro_batch_parts(batch, accumulate: int) -> list[tuple[list, list]]:
    """The bench batch (images, targets) as the trainer splits it (engine.step.micro_batches)."""
    from rcnn_dropit.engine.step import micro_batches

    return micro_batches(batch[0], batch[1], accumulate)


def eval_step(model: nn.Module, batch, amp: str = "none") -> None:
    """One inference pass over the batch's images (the model left in training mode)."""
    model.eval()
    with torch.no_grad(), autocast(amp, batch[0][0].device):
        model(batch[0])
    model.train()

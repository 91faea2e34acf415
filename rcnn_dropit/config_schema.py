"""The configuration schema: nested dataclasses with defaults, allowed choices and ranges."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from dropit_core import PAPER_EXCLUDE, REGISTRY, Rule, check_rules
from rcnn_dropit.memory_methods import DEFAULT_CANDIDATES, candidates_error, parse_budget

# train.compile's companions: the torch.compile backends and Inductor modes the toolkit offers.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# dropit.exclude's default: the DropIT paper's exclusions (dropit_core.PAPER_EXCLUDE).


def _f(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **rules: Any):
    """A dataclass field whose validation rules (choices, ge, gt, le, lt) live in its metadata."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=rules)
    return field(default=default, metadata=rules)


@dataclass
class ModelConfig:
    """Detector architecture, backbone and initialisation."""

    arch: str = _f("maskrcnn", choices=("maskrcnn", "fasterrcnn"))
    backbone: str = _f("resnet50", choices=("resnet18", "resnet34", "resnet50", "resnet101"))
    pretrained_backbone: bool = False  # torchvision ImageNet weights, downloaded
    backbone_weights: str | None = None  # local file of the same; wins over pretrained_backbone
    weights: str | None = None
    trainable_layers: int = _f(3, ge=0, le=5)
    # The body's norm: frozen_bn (the pretrained recipe), bn (from scratch; torchvision's v2
    # models), gn (GroupNorm, 32 groups: detectron2's GN recipes)
    norm: str = _f("frozen_bn", choices=("frozen_bn", "bn", "gn"))
    # v1: torchvision's maskrcnn/fasterrcnn_resnet50_fpn heads (FPN convs with a bias, one RPN
    # conv, two fully-connected box layers, mask convs without norm). v2: those of
    # *_resnet50_fpn_v2 (a norm after every FPN and head conv, two RPN convs, four box convs and
    # one fully-connected layer): with norm bn and torchvision's widths, its very state_dict.
    heads: str = _f("v1", choices=("v1", "v2"))
    head_norm: str = _f("bn", choices=("bn", "gn"))  # the FPN's and heads' norm under heads v2
    # How a frozen_bn norm computes under autocast: "lean" keeps the input's dtype (detectron2's
    # form; bit-equal to torchvision's in fp32); "torchvision" is torchvision's FrozenBatchNorm2d,
    # whose fp32 scale promotes every activation to fp32 (about twice the activation memory
    # under AMP): kept only to measure against.
    frozen_bn: str = _f("lean", choices=("lean", "torchvision"))
    # The FPN's forward: "lean" upsamples in the features' dtype under CUDA autocast
    # (F.interpolate is on its fp32 list), adds each top-down map into its lateral in place and
    # lets every map go after its last use (dropit_core.detection.forward; bit-equal in fp32);
    # "torchvision" is torchvision's FPN: kept only to measure against.
    fpn: str = _f("lean", choices=("lean", "torchvision"))
    # The detector's, backbone's and RoI poolers' forward: "lean" hands the body's maps to the
    # FPN and the pyramid to the heads, which release them after their last use (the mask head
    # runs without P2-P6 alive); "torchvision" holds them to the end: kept only to measure
    # against. Outputs, losses and gradients are the same bit for bit in fp32.
    forward: str = _f("lean", choices=("lean", "torchvision"))
    num_classes: int = _f(91, ge=2)
    min_size: int = _f(800, ge=1)
    max_size: int = _f(1333, ge=1)
    box_detections_per_img: int = _f(100, ge=1)
    box_batch_size_per_image: int = _f(512, ge=1)
    rpn_batch_size_per_image: int = _f(256, ge=1)
    # Proposals per FPN level before the RPN's NMS and per image after it, in training and in
    # test (torchvision's and detectron2's defaults: 2000/2000 and 1000/1000, made for 800 px).
    rpn_pre_nms_top_n_train: int = _f(2000, ge=1)
    rpn_post_nms_top_n_train: int = _f(2000, ge=1)
    rpn_pre_nms_top_n_test: int = _f(1000, ge=1)
    rpn_post_nms_top_n_test: int = _f(1000, ge=1)
    # One anchor size per FPN level (P2..P6), 3 aspect ratios each, as torchvision's default.
    anchor_sizes: list[int] = _f(factory=lambda: [32, 64, 128, 256, 512])
    # Widths of the parts built on the backbone; torchvision's values by default. Narrower parts
    # make a model for CPU work (the shapes study and demo); the COCO recipe keeps these.
    fpn_channels: int = _f(256, ge=1)  # FPN output channels, so also the RPN and RoI features
    box_head_width: int = _f(1024, ge=1)  # width of the box head's two fully-connected layers
    mask_head_channels: int = _f(256, ge=1)  # channels of the mask head's convs and deconv
    mask_head_convs: int = _f(4, ge=1)  # number of 3x3 convs in the mask head
    # Module path patterns recomputed in backward instead of keeping their activations (exact
    # activation checkpointing, e.g. [backbone.body.layer2, backbone.body.layer3,
    # backbone.body.layer4]); DropIT leaves the layers inside them plain.
    activation_checkpointing: list[str] = _f(factory=list)
    # Fixed padded batch sizes [[height, width], ...], multiples of 32: each batch is padded to
    # the smallest that holds torchvision's own padded size (the heads still see each image's
    # size), so the backbone meets few input shapes (a CUDA graph or compiled graph each); a
    # batch none holds is padded as torchvision pads it and counted (unbucketed_batches in
    # metrics.jsonl). Empty: off. The COCO recipe's two orientations at its max size (800 x
    # 1333 rounded to 32): [[800, 1344], [1344, 800]].
    size_buckets: list[list[int]] = _f(factory=list)


@dataclass
class DropITConfig:
    """Which layers DropIT converts, with which strategy and gamma."""

    enabled: bool = False
    # dropit_core's registry owns the strategies and their options (dropit.options depends on
    # dropit.strategy, so it is checked in cross_check, against the registry)
    strategy: str = _f("mink", choices=REGISTRY.names)
    gamma: float = _f(0.8, ge=0.0, lt=1.0)
    include: list[str] = _f(factory=lambda: ["*"])
    exclude: list[str] = _f(factory=lambda: list(PAPER_EXCLUDE))
    options: dict[str, Any] = _f(factory=dict)
    # Also pack the inputs of BatchNorm2d/SyncBatchNorm/GroupNorm (trainable norms keep theirs
    # whole for backward): needs strategy quant; frozen norms keep nothing and are left alone.
    norm: bool = False
    # MaxPool2d keeps one byte per output (its window's winner) instead of its input and int64
    # indices: exact, the plain layer's gradient bit for bit.
    pool: bool = False
    # Every other floating-point tensor of 64 KiB or more that autograd saves in a training
    # forward, kept at this many bits through saved-tensor hooks (dropit_core.compress_saved):
    # what no converted layer owns, or, with `enabled: false`, the whole model. 0: off.
    saved_bits: int = _f(0, choices=(0, 2, 4, 8))
    # Per-group rules: each {include, exclude, strategy, gamma, norm, pool, options}, keys it leaves
    # out taken from the keys above; `exclude` above applies to every rule. Empty: the keys above
    # are the one rule. A layer claimed by two rules, or a pattern matching nothing, is an error.
    rules: list[dict[str, Any]] = _f(factory=list)


@dataclass
class ShapesConfig:
    """The synthetic shapes data set, used when data.dataset is shapes."""

    num_train: int = _f(200, ge=1)
    num_val: int = _f(50, ge=1)
    image_size: int = _f(128, ge=32)  # the generator's smallest (data/shapes.py)
    num_classes: int = _f(3, ge=1)
    seed: int = 0
    first_class: int = _f(0, ge=0, le=5)  # classes are the shape names from this index on


@dataclass
class DataConfig:
    """Where the images and annotations are, and how they are loaded."""

    dataset: str = _f("coco", choices=("coco", "shapes"))
    root: str = "datasets/coco"
    train_images: str = "train2017"
    train_ann: str = "annotations/instances_train2017.json"
    val_images: str = "val2017"
    val_ann: str = "annotations/instances_val2017.json"
    shapes: ShapesConfig = _f(factory=ShapesConfig)
    num_workers: int = _f(4, ge=0)
    aspect_ratio_group_factor: int = _f(3, ge=-1)
    hflip_prob: float = _f(0.5, ge=0.0, le=1.0)
    skip_missing_images: bool = False


@dataclass
class SolverConfig:
    """Optimizer, learning-rate schedule and numerics."""

    optimizer: str = _f("sgd", choices=("sgd", "adamw"))
    lr: float = _f(0.02, gt=0.0)
    momentum: float = _f(0.9, ge=0.0, lt=1.0)
    weight_decay: float = _f(0.0001, ge=0.0)
    batch_size: int = _f(2, ge=1)  # images per process and optimizer step
    # Gradient accumulation: each batch goes through forward and backward in this many
    # micro-batches, one optimizer step for all of them; activation memory of a micro-batch,
    # the same schedule, lr and steps. Exact for frozen norms; BatchNorm sees smaller batches.
    # A batch of fewer images than this (an epoch's last) goes one image per micro-batch.
    accumulate: int = _f(1, ge=1)
    epochs: int = _f(26, ge=1)
    max_iters: int | None = _f(None, ge=1)
    scheduler: str = _f("multistep", choices=("multistep", "cosine"))
    lr_steps: list[int] = _f(factory=lambda: [16, 22])
    lr_decay: float = _f(0.1, gt=0.0, le=1.0)
    warmup_iters: int = _f(1000, ge=0)
    warmup_factor: float = _f(0.001, gt=0.0, le=1.0)
    clip_grad_norm: float | None = _f(None, gt=0.0)
    amp: str = _f("none", choices=("none", "fp16", "bf16"))
    auto_scale_lr: bool = False
    reference_batch: int = _f(16, ge=1)
    nonfinite: str = _f("stop", choices=("stop", "skip"))


@dataclass
class TrainConfig:
    """Run directory, devices, logging and checkpoint cadence."""

    output_dir: str | None = None
    seed: int = _f(42, ge=0)
    device: str = _f("auto", choices=("auto", "cpu", "cuda"))
    log_every: int = _f(20, ge=1)
    eval_every: int = _f(1, ge=0)
    eval_every_iters: int = _f(0, ge=0)  # also evaluate every N iterations (0: off)
    checkpoint_every: int = _f(1, ge=0)
    checkpoint_every_iters: int = _f(0, ge=0)
    keep_last: int = _f(3, ge=0)
    sync_bn: bool = False
    # torch.compile: none, the backbone (body + FPN: one graph with DropIT's quant layers), or
    # the whole model (the heads break the graph where they are data-dependent)
    compile: str = _f("none", choices=("none", "backbone", "model"))
    # torch.compile's backend: inductor (generated kernels), aot_eager (traced forward and
    # backward run by eager ops: no code generation, for debugging a graph), eager (Dynamo only)
    compile_backend: str = _f("inductor", choices=COMPILE_BACKENDS)
    # Inductor's mode: reduce-overhead replays CUDA graphs (no per-kernel launch from Python)
    compile_mode: str = _f("default", choices=COMPILE_MODES)
    # torch.use_deterministic_algorithms, cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG) and
    # cuDNN without autotuning, for two GPU runs of one seed to log the same losses; an op
    # without a deterministic implementation stops the run naming it. CPU runs are bit-exact
    # without it.
    deterministic: bool = False
    measure_memory: bool = True
    tensorboard: bool = False  # scalars next to metrics.jsonl; needs the 'tensorboard' extra
    # Train with the fastest memory method that fits this budget per process, measured on this
    # process's device with the run's model, batch and largest image before training
    # (rcnn_dropit/engine/budget.py): a size ("22GB", "22000MB"; binary units) or a fraction of
    # the device's memory (0.9). A size or a number, hence untyped here: cross_check reads it.
    # None: train the config's own method.
    memory_budget: Any = None
    # The methods measured for it (rcnn_dropit.memory_methods.METHODS), by name
    memory_candidates: list[str] = _f(factory=lambda: list(DEFAULT_CANDIDATES))
    # A method fits when its measured peak times (1 + margin) is within the budget: what the
    # allocator's fragmentation and the CUDA context take beyond the tensors' own bytes
    memory_margin: float = _f(0.1, ge=0.0, lt=1.0)
    # The positive RoIs per image the probe's RoI heads see: the run's first batch comes from an
    # untrained RPN (only its ground truth is positive), a trained one fills the sampler, so the
    # probe proposes around each object until this many are positive (as a trained RPN does).
    # None: the sampler's cap, a quarter of model.box_batch_size_per_image; 0: the first batch's.
    memory_probe_positives: int | None = _f(None, ge=0)


@dataclass
class TestConfig:
    """Inference settings."""

    __test__ = False  # not a pytest test class

    score_thresh: float = _f(0.05, ge=0.0, le=1.0)


@dataclass
class Config:
    """The whole resolved configuration of one run."""

    name: str = ""
    model: ModelConfig = _f(factory=ModelConfig)
    dropit: DropITConfig = _f(factory=DropITConfig)
    data: DataConfig = _f(factory=DataConfig)
    solver: SolverConfig = _f(factory=SolverConfig)
    train: TrainConfig = _f(factory=TrainConfig)
    test: TestConfig = _f(factory=TestConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of builtin types (YAML/JSON/checkpoint friendly)."""
        return dataclasses.asdict(self)


NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]*")


def cross_check(cfg: Config) -> list[str]:
    """Problems that involve more than one key; each item is one error message."""
    errors = []
    m, s = cfg.model, cfg.solver
    if cfg.name and not NAME.fullmatch(cfg.name):  # outputs/<name>: one folder in outputs/
        errors.append(
            f"name {cfg.name!r}: must be a folder name of letters, digits, '.', '_' and '-' "
            "(not starting with '.'); choose the folder itself with --output-dir"
        )
    sizes = m.anchor_sizes
    if len(sizes) != 5 or any(a <= 0 for a in sizes) or sorted(sizes) != sizes:
        errors.append(
            f"model.anchor_sizes {sizes}: must be 5 positive increasing sizes, one per FPN level"
        )
    if m.max_size < m.min_size:
        errors.append(f"model.max_size ({m.max_size}) must be >= model.min_size ({m.min_size})")
    bad_buckets = [b for b in m.size_buckets if len(b) != 2 or min(b) < 1 or any(x % 32 for x in b)]
    if bad_buckets:
        errors.append(
            f"model.size_buckets {m.size_buckets}: each bucket must be [height, width], two "
            f"positive multiples of 32 (torchvision pads batches to multiples of 32), e.g. "
            f"[[800, 1344], [1344, 800]]; {bad_buckets[0]} is not"
        )
    shapes = cfg.data.shapes
    if cfg.data.dataset == "shapes" and shapes.first_class + shapes.num_classes > 6:
        errors.append(
            f"data.shapes.first_class ({shapes.first_class}) + data.shapes.num_classes "
            f"({shapes.num_classes}) must be <= 6, the number of shape kinds"
        )
    if cfg.data.dataset == "shapes" and m.num_classes != shapes.num_classes + 1:
        errors.append(
            f"model.num_classes ({m.num_classes}) must be data.shapes.num_classes + 1 "
            f"({shapes.num_classes + 1}: the shape classes plus background)"
        )
    errors += _dropit_option_errors(cfg.dropit)
    errors += memory_budget_errors(cfg.train)
    mode_error = compile_mode_error(cfg.train.compile_backend, cfg.train.compile_mode)
    if mode_error:
        errors.append(mode_error)
    steps = s.lr_steps
    if any(b <= a for a, b in zip(steps[:-1], steps[1:], strict=True)) or any(x < 1 for x in steps):
        errors.append(f"solver.lr_steps {steps}: must be positive and strictly increasing")
    return errors


def memory_budget_errors(t: TrainConfig) -> list[str]:
    """What is wrong with ``train.memory_budget`` and ``train.memory_candidates`` (the
    candidates are checked even without a budget: a typo would wait there for the day one is
    set)."""
    errors = []
    if t.memory_budget is not None:
        try:
            parse_budget(t.memory_budget)
        except ValueError as err:
            errors.append(str(err))
    problem = candidates_error(list(t.memory_candidates))
    return [*errors, problem] if problem else errors


def compile_mode_error(backend: str, mode: str) -> str | None:
    """Why ``train.compile_mode`` cannot go with ``train.compile_backend``, or None."""
    if mode == "default" or backend == "inductor":
        return None
    return (
        f"train.compile_mode={mode!r} needs train.compile_backend=inductor (got {backend!r}): "
        "only Inductor has modes"
    )


def dropit_rules(d: DropITConfig) -> list[Rule]:
    """The DropIT section as dropit_core's checked rules, strategies built: ``rules`` with the
    section's keys as their fallbacks, or the section itself as the one rule. ValueError names
    a bad one."""
    return check_rules(
        d.rules or None,
        d.strategy,
        d.gamma,
        d.include,
        d.exclude,
        norm=d.norm,
        pool=d.pool,
        **d.options,
    )


def _dropit_option_errors(d: DropITConfig) -> list[str]:
    """dropit.options checked by dropit_core against the chosen strategy's declaration, at load
    time (before anything is written)."""
    if not d.enabled:
        return []
    try:
        dropit_rules(d)
    except ValueError as err:
        return [f"dropit.{'rules' if d.rules else 'options'}: {err}"]
    return []

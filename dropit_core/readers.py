"""What reads a ReLU's output, from a model's structure: where a ReLU's 1-bit mask frees memory
(docs/dropit.md, "Which ReLUs keep a mask").

A module's *flow* says, for each of its children (or ``INPUT``), which children (or ``OUTPUT``:
whoever reads the module's own output) read that child's output, once per call of the child. An
``nn.Sequential`` (and every subclass that keeps its forward) runs its children in order; other
forwards are code, so the flows of torchvision's ResNets and detection modules (and of the lean
forwards of :mod:`dropit_core.detection`) are written in :data:`FLOWS`, by the name of the class
whose ``forward`` runs. A module with no flow there says nothing.

:func:`masks_that_free_nothing` names the ReLUs to leave plain: those whose every call's output
has a reader that keeps it whole (a needless mask costs 1 bit an element, a whole output 32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

from torch import nn

INPUT, OUTPUT = "<input>", "<output>"
Flow = dict[str, tuple[tuple[str, ...], ...]]  # as above; readers may be dotted paths below


def sequential_flow(module: nn.Module) -> Flow:
    """The flow of a module whose children run in registration order, each reading the output
    of the one before (``nn.Sequential``), the last one's being the module's output."""
    names = [name for name, _ in module.named_children()]
    flow: Flow = {INPUT: ((names[0],),)} if names else {}
    for name, reader in zip(names, [*names[1:], OUTPUT], strict=True):
        flow[name] = ((reader,),)
    return flow


def _returning_flow(module: Any) -> Flow:
    # torchvision's IntermediateLayerGetter: sequential, each returned child's output out as well
    flow = sequential_flow(module)
    for name in module.return_layers:
        readers = flow[name][0]
        flow[name] = (readers if OUTPUT in readers else (*readers, OUTPUT),)
    return flow


def _block_flow(*relu_calls: str) -> Callable[[nn.Module], Flow]:
    # torchvision's ResNet blocks: the input feeds conv1 and the downsample conv (and the
    # residual add, which keeps nothing); the one ReLU module is called after each norm but the
    # last, then on the residual sum, the block's output
    calls = tuple((reader,) for reader in relu_calls) + ((OUTPUT,),)
    return lambda module: {INPUT: (("conv1", "downsample"),), "relu": calls}


def _fixed_flow(flow: Flow) -> Callable[[nn.Module], Flow]:
    return lambda module: flow


def _fpn_flow(module: Any) -> Flow:
    # each input map is read by its lateral (inner) conv; the readers of one map are not told
    # apart from the others', so a body output counts every inner conv as its reader
    return {INPUT: (tuple(f"inner_blocks.{i}" for i in range(len(module.inner_blocks))),)}


_BACKBONE_WITH_FPN = _fixed_flow({INPUT: (("body",),), "body": (("fpn",),), "fpn": ((OUTPUT,),)})
_RPN_HEAD = _fixed_flow({INPUT: (("conv",),), "conv": (("cls_logits", "bbox_pred"),)})

# Flows by the qualified name of the class that defines the forward that runs (no import of
# torchvision needed to read them; the lean forwards of dropit_core.detection run the same ops).
FLOWS: dict[str, Callable[[nn.Module], Flow]] = {
    "torch.nn.modules.container.Sequential": sequential_flow,
    # conv1, bn1, relu, maxpool, layer1-4, avgpool, (a flatten: a view), fc: in that order
    "torchvision.models.resnet.ResNet": sequential_flow,
    "torchvision.models._utils.IntermediateLayerGetter": _returning_flow,
    "torchvision.models.resnet.BasicBlock": _block_flow("conv2"),
    "torchvision.models.resnet.Bottleneck": _block_flow("conv2", "conv3"),
    "torchvision.models.detection.backbone_utils.BackboneWithFPN": _BACKBONE_WITH_FPN,
    "dropit_core.detection.forward.LeanBackboneWithFPN": _BACKBONE_WITH_FPN,
    "torchvision.ops.feature_pyramid_network.FeaturePyramidNetwork": _fpn_flow,
    "dropit_core.detection.forward.LeanFeaturePyramidNetwork": _fpn_flow,
    "torchvision.models.detection.rpn.RPNHead": _RPN_HEAD,
    "dropit_core.detection.forward.LeanRPNHead": _RPN_HEAD,
    "torchvision.models.detection.roi_heads.RoIHeads": _fixed_flow(
        {
            "box_head": (("box_predictor",),),
            "mask_head": (("mask_predictor",),),
            "keypoint_head": (("keypoint_predictor",),),
        }
    ),
    "torchvision.models.detection.faster_rcnn.FastRCNNPredictor": _fixed_flow(
        {INPUT: (("cls_score", "bbox_pred"),)}
    ),
    "torchvision.models.detection.keypoint_rcnn.KeypointRCNNPredictor": _fixed_flow(
        {INPUT: (("kps_score_lowres",),)}
    ),
}


def forward_class(module: nn.Module) -> type:
    """The class whose ``forward`` runs for ``module`` (the first in its MRO that defines one)."""
    return next(c for c in type(module).__mro__ if "forward" in c.__dict__)


def flow_of(module: nn.Module) -> Flow | None:
    """``module``'s flow (see the module's docstring), or None where its structure says none."""
    cls = forward_class(module)
    make = FLOWS.get(f"{cls.__module__}.{cls.__qualname__}")
    return None if make is None else make(module)


# Per call of a ReLU, the paths of the layers that read its output; None: not known
Calls = tuple[frozenset[str] | None, ...]


def relu_readers(model: nn.Module, units: Collection[str] = ()) -> dict[str, Calls | None]:
    """For each ``nn.ReLU`` (and subclass) of ``model`` by path: per call, the paths of the
    layers that read that call's output, from the model's structure; None where the structure
    does not say. ``units``: paths of modules read as one layer (checkpointed modules: autograd
    keeps their input, whatever is inside them)."""
    modules = dict(model.named_modules())
    units = frozenset(units)

    @functools.cache
    def flow(path: str) -> Flow | None:
        return flow_of(modules[path])

    def calls(parent: str, name: str) -> tuple[tuple[str, ...], ...] | None:
        own = flow(parent)  # per call of the child ``name`` (or INPUT), the names reading it
        return None if own is None or name not in own else own[name]

    def child(parent: str, name: str) -> str:
        return f"{parent}.{name}" if parent else name

    def entries(path: str) -> frozenset[str] | None:
        if path in units or next(modules[path].children(), None) is None:
            return frozenset((path,))
        inputs = calls(path, INPUT)
        return None if inputs is None else gather(path, [n for call in inputs for n in call])

    def outputs(path: str) -> frozenset[str] | None:
        if not path:
            return None  # the model's output: its readers are the caller's
        parent, _, name = path.rpartition(".")
        readers = calls(parent, name)
        return None if readers is None else gather(parent, [r for call in readers for r in call])

    def gather(parent: str, names: list[str]) -> frozenset[str] | None:
        found: set[str] = set()
        for name in names:
            if name == OUTPUT:
                more = outputs(parent)
            elif child(parent, name) in modules:  # an absent child (a block without downsample)
                more = entries(child(parent, name))
            else:
                continue
            if more is None:
                return None
            found |= more
        return frozenset(found)

    result: dict[str, Calls | None] = {}
    for path, module in modules.items():
        if not path or not isinstance(module, nn.ReLU):
            continue
        parent, _, name = path.rpartition(".")
        readers = calls(parent, name)
        result[path] = None if readers is None else tuple(gather(parent, list(c)) for c in readers)
    return result


def masks_that_free_nothing(
    model: nn.Module, keeps_whole: Callable[[str], bool], units: Collection[str] = ()
) -> list[str]:
    """The paths of ``model``'s ReLUs whose mask would free nothing: every call's output is read,
    by the model's structure, by at least one layer that ``keeps_whole`` (a path -> whether that
    layer keeps its whole input). A ReLU with a call whose readers are unknown is not one."""
    return [
        path
        for path, calls in relu_readers(model, units).items()
        if calls is not None
        and all(readers is not None and any(map(keeps_whole, readers)) for readers in calls)
    ]

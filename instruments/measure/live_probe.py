"""The tensors alive at a forward pass's peak (or a whole training step's), each by the line of
code that made it, on any device.

A ``TorchDispatchMode`` sees every op's outputs (inside autograd Functions and torchvision's ops
too). Each new storage is recorded with its size and the innermost frame outside torch itself
(``torchvision/.../feature_pyramid_network.py:199 forward``), and held by a weak reference; before
an op's outputs are counted, the storages that died since the last op are retired. The bytes of
recorded storages alive after each op give the forward's peak, to the op: a storage's life is an
interval of op indices, so the set alive at the peak is read off afterwards, without a copy per
op. Temporaries inside one op (a kernel's scratch) are not seen: they are the op's, not the
model's. What existed before the forward (weights, inputs) is not counted.

A ``saved_tensors_hooks`` pack hook marks the storages autograd keeps for backward, so the peak
splits into what the backward needs (``saved``), what is still alive when the forward ends but
not saved (``held``: the graph's outputs, the losses), and the working set: alive at the peak,
gone by the end of the forward (``transient``). Layers whose own hooks compress what they save
(``compress_saved``) hide it from this hook: their packs count as held.

:func:`step_report` follows the backward too, which is where a step's peak lies once the
forward holds little: a storage the backward makes is named by the autograd node that made it
(``[ConvolutionBackward0]``, a gradient), after the line of our own code where that node runs
Python (an autograd Function's ``backward``: the rebuilt input of a packed layer). One
difference from a step run without the probe: autograd sums two gradients of one tensor in
place only into a tensor nothing else references, and the dispatch mode holds a Python
reference to each, so under the probe that sum is made out of place (an ``add`` where the
step makes an ``add_``): a backward peak at such an ``add`` counts one gradient too many.

Cost: a few microseconds of Python per op, a few seconds for an R50-FPN forward on the CPU (the
profiler's allocation events took about two minutes for one step at 384 px). ``tools/bench.py
live`` prints the reports of the bench's detector.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MB = 1024.0 * 1024.0
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)


def making_line(skip: int = 2) -> str:
    """``path:line function`` of the innermost frame that is not torch's own nor this module's:
    the line of the model's (or torchvision's) code that asked for the op. In the backward that
    :func:`step_report` runs: ``[Node]`` (the autograd node running it), after the line where
    the node runs Python."""
    frame = sys._getframe(skip)
    line = "(torch only)"
    while frame is not None:
        if frame.f_code is _run_backward.__code__:
            line = ""  # the backward's own call: the node ran no Python of ours
            break
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and os.path.abspath(name) != _HERE:
            line = f"{_short(name)}:{frame.f_lineno} {frame.f_code.co_name}"
            break
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    if node is None:
        return line
    if line == "(torch only)":  # a backward on an autograd device thread: no frame of ours
        line = ""
    return f"{line} [{node.name()}]".lstrip()


def _short(path: str) -> str:
    """The path from its package folder on (``torchvision/ops/...``), else its last two parts."""
    parts = path.split(os.sep)
    for i, part in enumerate(parts):
        if part in ("torchvision", "dropit_core", "rcnn_dropit", "instruments", "tests"):
            return "/".join(parts[i:])
    return "/".join(parts[-2:])


@dataclass
class Life:
    """One storage: its bytes, the line that made it, the index of the op after which it exists,
    and the first at which it is gone (None: never)."""

    nbytes: int
    where: str
    born: int
    died: int | None = None
    saved: bool = False  # kept by autograd for the backward
    ref: Any = None  # while followed: a StorageWeakRef


def peak_of(lives: Iterable[Life]) -> tuple[int, int, list[Life]]:
    """(the peak of the lives' summed bytes, the index after which it is first reached, the
    lives alive then): at index i a life counts from ``born <= i`` until ``died <= i``."""
    lives = list(lives)
    change: dict[int, int] = defaultdict(int)
    for life in lives:
        change[life.born] += life.nbytes
        if life.died is not None:
            change[life.died] -= life.nbytes
    now = peak = at = 0
    for i in sorted(change):
        now += change[i]
        if now > peak:
            peak, at = now, i
    alive = [x for x in lives if x.born <= at and (x.died is None or x.died > at)]
    return peak, at, alive


@dataclass
class LiveGroup:
    """The storages alive at the peak that one line made."""

    where: str
    mb: float
    count: int
    saved_mb: float  # of which autograd keeps for backward
    transient_mb: float  # of which the forward frees before it ends


@dataclass
class LiveReport:
    """A forward's (or step's) peak, split by whether backward needs it, and its storages by
    line."""

    peak_mb: float  # recorded storages alive at the peak
    peak_op: int  # index of the op after which it is reached
    ops: int  # ops the forward ran
    op_name: str  # the op that reached it
    op_where: str  # and the line that called it
    saved_mb: float  # alive at the peak and kept for backward
    held_mb: float  # alive at the peak and at the end, not kept by autograd (outputs, losses)
    transient_mb: float  # alive at the peak, freed before the forward ends: the working set
    end_mb: float  # recorded storages alive when the forward ends
    groups: list[LiveGroup] = field(default_factory=list)
    scope: str = "forward"  # what was followed: "forward", or "step" (forward and backward)
    forward_ops: int = 0  # ops of the forward (the first of ``ops``, with a step)

    @property
    def phase(self) -> str:
        """Where the peak is: "backward" when it comes after the forward's last op."""
        return "backward" if self.scope == "step" and self.peak_op > self.forward_ops else "forward"

    def lines(self, top: int = 15) -> list[str]:
        """The report as text: the peak, its split, and the ``top`` lines by bytes at the peak."""
        where = f" in the {self.phase}" if self.scope == "step" else ""
        freed = "working set (freed before the end)"
        if self.scope == "step":  # a step's end: what is left is the weights' gradients
            freed = "freed before the step ends"
        out = [
            f"{self.scope} peak {self.peak_mb:.1f} MB{where} after op {self.peak_op} of "
            f"{self.ops} ({self.op_name} at {self.op_where}); "
            f"alive at the end {self.end_mb:.1f} MB",
            f"  at the peak: saved for backward {self.saved_mb:.1f} MB, held otherwise "
            f"{self.held_mb:.1f} MB, {freed} {self.transient_mb:.1f} MB",
            f"  {'MB':>8} {'saved':>8} {'freed':>8} {'count':>6}  line that made them",
        ]
        for g in self.groups[:top]:
            out.append(
                f"  {g.mb:8.1f} {g.saved_mb:8.1f} {g.transient_mb:8.1f} {g.count:6d}  {g.where}"
            )
        return out


class _Tracker(TorchDispatchMode):
    """Records every op output's storage and retires the dead ones (see the module's doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.lives: list[Life] = []
        self.alive: dict[int, Life] = {}  # storage address -> its life, while alive
        self.op = 0
        self.made: dict[int, tuple[str, str]] = {}  # op index -> (op, line) of ops that made some
        self.node_ops = 0  # ops seen while an autograd node ran (the backward's)
        self.preexisting: set[int] = set()

    def sweep(self) -> None:
        """Retire the storages that died since the last op."""
        dead = [k for k, life in self.alive.items() if life.ref.expired()]
        for k in dead:
            self.alive.pop(k).died = self.op

    def record(self, tensors: Iterable[Any], func_name: str) -> None:
        """Record the new storages among ``tensors``, made by op ``func_name``."""
        outs = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        if not outs:
            return
        where = making_line(3)
        # Dead storages go first: a new one may sit at a dead one's address.
        self.sweep()
        for t in outs:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self.alive or key in self.preexisting:
                continue  # a view, an in-place result, or two outputs of one storage
            life = Life(nbytes, where, self.op, ref=StorageWeakRef(storage))
            self.alive[key] = life
            self.lives.append(life)
        self.made[self.op] = (func_name, where)

    def mark_saved(self, t: torch.Tensor) -> None:
        life = self.alive.get(t.untyped_storage().data_ptr())
        if life is not None:
            life.saved = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.op += 1
        if torch._C._current_autograd_node() is not None:  # only a backward runs nodes
            self.node_ops += 1
        self.record(tree_leaves(out), str(func.overloadpacket.__name__))
        return out


def live_at_peak(
    forward: Callable[[], Any], preexisting: Iterable[torch.Tensor] = ()
) -> tuple[Any, LiveReport]:
    """Run ``forward()`` and report the storages alive at its peak; returns (result, report).

    ``preexisting``: tensors whose storages are not the forward's own (parameters, inputs) and
    must not count when an op returns one of them (a view, an in-place op's output). The result
    keeps the graph, so the caller can still call backward.
    """
    with _following(preexisting) as tracker:
        result = forward()
    return result, report_of(tracker.lives, tracker.op, tracker.made)


@contextlib.contextmanager
def _following(preexisting: Iterable[torch.Tensor]) -> Iterator[_Tracker]:
    """Inside: every op recorded, and the storages that autograd saves marked; at the exit the
    storages that died since the last op retired."""
    tracker = _Tracker()
    tracker.preexisting = {t.untyped_storage().data_ptr() for t in preexisting}

    def pack(t: torch.Tensor) -> torch.Tensor:
        tracker.mark_saved(t)  # the forward's saves, and a checkpoint's recomputed ones
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tracker:
        yield tracker
    tracker.sweep()
    tracker.op += 1
    tracker.sweep()


def _run_backward(loss: torch.Tensor) -> None:
    """``loss.backward()``; :func:`making_line` stops at this frame (see there)."""
    loss.backward()


def live_through_step(
    forward: Callable[[], torch.Tensor], preexisting: Iterable[torch.Tensor] = ()
) -> LiveReport:
    """Run ``forward()`` and the backward of the loss it returns; report the storages alive at
    the step's peak, in whichever phase it falls. The weights' gradients are left set."""
    with _following(preexisting) as tracker:
        loss = forward()
        forward_ops = tracker.op
        _run_backward(loss)
        del loss
    if not tracker.node_ops:  # a backward the mode did not follow (another thread) looks empty
        raise RuntimeError("the live probe saw no op of the backward: it ran outside the mode")
    report = report_of(tracker.lives, tracker.op, tracker.made)
    report.scope, report.forward_ops = "step", forward_ops
    return report


def report_of(lives: Sequence[Life], ops: int, made: Mapping[int, tuple[str, str]]) -> LiveReport:
    """The report of ``lives`` over ``ops`` ops: :func:`peak_of`, the split of what
    is alive at the peak, and its lives grouped by line; ``made``: the op and the line of each
    index where lives were born (the peak's)."""
    peak, peak_op, at_peak = peak_of(lives)
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0, 0.0])
    saved = held = transient = 0.0
    for life in at_peak:
        g = groups[life.where]
        g[0] += life.nbytes
        g[1] += 1
        if life.saved:
            saved += life.nbytes
            g[2] += life.nbytes
        elif life.died is None:
            held += life.nbytes
        else:
            transient += life.nbytes
            g[3] += life.nbytes
    end = sum(life.nbytes for life in lives if life.died is None)
    ordered = sorted(groups.items(), key=lambda kv: -kv[1][0])
    op_name, op_where = made.get(peak_op, ("", ""))
    return LiveReport(
        peak_mb=peak / MB,
        peak_op=peak_op,
        ops=ops,
        op_name=op_name,
        op_where=op_where,
        saved_mb=saved / MB,
        held_mb=held / MB,
        transient_mb=transient / MB,
        end_mb=end / MB,
        groups=[
            LiveGroup(where, b / MB, int(n), s / MB, f / MB) for where, (b, n, s, f) in ordered
        ],
    )


def forward_report(model: torch.nn.Module, batch, amp: str = "none") -> LiveReport:
    """:func:`live_at_peak` of one training forward of ``model`` on the bench's ``batch``
    (weights, buffers, images and targets are not the forward's own); its backward is run and
    the gradients set to None after it, as a training step leaves them."""
    from instruments.measure.workload import step_loss

    loss, report = live_at_peak(lambda: step_loss(model, batch, amp), _given(model, batch))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return report


def step_report(model: torch.nn.Module, batch, amp: str = "none") -> LiveReport:
    """:func:`live_through_step` of one training step of ``model`` on the bench's ``batch``
    (what :func:`forward_report` counts, and the backward); the gradients are set to None
    after it."""
    from instruments.measure.workload import step_loss

    model.zero_grad(set_to_none=True)
    report = live_through_step(lambda: step_loss(model, batch, amp), _given(model, batch))
    model.zero_grad(set_to_none=True)
    return report


def _given(model: torch.nn.Module, batch) -> list[torch.Tensor]:
    """What a step of ``model`` on ``batch`` does not make: weights, buffers, images, targets."""
    images, targets = batch
    given = [*model.parameters(), *model.buffers(), *images]
    return given + [v for target in targets for v in target.values()]

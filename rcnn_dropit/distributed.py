"""Process-group setup and rank helpers: the one place that knows about ranks.

A job of several processes has ranks only while its process group lives, from
:func:`init_distributed` to :func:`cleanup`: the helpers below answer from the group, and raise
when asked outside its life (every process would otherwise answer "rank 0", and do rank 0's
work). A single process (no launcher, or a world size of 1) is rank 0 of 1 at any time.
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rcnn_dropit.errors import UsageError

DEFAULT_MASTER_PORT = 29500
DEVICE_CHOICES = ("auto", "cpu", "cuda")
T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job and which device it uses."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        """Whether this process is rank 0: the one that owns the console (progress bars)."""
        return self.rank == 0


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout read from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: str  # "torchrun", "slurm" or "none"


def _int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise UsageError(f"environment variable {name} is not set; the launcher must set it")
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from None


def _first_host(nodelist: str) -> str:
    """First host name of a SLURM node list such as 'gpu[03-05,09],cpu01'."""
    if shutil.which("scontrol"):
        proc = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False
        )
        hosts = proc.stdout.split()
        if proc.returncode == 0 and hosts:
            return hosts[0]
    # Without scontrol, the common single-bracket forms are easy to expand by hand.
    first = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if first is None or "[" in nodelist[first.end() :].split(",")[0]:
        raise UsageError(
            f"SLURM_NODELIST={nodelist!r}: cannot find the first host without scontrol; "
            "set MASTER_ADDR"
        )
    prefix, ranges = first.group(1), first.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def _launched_world_size(env: Mapping[str, str]) -> int:
    """How many processes the launcher started: torchrun's WORLD_SIZE, else srun's
    SLURM_NTASKS, else 1."""
    if "WORLD_SIZE" in env:
        return _int_var(env, "WORLD_SIZE")
    if "SLURM_PROCID" in env:
        return _int_var(env, "SLURM_NTASKS")
    return 1


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and rendezvous address set by torchrun or SLURM."""
    env = os.environ if environ is None else environ
    world_size = _launched_world_size(env)
    if "WORLD_SIZE" in env:
        if world_size <= 1:
            return LaunchEnv(0, 1, _int_var(env, "LOCAL_RANK", 0), None, None, "none")
        return LaunchEnv(
            rank=_int_var(env, "RANK"),
            world_size=world_size,
            local_rank=_int_var(env, "LOCAL_RANK"),
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int_var(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
            source="torchrun",
        )
    if "SLURM_PROCID" in env:
        if world_size <= 1:
            return LaunchEnv(0, 1, _int_var(env, "SLURM_LOCALID", 0), None, None, "none")
        # An explicit MASTER_ADDR wins; the launch node is the usual rendezvous host otherwise.
        addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
        if not addr:
            nodelist = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise UsageError(
                    "SLURM job without SLURM_LAUNCH_NODE_IPADDR or SLURM_NODELIST: set MASTER_ADDR"
                )
            addr = _first_host(nodelist)
        return LaunchEnv(
            rank=_int_var(env, "SLURM_PROCID"),
            world_size=world_size,
            local_rank=_int_var(env, "SLURM_LOCALID"),
            master_addr=addr,
            master_port=_int_var(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
            source="slurm",
        )
    return LaunchEnv(0, 1, 0, None, None, "none")


def resolve_device(device_pref: str, local_rank: int) -> torch.device:
    """Device for this process: cuda:LOCAL_RANK when CUDA is wanted and present, else cpu."""
    if device_pref not in DEVICE_CHOICES:
        raise UsageError(f"device {device_pref!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if device_pref == "cpu" or (device_pref == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("device 'cuda' was requested but CUDA is not available; use auto or cpu")
    count = torch.cuda.device_count()
    if count == 1:
        # One visible GPU per process (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank):
        # the launcher already chose it, whatever the local rank.
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise UsageError(
            f"local rank {local_rank} has no GPU: only {count} visible on this node "
            "(start at most one process per GPU: --nproc_per_node, --ntasks-per-node)"
        )
    return torch.device("cuda", local_rank)


def init_distributed(device_pref: str = "auto", timeout_s: float = 1800) -> DistInfo:
    """Join the process group described by the launcher's environment (none for one process)."""
    launch = read_launch_env()
    device = resolve_device(device_pref, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), launch.local_rank, device, True)
    if launch.world_size == 1:
        return DistInfo(0, 1, launch.local_rank, device, False)
    if not dist.is_available():
        raise UsageError("torch.distributed is not available in this torch build")
    if launch.source == "torchrun":
        if not launch.master_addr:
            raise UsageError("environment variable MASTER_ADDR is not set; launch with torchrun")
        init_method = "env://"
    else:
        init_method = f"tcp://{launch.master_addr}:{launch.master_port}"
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return DistInfo(launch.rank, launch.world_size, launch.local_rank, device, True)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _joined() -> bool:
    """Whether this process answers from a live process group (False: a single process).

    In a job of several processes outside the group's life, before :func:`init_distributed` or
    after :func:`cleanup`, no answer is right: raise, rather than let every process be rank 0.
    """
    if _active():
        return True
    if _launched_world_size(os.environ) > 1:
        raise RuntimeError(
            "rank asked outside the process group's life (before init_distributed or after "
            "cleanup): every process of the job would answer rank 0; decide while it lives"
        )
    return False


def get_rank() -> int:
    """Global rank of this process (0 when not distributed)."""
    return dist.get_rank() if _joined() else 0


def get_world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    return dist.get_world_size() if _joined() else 1


def is_main_process() -> bool:
    """True on the process that writes files and logs (rank 0)."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for all processes; no-op when not distributed."""
    if _joined() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Give every rank rank ``src``'s buffers (BatchNorm running statistics).

    DDP syncs buffers only at the start of a training forward, so after the last step each rank
    holds the statistics of its own last batch; evaluating then would not be evaluating the
    model that rank 0 checkpoints.
    """
    if not _joined() or dist.get_world_size() == 1:
        return
    for buf in module.buffers():
        dist.broadcast(buf.data, src)


def all_gather_object(obj: Any) -> list[Any]:
    """Picklable object from every rank, in rank order, on every rank."""
    if not _joined() or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Picklable object from every rank, in rank order, on rank dst only (None elsewhere)."""
    if not _joined() or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst)
    return gathered


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank src's object, returned on every rank."""
    if not _joined() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def rank_and_world_size(distributed: bool = True) -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) when not distributed or not asked for."""
    return (get_rank(), get_world_size()) if distributed else (0, 1)


def _portable(err: Exception) -> Exception:
    """err itself if it survives pickling with its type and message, else a RuntimeError
    carrying both: what rank 0 raised must be raisable on every rank."""
    try:
        copy = pickle.loads(pickle.dumps(err))
        if type(copy) is type(err) and str(copy) == str(err):
            return err
    except Exception:  # unpicklable exception types (e.g. required keyword arguments)
        pass
    return RuntimeError(f"{type(err).__name__}: {err}")


def run_on_main(fn: Callable[[], T], share: bool = True) -> T | None:
    """Run fn on rank 0 only, then let every rank go on with its result, or fail with its error.

    An exception fn raises on rank 0 is raised on every rank, with the same type and message,
    so that no rank waits in a collective for a rank that already failed (a torchrun agent would
    stop them, ``srun`` would not: they would hang until the process-group timeout).
    With ``share=False`` the other ranks get None (for results that cannot be pickled).
    All ranks must call it; they leave it together.
    """
    if get_world_size() == 1:
        return fn()
    caught: Exception | None = None
    outcome: tuple[str, Any] = ("ok", None)
    if get_rank() == 0:
        try:
            result = fn()
            outcome = ("ok", result if share else None)
        except Exception as err:
            caught = err
            outcome = ("error", _portable(err))
    outcome = broadcast_object(outcome)
    # Nobody moves on (e.g. reads what rank 0 wrote) before rank 0 is done, and on an error
    # rank 0 leaves (and tears the process group down) only once every rank has its copy.
    barrier()
    if caught is not None:
        raise caught  # rank 0 keeps its own traceback
    if outcome[0] == "error":
        raise outcome[1]
    return result if get_rank() == 0 else outcome[1]


def main_only(fn: Callable[[], T]) -> T | None:
    """Run fn on rank 0 alone, with no collective; None on the other ranks.

    For error paths (e.g. removing a half-made run folder), where the other ranks may already
    have left and a collective such as :func:`run_on_main`'s would wait for them in vain.
    """
    return fn() if get_rank() == 0 else None


def reduce_dict(values: dict[str, torch.Tensor], average: bool = True) -> dict[str, torch.Tensor]:
    """Sum (or mean) of scalar tensors over ranks, for logging; same keys on every rank."""
    if not _joined() or dist.get_world_size() == 1 or not values:
        return dict(values)
    names = sorted(values)  # every rank must stack in the same order
    with torch.no_grad():
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in names])
        dist.all_reduce(stacked)
        if average:
            stacked /= dist.get_world_size()
    return dict(zip(names, stacked, strict=True))


def cleanup() -> None:
    """Leave the process group if one was joined."""
    if _active():
        dist.destroy_process_group()

"""``train.deterministic``: torch's deterministic algorithms, cuBLAS's fixed workspace and cuDNN
without autotuning for a run, and the one-line message for an op that has no deterministic path."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import torch

from rcnn_dropit.errors import UsageError

CUBLAS_VAR = "CUBLAS_WORKSPACE_CONFIG"
# The values torch accepts for deterministic cuBLAS (its check compares the text): eight
# workspace buffers of 4 MiB, or of 16 KiB, the settings under which cuBLAS gives the same bits
# from call to call when several streams use it.
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
# torch's refusal: "<op> does not have a deterministic implementation, but you set ..."
_NO_DETERMINISTIC = re.compile(r"(\S+) does not have a deterministic implementation")


def set_cublas_workspace() -> None:
    """Put ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment unless it holds a value torch
    accepts; one message when it holds another.

    Call it before CUDA starts: torch sizes each cuBLAS handle's workspace from this variable
    when it makes the process's first handle and keeps that size, so a value set after the
    first GPU matmul no longer takes effect.
    """
    value = os.environ.get(CUBLAS_VAR)
    if value is None:
        os.environ[CUBLAS_VAR] = CUBLAS_DETERMINISTIC[0]
    elif value not in CUBLAS_DETERMINISTIC:
        raise UsageError(
            f"train.deterministic: the environment's {CUBLAS_VAR}={value!r} makes cuBLAS "
            f"nondeterministic; unset it (the run then sets {CUBLAS_DETERMINISTIC[0]}) or set "
            f"it to {' or '.join(CUBLAS_DETERMINISTIC)}"
        )


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Inside, when ``enabled``: torch's deterministic algorithms (an op without one raises),
    cuDNN's deterministic kernels without benchmark autotuning, and cuBLAS's fixed workspace.

    On leaving, torch's and cuDNN's flags are as they were on entry (a run started in-process,
    as tests and notebooks do, leaves no global behind); the environment variable stays, since
    cuBLAS keeps the workspace it sized from it. Not ``enabled``: nothing is read or changed,
    so flags a caller set itself hold.
    """
    if not enabled:
        yield
        return
    set_cublas_workspace()
    cudnn = torch.backends.cudnn
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.benchmark,
        cudnn.deterministic,
    )
    # torchvision's roi_align then runs its pure-torch kernel on a GPU, whose backward has no
    # atomic adds (compiled by torch.compile on its first call); on the CPU its C++ kernel
    torch.use_deterministic_algorithms(True)
    cudnn.benchmark, cudnn.deterministic = False, True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        cudnn.benchmark, cudnn.deterministic = before[2], before[3]


def deterministic_refusal(err: BaseException) -> UsageError | None:
    """The one-line message for torch's refusal of an op under ``train.deterministic`` (an op
    without a deterministic implementation, or cuBLAS without its workspace setting), or None
    for any other error."""
    text = str(err)
    found = _NO_DETERMINISTIC.search(text)
    if found:
        return UsageError(
            f"train.deterministic: {found.group(1)} has no deterministic implementation on this "
            "device (torch.use_deterministic_algorithms refuses it); set "
            "train.deterministic=false to run it, nondeterministically"
        )
    if CUBLAS_VAR in text and "deterministic" in text:
        return UsageError(
            f"train.deterministic: cuBLAS was started before {CUBLAS_VAR} was set; set "
            f"{CUBLAS_VAR}={CUBLAS_DETERMINISTIC[0]} in the environment before the run starts"
        )
    return None

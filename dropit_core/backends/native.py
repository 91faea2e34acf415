"""DropIT's CPU packs as C loops (``native.c``), built once with the system C compiler
(docs/dropit.md, "Kernels, the C loops and the draws").

Each of quant's pack and rebuild and the ReLU mask's pack and apply is one C call that reads a
value once, where eager torch makes a pass over memory per operation; the loops compute the eager
path's fp32 operations in the same order (no fused multiply-add), so their bytes are eager's.
Built on first use with ``$CC`` into ``$DROPIT_CACHE_DIR`` (default ``~/.cache/dropit_core``),
loaded with ctypes; where no compiler works, one warning and the eager path. A large call is split
over threads (:data:`PARALLEL_MIN`); the bytes do not depend on it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dropit_core.formats import seeds

SOURCE = Path(__file__).with_name("native.c")
# No -march=native: a cache directory shared by machines of different kinds (a cluster's home)
# must not hand one an instruction another lacks. -ffp-contract=off: no fused multiply-add, so
# every rounding is the eager path's.
FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno")
# The draw's constants come from seeds.py, where the format states them once: the C source
# names them and the build defines them (and they are part of the build's cache key).
SPEC = (
    f"-DMIX_MUL1={seeds.MIX_MUL1:#x}u",
    f"-DMIX_MUL2={seeds.MIX_MUL2:#x}u",
    f"-DTABLE_BITS={seeds.TABLE_BITS}",
    f"-DUNIFORM_BITS={seeds.UNIFORM_BITS}",
)

_lib: ctypes.CDLL | None = None
_failed = False

_i64, _u32, _f32, _ptr = ctypes.c_int64, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "dropit_quant_pack": (_ptr, _i64, _i64, _i64, _i64, _u32, _u32, _f32, _i64, _ptr, _ptr, _ptr),
    "dropit_quant_rebuild": (_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr),
    "dropit_relu_mask": (_ptr, _i64, _ptr),
    "dropit_relu_apply": (_ptr, _ptr, _i64, _ptr),
}


def library() -> ctypes.CDLL | None:
    """The loaded loops, building them on first use; None where that failed (warned once)."""
    global _lib, _failed
    if _lib is not None or _failed:
        return _lib
    try:
        lib = ctypes.CDLL(str(_build()))
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
        _lib = lib
    except Exception as err:  # no compiler, a read-only home, a foreign platform
        _failed = True
        warnings.warn(
            f"DropIT: the C CPU packs are unavailable ({type(err).__name__}: {err}); "
            "packing with eager torch (same bytes, slower)",
            RuntimeWarning,
            stacklevel=2,
        )
    return _lib


def _cache_dir() -> Path:
    root = os.environ.get("DROPIT_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dropit_core"


def _build() -> Path:
    """The shared library for this source, compiler and machine, compiled unless cached."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C compiler {compiler!r} on PATH (set CC)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join((compiler, *FLAGS, *SPEC, platform.machine(), platform.system())).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"dropit_native_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: processes building at once (test
    # workers, DDP ranks) each load a whole file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, *SPEC, str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# Values per thread below which a call runs on the calling thread alone: a split costs tens of
# microseconds, and large maps are where one thread leaves memory bandwidth unused.
PARALLEL_MIN = 1 << 20

_pool: ThreadPoolExecutor | None = None
_pool_key: tuple[int, int] | None = None  # (process, workers) of the pool


def _parts(n: int) -> int:
    """How many threads share a call over n values: torch's intra-op count at most."""
    return max(1, min(torch.get_num_threads(), n // PARALLEL_MIN))


def _run(calls: list[Callable[[], None]]) -> None:
    """Run the calls, the first on this thread and the others on a pool's (ctypes releases the
    GIL during a C call, so they run at once); return when all are done."""
    global _pool, _pool_key
    if not calls:  # an empty tensor: nothing to read or write
        return
    futures = []
    if len(calls) > 1:
        # One pool per process (a forked child has none of its parent's threads), grown when a
        # call needs more workers than it has.
        if _pool_key is None or _pool_key[0] != os.getpid() or _pool_key[1] < len(calls) - 1:
            if _pool is not None and _pool_key[0] == os.getpid():
                _pool.shutdown(wait=False)
            _pool_key = (os.getpid(), len(calls) - 1)
            _pool = ThreadPoolExecutor(max_workers=_pool_key[1], thread_name_prefix="dropit-native")
        futures = [_pool.submit(call) for call in calls[1:]]
    calls[0]()
    for future in futures:
        future.result()


def _ranges(units: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges of ``units`` (the last ones one shorter)."""
    per, extra = divmod(units, parts)
    bounds = [i * per + min(i, extra) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


# A pack read through a cast: native.c's code for each narrower dtype it rounds to
_CASTS = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def quant_pack(
    flat: torch.Tensor,
    bits: int,
    group: int,
    keys: tuple[int, int],
    inv_levels: float,
    codes: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    cast: torch.dtype | None = None,
) -> None:
    """Pack the flat fp32 ``flat`` into the buffers with ``keys`` (``seeds.hash_keys(seed)``);
    ``cast`` (bf16 or fp16): the pack of ``flat.to(cast)``. ``group``: whole bytes of codes."""
    lib, n, per_byte = library(), flat.numel(), 8 // bits
    x, c, lo, st = flat.data_ptr(), codes.data_ptr(), mins.data_ptr(), scales.data_ptr()
    how = _CASTS[cast]

    def part(g0: int, g1: int) -> Callable[[], None]:
        first, count = g0 * group, min(n, g1 * group) - g0 * group
        return lambda: lib.dropit_quant_pack(
            x + 4 * first, count, first, group, bits, keys[0], keys[1], inv_levels, how,
            c + first // per_byte, lo + 4 * g0, st + 4 * g0,
        )  # fmt: skip

    _run([part(a, b) for a, b in _ranges(mins.numel(), _parts(n))])


def quant_rebuild(
    codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, n: int, bits: int, group: int
) -> torch.Tensor:
    """The n fp32 values of a quant pack (flat)."""
    lib, per_byte = library(), 8 // bits
    out = torch.empty(n, dtype=torch.float32)
    codes, mins, scales = codes.contiguous(), mins.contiguous(), scales.contiguous()
    c, lo, st, o = codes.data_ptr(), mins.data_ptr(), scales.data_ptr(), out.data_ptr()

    def part(g0: int, g1: int) -> Callable[[], None]:
        first, count = g0 * group, min(n, g1 * group) - g0 * group
        return lambda: lib.dropit_quant_rebuild(
            c + first // per_byte, lo + 4 * g0, st + 4 * g0, count, group, bits, o + 4 * first
        )

    _run([part(a, b) for a, b in _ranges(mins.numel(), _parts(n))])
    return out


def relu_mask(out: torch.Tensor) -> torch.Tensor:
    """``formats.bits.pack_bits((out <= 0).reshape(-1))``."""
    lib, n = library(), out.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8)
    x, b = out.data_ptr(), bits.data_ptr()

    def part(b0: int, b1: int) -> Callable[[], None]:
        return lambda: lib.dropit_relu_mask(x + 32 * b0, min(n, 8 * b1) - 8 * b0, b + b0)

    _run([part(a, c) for a, c in _ranges(bits.numel(), _parts(n))])
    return bits


def relu_apply(grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``formats.bits.zero_flagged(grad, bits)``: ``grad`` with +0.0 where a flag is set."""
    lib, n = library(), grad.numel()
    result = torch.empty_like(grad)
    bits = bits.contiguous()  # held: a temporary's memory would go before the call reads it
    g, b, r = grad.data_ptr(), bits.data_ptr(), result.data_ptr()

    def part(b0: int, b1: int) -> Callable[[], None]:
        count = min(n, 8 * b1) - 8 * b0
        return lambda: lib.dropit_relu_apply(g + 32 * b0, b + b0, count, r + 32 * b0)

    _run([part(a, c) for a, c in _ranges((n + 7) // 8, _parts(n))])
    return result

"""The Triton kernels against their eager references: quant pack and rebuild, the masked ReLU;
and the C loops against the eager path.

Without a GPU they run under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel is defined); with one, compiled on it. Tensors stay near
1e4 elements: the interpreter runs about 1e5 a second. Skipped where triton is not installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dropit_core import (
    build_strategy,
    configure,
    current_settings,
    override_settings,
    reset_settings,
    set_step,
    to_dropit,
)
from dropit_core.backends import dispatch, native
from dropit_core.backends.dispatch import quant_kernels_take
from dropit_core.formats import seeds
from dropit_core.formats.quant import unpack_codes
from dropit_core.layers.relu import MaskedReLUFunction
from dropit_core.strategies.quant import pack_signed, unpack_signed
from tests.core.kernel_env import DEVICE, FLOATS, INTERPRETED, NEEDS_KERNELS, same_bits
from tests.core.test_dropit_unbiased import _activation, _error_in_noise_units

triton = pytest.importorskip("triton")
pytestmark = NEEDS_KERNELS

import triton.language as tl  # noqa: E402  (after the skip: triton may be missing)

from dropit_core.backends.triton import noise  # noqa: E402
from dropit_core.backends.triton.quant import quant_pack, quant_rebuild  # noqa: E402
from dropit_core.backends.triton.relu import relu_mask, relu_mask_grad  # noqa: E402

# (group, n): the default group with a last partial group, a group not a power of two, a group
# of one byte of 2-bit codes with an odd n (a last byte's unused codes), fewer values than a group.
SIZES = [(256, 3000), (100, 1001), (8, 77), (256, 5)]


@pytest.fixture
def mode():
    """Set the dispatch mode for one test, and restore the environment's after it."""
    yield lambda mode: configure(kernels=mode)
    reset_settings()


def _x(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) * 4).to(dtype).to(DEVICE)


def _pack_both(x: torch.Tensor, bits: int, group: int, key: int, mode):
    strategy = build_strategy("quant", 0.8, bits=bits, group=group)
    mode("eager")
    eager = strategy.pack(x, "linear", key)
    mode("triton")
    kernel = strategy.pack(x, "linear", key)
    return strategy, eager, kernel


# ------------------------------------------------------------------------------------ noise


def test_the_interpreter_is_in_force_for_triton_itself() -> None:
    # Triton's standard library (tl.min, ...) is defined when triton is imported: if that came
    # before TRITON_INTERPRET=1 (tests/conftest.py), every kernel here fails to run on the CPU.
    if INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(triton.language.standard.max, InterpretedFunction)


@triton.jit
def _uniform_kernel(index_ptr, out_ptr, n, key_low, key_high, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    index = tl.load(index_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + i, noise.uniform(key_low, key_high, index), mask=i < n)


@pytest.mark.parametrize("seed", [0, 12345, (1 << 62) - 1])
@pytest.mark.parametrize("start", [0, 4000, (1 << 32) - 300, (1 << 44) - 600])
def test_kernel_noise_is_the_eager_hash(seed: int, start: int) -> None:
    # Across 2**32 too: the index words wrap there.
    assert (noise.MIX_MUL1.value, noise.MIX_MUL2.value) == (seeds.MIX_MUL1, seeds.MIX_MUL2)
    eager = seeds.hash_uniform(seed, start, 600, DEVICE)
    index = torch.arange(start, start + 600, dtype=torch.int64, device=DEVICE)
    out = torch.empty(600, dtype=torch.float32, device=DEVICE)
    _uniform_kernel[(3,)](index, out, 600, *seeds.hash_keys(seed), BLOCK=256)
    assert torch.equal(out, eager)
    assert 0.0 <= float(eager.min()) and float(eager.max()) < 1.0
    assert torch.equal(eager * 2**24, (eager * 2**24).floor())  # 24-bit: exact in fp32


def test_eager_noise_is_a_function_of_the_element_index() -> None:
    whole = seeds.hash_uniform(7, 0, 1000, torch.device("cpu"))
    assert torch.equal(seeds.hash_uniform(7, 333, 100, torch.device("cpu")), whole[333:433])
    assert not torch.equal(seeds.hash_uniform(8, 0, 1000, torch.device("cpu")), whole)
    assert abs(float(whole.mean()) - 0.5) < 0.05
    assert seeds.mix32(0) == 0 and seeds.mix32(1) != 1  # salted keys keep index 0 off mix32(0)


# ------------------------------------------------------------------------------------- quant


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group,n", SIZES)
def test_quant_pack_and_rebuild_are_the_eager_ones_bit_for_bit(dtype, bits, group, n, mode):
    x = _x(n, dtype)
    strategy, eager, kernel = _pack_both(x, bits, group, 11, mode)
    for field in ("values", "mins", "scales"):
        assert same_bits(getattr(kernel, field), getattr(eager, field)), field
    # The same bytes rebuilt by either path; a kernel pack rebuilt eagerly and vice versa.
    mode("triton")
    by_kernel = strategy.unpack(eager)
    mode("eager")
    by_eager = strategy.unpack(eager)
    assert by_kernel.dtype == dtype and same_bits(by_kernel, by_eager)
    assert same_bits(strategy.unpack(kernel), by_eager)
    if (n * bits) % 8:  # the last byte's unused codes are zero
        assert int(kernel.values[-1]) >> ((n * bits) % 8) == 0


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("path", ["triton", "eager", "auto"])
@pytest.mark.parametrize("bits,group", [(4, 256), (2, 100)])
def test_a_part_of_a_quant_pack_rebuilds_as_that_part_of_the_whole(dtype, path, bits, group, mode):
    # What a conv's backward rebuilds a chunk of images at a time (ops._rebuilt_images);
    # "auto" on the CPU: the C loops where they are built
    x = _x(3000, dtype)  # the last group partial
    strategy = build_strategy("quant", 0.8, bits=bits, group=group)
    mode(path)
    packed = strategy.pack(x, "linear", 5)
    whole = strategy.unpack(packed).reshape(-1)
    for start, stop in [(0, 3000), (group, 4 * group), (2 * group, 3000), (0, 0)]:
        part = strategy.unpack_part(packed, start, stop)
        assert part.dtype == dtype and same_bits(part, whole[start:stop]), (start, stop)
    assert strategy.unpack_part(packed, group // 2, 3000) is None  # not on a group
    norm = build_strategy("quant", 0.8, bits=bits, group=group, rescale="norm")
    assert norm.unpack_part(norm.pack(x, "linear", 5), 0, group) is None


def _through_cast_values(n: int) -> torch.Tensor:
    """fp32 values that a cast to fp16 or bf16 rounds: random ones, and ties between two bf16
    and two fp16 neighbours (rounded half to even)."""
    x = _x(n, torch.float32, seed=7) * 3
    x[:4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11])
    return x


@pytest.mark.parametrize("cast", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,group,n", [(4, 256, 3000), (2, 100, 1001)])
def test_quant_pack_through_a_cast_is_the_pack_of_the_cast(cast, bits, group, n, mode) -> None:
    # Under autocast a layer packs its fp32 input as the cast it ran on, without the copy.
    x = _through_cast_values(n)
    strategy = build_strategy("quant", 0.8, bits=bits, group=group)
    for path in ("eager", "triton"):
        mode(path)
        through = strategy.pack(x, "linear", 12, cast)
        of_cast = strategy.pack(x.to(cast), "linear", 12)
        assert through.meta == of_cast.meta and through.meta.dtype == cast
        for field in ("values", "mins", "scales"):
            assert same_bits(getattr(through, field), getattr(of_cast, field)), (path, field)


def test_kernel_quant_pack_allocates_its_pack_and_nothing_else(mode) -> None:
    if DEVICE.type != "cpu":
        pytest.skip("counts the CPU allocator")
    from tests.core.allocations import allocations

    x = _x(3000, torch.float32)
    strategy = build_strategy("quant", 0.8, bits=4)
    mode("triton")
    for cast in (None, torch.bfloat16):
        packed, made = allocations(lambda c=cast: strategy.pack(x, "linear", 3, c))
        assert made.alive == packed.nbytes()
        assert made.allocated - packed.nbytes() <= 16  # a few bytes of launch bookkeeping


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quant_pack_bytes_do_not_depend_on_the_block_size(bits: int) -> None:
    x = _x(5000, torch.float32, seed=3)
    first = quant_pack(x, bits, 64, seed=99, block=64)
    for block in (256, 1024, 8192):
        again = quant_pack(x, bits, 64, seed=99, block=block)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), block
        out = quant_rebuild(*again, 5000, bits, 64, torch.float32, block=block)
        assert torch.equal(out, quant_rebuild(*first, 5000, bits, 64, torch.float32, block=64))
    assert not torch.equal(quant_pack(x, bits, 64, seed=100)[0], first[0])


@pytest.mark.parametrize("bits", [2, 4])
def test_mean_of_kernel_rebuilds_over_draws_is_the_input(bits: int, mode) -> None:
    x = _activation((1, 4, 12, 12)).to(DEVICE)  # 576 values, 55% zeros, several scales
    strategy = build_strategy("quant", 0.8, bits=bits, group=64)
    mode("triton")
    draws = torch.stack([strategy.unpack(strategy.pack(x, "conv", key)) for key in range(128)])
    t, sd = _error_in_noise_units(draws.cpu(), x.cpu())
    assert sd > 0 and t <= 1.0 + 4.0 * sd, (t, sd)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_every_code_value_rebuilds_as_min_plus_code_steps(bits: int) -> None:
    levels = (1 << bits) - 1
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE).repeat(2)  # every byte value
    n = codes.numel() * 8 // bits
    group = 64
    mins = torch.linspace(-3, 2, n // group, device=DEVICE)
    scales = torch.linspace(0.01, 0.5, n // group, device=DEVICE)
    out = quant_rebuild(codes, mins, scales, n, bits, group, torch.float32)
    code = unpack_codes(codes, bits, n).float().view(-1, group)
    expected = (code * scales[:, None] + mins[:, None]).view(-1)
    assert torch.equal(out, expected)
    assert set(unpack_codes(codes, bits, n).tolist()) == set(range(levels + 1))


@pytest.mark.parametrize("dtype", FLOATS)
def test_constant_and_all_zero_groups_rebuild_exactly(dtype, mode) -> None:
    x = _x(1024, dtype)
    x[:256] = 0.0
    x[256:512] = 0.75
    x[512:768] = -1.5
    strategy = build_strategy("quant", 0.8, bits=2, group=256)
    mode("triton")
    out = strategy.unpack(strategy.pack(x, "linear", 4))
    assert torch.equal(out[:768], x[:768])


def test_empty_input_and_settings_the_kernels_leave_to_eager(mode) -> None:
    mode("triton")
    strategy = build_strategy("quant", 0.8)
    packed = strategy.pack(torch.zeros(0, 3, 4, 4, device=DEVICE), "conv")
    assert packed.nbytes() == 0 and strategy.unpack(packed).shape == (0, 3, 4, 4)
    # Codes of a 7-value group straddle bytes: eager packs it, in the same format.
    assert not quant_kernels_take(4, 7) and quant_kernels_take(4, 256)
    odd = build_strategy("quant", 0.8, bits=4, group=7)
    x = _x(100, torch.float32)
    mode("eager")
    eager = odd.pack(x, "linear", 2)
    mode("triton")
    kernel = odd.pack(x, "linear", 2).stored()
    assert all(torch.equal(a, b) for a, b in zip(kernel, eager.stored(), strict=True))


def test_quant_layers_train_the_same_on_either_path(mode) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).to(DEVICE)
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = {}
    for path in ("eager", "triton"):
        model = copy.deepcopy(plain)
        to_dropit(model, strategy="quant", bits=4, group=64)
        mode(path)
        set_step(model, 5)
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            model(x).square().sum().backward()  # the same packs give the same gradients
        grads[path] = [p.grad for p in model.parameters()]
    for a, b in zip(grads["eager"], grads["triton"], strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------- quant with zeros and signs (saved)


def _signed_values(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Values with exact zeros of both signs, negatives, and magnitudes far below a group's
    step (their codes rebuild near 0, so only the flags keep their signs)."""
    x = _x(n, dtype, seed=5)
    x[::7] = 0.0
    x[3::11] = -0.0
    x[5::13] = (x[5::13].sign() * 1e-30).to(dtype)  # fp16 and bf16 round some to zero
    return x


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bits,group,n", [(4, 256, 3000), (2, 8, 77), (8, 16, 1001), (4, 256, 5)])
def test_signed_pack_is_the_pack_and_pack_bits_of_the_flags_in_one_launch(
    dtype, bits, group, n, mode
) -> None:
    from dropit_core.formats.bits import pack_bits

    x = _signed_values(n, dtype)
    strategy = build_strategy("quant", 0.8, bits=bits, group=group)
    mode("triton")
    packed, zero, negative = pack_signed(strategy, x, 21)
    plain = strategy.pack(x, "linear", 21)
    for field in ("values", "mins", "scales"):
        assert same_bits(getattr(packed, field), getattr(plain, field)), field
    assert packed.meta == plain.meta
    assert torch.equal(zero, pack_bits(x == 0)) and torch.equal(negative, pack_bits(x < 0))
    mode("eager")
    eager = pack_signed(strategy, x, 21)
    assert all(same_bits(a, b) for a, b in zip(eager[1:], (zero, negative), strict=True))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bits,group,n", [(4, 256, 3000), (2, 8, 77), (8, 16, 1001)])
def test_signed_rebuild_is_the_eager_one_with_the_originals_zeros_and_signs(
    dtype, bits, group, n, mode
) -> None:
    x = _signed_values(n, dtype)
    strategy = build_strategy("quant", 0.8, bits=bits, group=group)
    mode("eager")
    packed, zero, negative = pack_signed(strategy, x, 8)
    eager = unpack_signed(strategy, packed, zero, negative)
    mode("triton")
    kernel = unpack_signed(strategy, packed, zero, negative)
    assert kernel.dtype == dtype and same_bits(kernel, eager)
    # Zero (+0.0) exactly where the original is zero, and the original's sign elsewhere.
    assert torch.equal(kernel == 0, x == 0) and torch.equal(kernel < 0, x < 0)
    assert not kernel[x == 0].signbit().any()


def test_signed_pack_and_rebuild_allocate_their_outputs_and_nothing_else(mode) -> None:
    if DEVICE.type != "cpu":
        pytest.skip("counts the CPU allocator")
    from tests.core.allocations import allocations

    x = _signed_values(3000, torch.float32)
    strategy = build_strategy("quant", 0.8, bits=4)
    mode("triton")
    signed, made = allocations(lambda: pack_signed(strategy, x, 3))
    kept = signed[0].nbytes() + signed[1].nbytes + signed[2].nbytes
    assert made.alive == kept and made.allocated - kept <= 16  # no bool temporaries
    out, made = allocations(lambda: unpack_signed(strategy, *signed))
    assert made.alive == out.nbytes and made.allocated - out.nbytes <= 16


def test_signed_kernels_leave_groups_of_part_bytes_to_the_eager_flags(mode) -> None:
    from dropit_core.backends.triton.quant import quant_pack_signed

    x = _signed_values(300, torch.float32)
    with pytest.raises(ValueError, match="group 100 is not whole bytes of flags"):
        quant_pack_signed(x, 4, 100, 1)
    strategy = build_strategy("quant", 0.8, bits=4, group=100)
    mode("triton")
    packed, zero, negative = pack_signed(strategy, x, 3)  # codes by the kernel, flags eager
    out = unpack_signed(strategy, packed, zero, negative)
    assert torch.equal(out == 0, x == 0) and torch.equal(out < 0, x < 0)


def test_compress_saved_gives_the_same_gradients_on_either_path(mode) -> None:
    from dropit_core.saved import CompressSaved

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
    ).to(DEVICE)  # fmt: skip
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads, packs = {}, {}
    for path in ("eager", "triton"):
        mode(path)
        model.zero_grad(set_to_none=True)
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            with CompressSaved(bits=4, group=64, min_bytes=1024, step=3) as saved:
                out = model(x)
            out.square().sum().backward()
        grads[path] = [p.grad.clone() for p in model.parameters()]
        packs[path] = (saved.packs, saved.packed_bytes)
    assert packs["eager"] == packs["triton"] and packs["eager"][0] >= 3
    for a, b in zip(grads["eager"], grads["triton"], strict=True):
        assert torch.equal(a, b)


# -------------------------------------------------------------------------------------- ReLU


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 13, 4101])
@pytest.mark.parametrize("inplace", [False, True])
def test_relu_mask_kernels_are_the_eager_relu(dtype, n: int, inplace: bool, mode) -> None:
    x = _x(n, dtype, seed=n)
    if n > 8:  # signed zeros and NaN keep their bits, -inf is blocked
        x[:4] = torch.tensor([0.0, -0.0, float("nan"), float("-inf")])
    grad = _x(n, dtype, seed=n + 1)
    grad[-1] = float("nan")
    results = {}
    for path in ("eager", "triton"):
        mode(path)
        leaf = x.clone().requires_grad_(True)
        out = MaskedReLUFunction.apply(leaf * 1.0, inplace)
        out.backward(grad)
        results[path] = (out.detach(), leaf.grad)
    for a, b in zip(results["eager"], results["triton"], strict=True):
        assert same_bits(a, b)


def test_relu_mask_bytes_are_pack_bits_of_the_blocked_outputs() -> None:
    from dropit_core.formats.bits import pack_bits

    x = _x(1003, torch.float32)
    out, bits = relu_mask(x)
    assert torch.equal(bits, pack_bits((torch.relu(x) <= 0).reshape(-1)))
    assert torch.equal(out, torch.relu(x))
    assert torch.equal(relu_mask_grad(x, bits), torch.where(x <= 0, 0.0, x))


# ---------------------------------------------------------------------------------- dispatch


def _kernels_take(t) -> bool:
    """Whether dispatch gives a tensor on ``t``'s device the Triton kernels."""
    return dispatch.choose("quant_rebuild", t) == "triton"


def test_dispatch_modes_env_and_warning(monkeypatch) -> None:
    cpu = SimpleNamespace(is_cuda=False, device=torch.device("cpu"))
    cuda = SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
    monkeypatch.setenv(dispatch.ENV, "auto")
    reset_settings()
    assert not _kernels_take(cpu)
    assert _kernels_take(cuda) == dispatch.triton_available()
    # Read once: a change takes effect from reset_settings() on (which re-reads it).
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert not _kernels_take(cpu)
    reset_settings()
    assert _kernels_take(cpu)
    configure(kernels="eager")  # the call wins over the environment
    try:
        assert not _kernels_take(cuda)
    finally:
        reset_settings()
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(ValueError, match="DROPIT_KERNELS"):
        reset_settings()
    with pytest.raises(ValueError, match="allowed"):
        configure(kernels="cuda")
    # CUDA without triton: one warning, then eager.
    monkeypatch.setenv(dispatch.ENV, "auto")
    reset_settings()
    monkeypatch.setattr(dispatch, "_has_triton", False)
    monkeypatch.setattr(dispatch, "_warned", False)
    with pytest.warns(RuntimeWarning, match="triton is not installed"):
        assert not _kernels_take(cuda)
    assert not _kernels_take(cuda)  # no second warning (pytest errors on none above)


def test_eager_kernels_mean_eager_everywhere(monkeypatch) -> None:
    # DROPIT_KERNELS=eager turns off the C loops too: plain torch on every device
    monkeypatch.setenv(dispatch.ENV, "eager")
    reset_settings()
    try:
        assert not current_settings().loops
        assert dispatch.choose("quant_rebuild", torch.empty(0)) == "eager"  # a CPU op: eager too
        assert not _kernels_take(SimpleNamespace(is_cuda=True, device=torch.device("cuda")))
    finally:
        monkeypatch.delenv(dispatch.ENV)
        reset_settings()
    assert current_settings().loops


def test_one_table_chooses_each_ops_backend_by_device_dtype_setting_and_settings() -> None:
    """dispatch.TABLE and choose: what runs each op, from (op, tensor, the op's setting, the
    settings); every strategy and layer asks it, none decides alone."""
    from dropit_core.backends.dispatch import quant_backends as fast_backends

    assert fast_backends(4, 256) == ("triton", "native")
    assert fast_backends(4, 16384) == ("native",)  # beyond a program's registers
    assert fast_backends(4, 7) == ()  # codes straddle bytes: eager only
    x, half, ints = torch.randn(64), torch.randn(64).half(), torch.arange(64)
    gpu = torch.device("cuda")
    cuda = SimpleNamespace(is_cuda=True, device=gpu, dtype=torch.float32)
    cuda_ints = SimpleNamespace(is_cuda=True, device=gpu, dtype=torch.int64)
    cuda_fp8 = SimpleNamespace(is_cuda=True, device=gpu, dtype=torch.float8_e4m3fn)
    loops = "native" if native.library() is not None else "eager"
    with override_settings(kernels="auto", native=True):
        for op, ways in dispatch.TABLE.items():
            want = loops if "native" in ways else "eager"
            assert dispatch.choose(op, x) == want, op
            assert dispatch.choose(op, x, ()) == "eager", op  # the setting allows none
            assert dispatch.choose(op, cuda) == "triton", op
        assert dispatch.choose("quant_pack", half) == "eager"  # the loops read fp32
        assert dispatch.choose("quant_pack", x.view(8, 8).t()) == "eager"  # and contiguous
        assert dispatch.choose("quant_rebuild", x, ("native",)) == loops
        assert dispatch.choose("quant_pack", cuda, ("native",)) == "eager"
        assert dispatch.choose("relu_mask", cuda_ints) == "eager"
        assert dispatch.choose("relu_mask", cuda_fp8) == "eager"  # a float the kernel lacks
        assert dispatch.pack_backend("cpu") == loops
    with override_settings(kernels="auto", native=False):
        assert dispatch.choose("quant_pack", x) == "eager"
    with override_settings(kernels="triton"):
        assert dispatch.choose("quant_pack", x) == "triton"  # forced: CPU tensors too
        assert dispatch.choose("quant_pack", x, ("native",)) == "eager"
        assert dispatch.choose("relu_mask", ints) == "eager"  # the kernel takes floats
        assert dispatch.pack_backend("cpu") == "triton"
    with override_settings(kernels="eager"):
        assert {dispatch.choose(op, t) for op in dispatch.TABLE for t in (x, cuda)} == {"eager"}


def test_only_the_triton_backend_imports_triton() -> None:
    # dropit_core must import where triton is missing: triton appears in backends/triton/ alone.
    package = Path(dispatch.__file__).parents[1]
    kernels = package / "backends" / "triton"
    assert sorted(p.name for p in kernels.glob("*.py") if "import triton" in p.read_text())
    for path in package.rglob("*.py"):
        if kernels not in path.parents:
            assert "import triton" not in path.read_text(), path


def test_launch_arithmetic_is_tritons_in_plain_python() -> None:
    from dropit_core.backends.triton import launch

    for n in range(1, 5000):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for per in (1, 7, 256, 2048):
            assert launch.cdiv(n, per) == triton.cdiv(n, per)
    assert launch.cdiv(0, 256) == 0 and launch.tile(100, 2048) == (128, 16)
    assert launch.tile(8192, 2048) == (8192, 1)  # a group wider than a block: one per program


@pytest.mark.parametrize("cast", [None, torch.bfloat16])
def test_a_pack_reading_its_keys_from_memory_is_the_seeded_pack(cast) -> None:
    """A CUDA graph's pack reads its draw's hash keys from device memory (``keys``): the same
    bytes as the pack seeded by those keys' seed, and other keys written into the same tensor
    give that other seed's pack: the draw is data, not a constant of the launch."""
    from dropit_core.backends.triton.quant import pack_contiguous

    x = _x(3000, torch.float32)
    keys = torch.tensor([*seeds.hash_keys(12345), 0], dtype=torch.int64, device=DEVICE)
    for seed in (12345, 777):
        keys.copy_(torch.tensor([*seeds.hash_keys(seed), 0]))
        keyed = pack_contiguous(x, 4, 256, keys, cast)[:3]
        seeded = pack_contiguous(x, 4, 256, seeds.hash_keys(seed), cast)[:3]
        assert all(map(torch.equal, keyed, seeded))
    assert not torch.equal(keyed[0], pack_contiguous(x, 4, 256, seeds.hash_keys(12345), cast)[0])


@pytest.mark.parametrize("kernels", ["triton", "eager"])
def test_quants_keyed_pack_is_its_pack_with_those_keys(mode, kernels: str) -> None:
    """``Quant.pack_keyed`` (what the traced pack runs) is ``Quant.pack`` of the key whose hash
    keys it is given, on the kernels and off them (the C loops or the reference)."""
    mode(kernels)
    quant = build_strategy("quant", 0.8, bits=4, seed=3)
    x = _x(2000, torch.float32)
    for key in (5, 6):
        keys = torch.tensor([*quant.draw_keys(key), 0], dtype=torch.int64, device=DEVICE)
        a, b = quant.pack_keyed(x, keys, torch.float32), quant.pack(x, "linear", key)
        fields = [(a.values, b.values), (a.scales, b.scales), (a.mins, b.mins)]
        assert all(torch.equal(u, v) for u, v in fields) and a.meta == b.meta

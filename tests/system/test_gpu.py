"""GPU tier: the CUDA paths of the ops, AMP, CUDA memory, NCCL and a training run.

Every test here needs a CUDA GPU and is skipped without one (CI has none); run them with
`make test-gpu` on a machine that has one. They assert the same contracts as the CPU tiers: the
forward bit-identical, input and bias gradients exact, the kept set the same as on CPU, activation
memory really freed (now read from the CUDA allocator), and a job that trains, evaluates and
resumes.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dropit_core import REGISTRY, STRATEGIES, build_strategy, dropped_values, to_dropit
from rcnn_dropit.metrics_file import read_metrics
from tests.helpers import MASK_DROPIT_CFG, TRAIN_PY, job_env, single_node, tiny_opts, torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda", 0)
# Strategies whose kept set depends only on the values: the same on CPU and CUDA. Those that
# draw (random, channel_random, importance, quant) are checked on CUDA alone.
DETERMINISTIC = tuple(s for s in STRATEGIES if not REGISTRY.get(s).draws)


@pytest.fixture(autouse=True)
def exact_cuda_math():
    """Full-precision, deterministic cuDNN/cuBLAS: TF32 would change results at 1e-3."""
    saved = (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    yield
    (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    ) = saved


class ConvNet(nn.Module):
    """conv-ReLU blocks and a linear head: the layer pattern of a ResNet stage and a box head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 1),
            nn.ReLU(),
        )
        self.fc = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.convs(x).mean(dim=(2, 3)))


def _net(seed: int = 0, width: int = 32) -> ConvNet:
    torch.manual_seed(seed)
    return ConvNet(width)


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Output, input gradient and parameter gradients of one forward/backward."""
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    out = model(x)
    grad_out = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype)
    out.backward(grad_out.view_as(out))
    return out.detach(), x.grad, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _input(device: torch.device, shape=(2, 3, 24, 24)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(device)


@pytest.mark.parametrize("strategy", DETERMINISTIC)
def test_deterministic_strategies_match_cpu_on_cuda(strategy: str) -> None:
    cpu = _net()
    to_dropit(cpu, strategy=strategy, gamma=0.8)
    gpu = copy.deepcopy(cpu).to(CUDA)
    out_c, gx_c, g_c = _grads(cpu, _input(torch.device("cpu")))
    out_g, gx_g, g_g = _grads(gpu, _input(CUDA))
    torch.testing.assert_close(out_g.cpu(), out_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_g.cpu(), gx_c, rtol=1e-5, atol=1e-6)
    for name, grad in g_c.items():  # the same kept set: weight gradients agree to rounding
        torch.testing.assert_close(g_g[name].cpu(), grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("values", ["same", "int8", "int4"])
def test_forward_and_input_gradient_are_the_plain_layers_on_cuda(strategy: str, values) -> None:
    if values != "same" and "values" not in REGISTRY.options(strategy):
        pytest.skip(f"{strategy} stores codes of its own: no values option")
    plain = _net().to(CUDA)
    dropit = copy.deepcopy(plain)
    # Only strategies that store kept values take `values` (quant stores codes of its own).
    options = {"values": values} if "values" in REGISTRY.options(strategy) else {}
    to_dropit(dropit, strategy=strategy, gamma=0.8, **options)
    out_p, gx_p, g_p = _grads(plain, _input(CUDA))
    out_d, gx_d, g_d = _grads(dropit, _input(CUDA))
    assert torch.equal(out_d, out_p)
    torch.testing.assert_close(gx_d, gx_p, rtol=1e-5, atol=1e-6)
    for name in ("convs.0.bias", "convs.2.bias", "convs.4.bias", "fc.bias"):
        torch.testing.assert_close(g_d[name], g_p[name], rtol=1e-5, atol=1e-6, msg=name)
    for name, grad in g_d.items():  # dropped inputs change weight gradients, but not wildly
        cos = F.cosine_similarity(grad.flatten(), g_p[name].flatten(), dim=0)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        if strategy in DETERMINISTIC:  # random keeps of a 64-value fc input are too noisy
            assert cos > 0.3, (name, float(cos))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quant_packs_the_same_bytes_on_cpu_and_cuda(dtype: torch.dtype) -> None:
    # The rounding noise is a hash of (seed, element index): the CPU pack (eager or compiled)
    # and the CUDA one (the Triton kernel where triton imports) agree bit for bit.
    x = _input(torch.device("cpu"), (2, 16, 48, 48)).relu().to(dtype)
    strategy = build_strategy("quant", 0.8, bits=4, seed=3)
    cpu, cuda = strategy.pack(x, "conv", 7), strategy.pack(x.to(CUDA), "conv", 7)
    for a, b in zip(cpu.stored(), cuda.stored(), strict=True):
        assert torch.equal(a, b.cpu())
    assert torch.equal(strategy.unpack(cuda).cpu(), strategy.unpack(cpu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "strategy,options",
    [("mink", {}), ("threshold", {}), ("importance", {"seed": 3}), ("random", {"scale": True})],
)
def test_elementwise_packs_the_same_bytes_on_cpu_and_cuda(monkeypatch, dtype, strategy, options):
    # The CPU's fixed-capacity pack (eager torch) and the CUDA one (the Triton compaction where
    # triton imports): the same kept set, slots, mask and draws (a hash of the element index).
    from dropit_core.strategies import elementwise

    monkeypatch.setattr(elementwise, "fixed_capacity", lambda device: True)
    x = _input(torch.device("cpu"), (2, 16, 48, 48)).relu().to(dtype)
    s = build_strategy(strategy, 0.8, **options)
    cpu, cuda = s.pack(x, "conv", 7), s.pack(x.to(CUDA), "conv", 7)
    for a, b in zip(cpu.stored(), cuda.stored(), strict=True):
        assert torch.equal(a, b.cpu())
    assert torch.equal(s.unpack(cuda).cpu(), s.unpack(cpu))


@pytest.mark.parametrize("amp", [None, torch.float16])
@pytest.mark.parametrize(
    "strategy,options",
    [
        ("quant", {"bits": 4}),
        ("mink", {}),
        ("mink", {"positions": "sparse_bits", "values": "int8"}),
        ("parallel_mink", {"chunk": 4096}),
        ("threshold", {}),
        ("importance", {}),
        ("random", {"scale": True}),
    ],
)
def test_packs_and_relu_mask_add_no_host_sync(amp: torch.dtype | None, strategy, options) -> None:
    # quant's Triton pack and rebuild, the element-wise packs sized from the shape (radix select,
    # nonzero_static, device-side offsets) and the ReLU mask kernels: no .item(), nonzero or size
    # read of a device value anywhere in a converted conv + ReLU stack's forward and backward.
    model = nn.Sequential(*_net().convs).to(CUDA)
    to_dropit(model, strategy=strategy, gamma=0.8, **options)
    # 54Ki, 576Ki and 144Ki values into the convs: mink radix-selects in the two larger.
    x = _input(CUDA, (2, 3, 96, 96)).requires_grad_(True)

    def step() -> None:
        with torch.autocast("cuda", dtype=amp or torch.float16, enabled=amp is not None):
            out = model(x)
        out.backward(torch.ones_like(out))

    step()  # the first step compiles the kernels and builds lookup tables (and may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert dropped_values(model) == 0  # every capacity held its pack's values


@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16])
def test_autocast_forward_is_bit_identical_and_gradients_finite(amp: torch.dtype) -> None:
    plain = _net().to(CUDA)
    dropit = copy.deepcopy(plain)
    to_dropit(dropit, strategy="mink", gamma=0.8)
    with torch.autocast("cuda", dtype=amp):
        out_p, gx_p, _ = _grads(plain, _input(CUDA))
        out_d, gx_d, g_d = _grads(dropit, _input(CUDA))
    assert out_d.dtype == amp and torch.equal(out_d, out_p)
    torch.testing.assert_close(gx_d, gx_p, rtol=1e-2, atol=1e-3)
    assert all(torch.isfinite(g).all() for g in g_d.values())
    assert all(p.dtype == torch.float32 for p in dropit.parameters())  # master weights stay fp32


def _live_after_forward_mb(model: nn.Module, x: torch.Tensor) -> float:
    """CUDA memory the forward leaves for the backward (the graph's saved tensors)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    out = model(x)
    torch.cuda.synchronize()
    live = (torch.cuda.memory_allocated(CUDA) - before) / 2**20
    out.sum().backward()
    return live


def test_cuda_memory_after_the_forward_is_really_freed() -> None:
    # Wide enough that the saved activations dwarf the allocator's rounding.
    plain = _net(width=64).to(CUDA)
    dropit = copy.deepcopy(plain)
    to_dropit(dropit, strategy="mink", gamma=0.8)
    x = _input(CUDA, (16, 3, 128, 128))
    base = _live_after_forward_mb(plain, x)
    kept = _live_after_forward_mb(dropit, x)
    # Kept values (20%) + 1 bit per element for each cache and ReLU, against 32 bits per
    # element per conv input and ReLU output: well under half even with the fp32 output.
    assert base > 50 and kept < 0.4 * base, (base, kept)


def test_ddp_over_nccl_averages_dropit_gradients() -> None:
    """One-rank NCCL group: DDP's bucketed all-reduce over DropIT layers gives the plain grads."""
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=CUDA)
    try:
        model = _net().to(CUDA)
        to_dropit(model, strategy="mink", gamma=0.8)
        single = copy.deepcopy(model)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
        _, _, g_ddp = _grads(ddp, _input(CUDA))
        _, _, g_one = _grads(single, _input(CUDA))
        for name, grad in g_one.items():
            torch.testing.assert_close(g_ddp[f"module.{name}"], grad, msg=name)
    finally:
        dist.destroy_process_group()


def _train(
    run: Path, root: Path, *extra: str, resume: bool = False, launch: list[str] | None = None
):
    """tools/train.py (or torchrun over it) for 6 steps of the shapes Mask R-CNN on cuda."""
    opts = tiny_opts(root, "train.device=cuda", "solver.max_iters=6", *extra)
    args = ["--config", str(MASK_DROPIT_CFG), "--output-dir", str(run), "--opts", *opts]
    args += ["--resume", "auto"] if resume else []
    cmd = torchrun(launch, TRAIN_PY, args) if launch else [sys.executable, str(TRAIN_PY), *args]
    env = job_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_mask_rcnn_trains_evaluates_and_resumes_on_cuda(tmp_path, amp: str) -> None:
    root = tmp_path / "shapes"
    run = tmp_path / "run"
    _train(run, root, f"solver.amp={amp}", "train.checkpoint_every_iters=3", "train.keep_last=2")
    records = [r for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"]
    assert [r["iter"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in records)
    final = json.loads((run / "eval.json").read_text())
    assert final["iter"] == 6 and {"bbox", "segm"} <= set(final)
    # Resume from the checkpoint at 3: the same iterations again, appended once each.
    (run / "checkpoints/model_0000006.pth").unlink()
    _train(run, root, f"solver.amp={amp}", "train.checkpoint_every_iters=3", resume=True)
    again = [r for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"]
    assert [r["iter"] for r in again] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_torchrun_on_one_gpu_trains_and_evaluates(tmp_path) -> None:
    run = tmp_path / "run"
    done = _train(run, tmp_path / "shapes", "solver.amp=fp16", launch=single_node(1))
    assert json.loads((run / "eval.json").read_text())["iter"] == 6, done.stdout[-2000:]

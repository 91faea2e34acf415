"""Random draws seeded per step and layer (set_step): equal models draw equally, steps differ,
and a resumed run draws bit for bit what the uninterrupted one drew."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dropit_core import REGISTRY, STRATEGIES, build_strategy, set_step, to_dropit

DRAWING = [name for name in STRATEGIES if REGISTRY.get(name).draws]


class Net(nn.Module):
    """One input feeding two convs (one shared pack), then a conv and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 8, 1)
        self.relu = nn.ReLU()
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.a(x) + self.b(x))
        h = self.relu(self.c(h))
        return self.fc(h.mean(dim=(2, 3)))


def _net(name: str, gamma: float = 0.8) -> Net:
    torch.manual_seed(0)
    model = Net()
    options = {"seed": 7} if "seed" in REGISTRY.options(name) else {}
    to_dropit(model, strategy=name, gamma=gamma, **options)
    return model


def _input(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(seed))


def _record(model: Net) -> list:
    """The packs the model's shared cache makes from now on, in order."""
    strategy = model.a.dropit_cache.strategy
    real, seen = strategy.pack, []
    strategy.pack = lambda x, layout, key=0: seen.append(real(x, layout, key)) or seen[-1]
    return seen


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _same_packs(first: list, second: list) -> bool:
    """Whether two lists of packs hold equal metadata (mask seeds included) and tensors."""
    assert len(first) == len(second)
    for p, q in zip(first, second, strict=True):
        if p.meta != q.meta:
            return False
        for a, b in zip(p[1:], q[1:], strict=True):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                return False
    return True


@pytest.mark.parametrize("name", DRAWING)
def test_two_equal_models_at_the_same_step_draw_the_same_packs(name: str) -> None:
    first, second = _net(name), _net(name)
    packs_1, packs_2 = _record(first), _record(second)
    set_step(first, 5)
    set_step(second, 5)
    g1, g2 = _grads(first, _input()), _grads(second, _input())
    assert len(packs_1) == 3  # a and b share one pack; c; fc
    assert _same_packs(packs_1, packs_2)
    for key, grad in g1.items():
        assert torch.equal(grad, g2[key]), key


@pytest.mark.parametrize("name", DRAWING)
def test_another_step_or_rank_draws_other_packs(name: str) -> None:
    model = _net(name)
    packs = _record(model)
    runs = {}
    for step, rank in ((5, 0), (6, 0), (5, 1)):
        set_step(model, step, rank=rank)
        runs[step, rank] = _grads(model, _input())
    assert len(packs) == 9
    assert not _same_packs(packs[0:3], packs[3:6])  # another step
    assert not _same_packs(packs[0:3], packs[6:9])  # another rank
    assert not torch.equal(runs[5, 0]["c.weight"], runs[6, 0]["c.weight"])
    # The input gradient never depends on the draws: the bias gradients agree.
    assert torch.equal(runs[5, 0]["a.bias"], runs[6, 0]["a.bias"])


@pytest.mark.parametrize("name", DRAWING)
def test_layers_of_one_step_draw_differently(name: str) -> None:
    # Two convs fed equal-valued but distinct tensors pack twice, at two positions: two draws.
    model = _net(name)
    packs = _record(model)
    set_step(model, 3)
    x = _input()
    model.a(x.clone()).sum().backward()
    model.a(x.clone()).sum().backward()
    assert len(packs) == 2 and not _same_packs(packs[:1], packs[1:])


@pytest.mark.parametrize("name", DRAWING)
def test_the_same_input_tensor_at_another_step_packs_afresh(name: str) -> None:
    # Packs are shared within a step; a tensor that outlives a step (a fixed batch) must not
    # carry its pack, and its draw, into the next one.
    model = _net(name)
    packs = _record(model)
    x = _input()
    for step in (0, 1):
        set_step(model, step)
        model.a(x).sum().backward()
    assert len(packs) == 2 and not _same_packs(packs[:1], packs[1:])


@pytest.mark.parametrize("name", DRAWING)
def test_without_set_step_every_forward_draws_afresh(name: str) -> None:
    model = _net(name)
    packs = _record(model)
    _grads(model, _input())
    _grads(model, _input())
    assert model.a.dropit_cache.position == 6
    assert not _same_packs(packs[0:3], packs[3:6])


@pytest.mark.parametrize("name", DRAWING)
def test_a_resumed_run_draws_bit_for_bit_what_the_original_drew(name: str) -> None:
    # The original trains steps 0-3 and saves a checkpoint (weights and optimizer) after step 1;
    # a fresh process builds the model, loads the checkpoint and goes on at step 2.
    original = _net(name)
    opt = torch.optim.SGD(original.parameters(), lr=0.1, momentum=0.9)
    grads, saved = {}, None
    for step in range(4):
        set_step(original, step)
        grads[step] = _grads(original, _input(seed=10 + step))
        opt.step()
        if step == 1:
            saved = copy.deepcopy((original.state_dict(), opt.state_dict()))
    resumed = _net(name)
    resumed.load_state_dict(saved[0])
    opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(saved[1])
    for step in (2, 3):
        set_step(resumed, step)
        again = _grads(resumed, _input(seed=10 + step))
        opt.step()
        for key, grad in grads[step].items():
            assert torch.equal(again[key], grad), (step, key)
    for key, p in resumed.state_dict().items():
        assert torch.equal(p, original.state_dict()[key]), key


@pytest.mark.parametrize("name", DRAWING)
def test_the_shared_pack_is_one_draw_for_both_layers(name: str) -> None:
    model = _net(name)
    packs = _record(model)
    set_step(model, 2)
    x = _input()
    model.zero_grad(set_to_none=True)
    out = model.a(x) + model.b(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(g)
    assert len(packs) == 1
    x_hat = model.a.dropit_cache.unpack(packs[0])
    for layer, pad in ((model.a, 1), (model.b, 0)):
        w = layer.weight.detach().clone().requires_grad_(True)
        F.conv2d(x_hat, w, None, padding=pad).backward(g)
        torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", DRAWING)
def test_a_copy_goes_on_where_the_original_stands(name: str) -> None:
    model = _net(name)
    set_step(model, 4)
    _grads(model, _input())
    clone = copy.deepcopy(model)
    assert clone.a.dropit_cache.position == model.a.dropit_cache.position == 3
    g1, g2 = _grads(model, _input()), _grads(clone, _input())
    for key, grad in g1.items():
        assert torch.equal(grad, g2[key]), key


def test_set_step_leaves_deterministic_strategies_alone() -> None:
    model = _net("mink")
    set_step(model, 1)
    g1 = _grads(model, _input())
    set_step(model, 2, rank=3)
    g2 = _grads(model, _input())
    for key, grad in g1.items():
        assert torch.equal(grad, g2[key]), key
    assert model.a.dropit_cache.position == 0  # mink draws nothing: no keys taken


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"step": -1}, "step=-1 is invalid: allowed integers >= 0"),
        ({"step": "3"}, "step='3' is invalid"),
        ({"step": True}, "step=True is invalid"),
        ({"step": 1, "rank": -2}, "rank=-2 is invalid"),
    ],
)
def test_set_step_rejects_bad_values(kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        set_step(_net("random"), **kwargs)


def test_set_step_on_a_plain_model_does_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    set_step(model, 3)
    assert not hasattr(model[0], "dropit_cache")


def test_a_caches_keys_are_mix_seed_of_rank_stream_step_and_position() -> None:
    # The prefix (rank, stream, step) is folded once per step; the keys stay mix_seed's, also
    # after a copy (a checkpointed model) and for the quant packs' seeds.
    import pickle

    from dropit_core import build_strategy
    from dropit_core.formats.seeds import hash_keys, mix_seed, mix_state
    from dropit_core.layers.cache import InputCache

    assert mix_state(mix_state(0, 3, 4), 5) >> 2 == mix_seed(3, 4, 5)
    cache = InputCache(build_strategy("quant", 0.8), stream=7)
    assert [cache.next_key() for _ in range(2)] == [mix_seed(0, 7, 0, p) for p in range(2)]
    cache.set_step(11, rank=2)
    assert [cache.next_key() for _ in range(3)] == [mix_seed(2, 7, 11, p) for p in range(3)]
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.next_key() == cache.next_key() == mix_seed(2, 7, 11, 3)
    quant = build_strategy("quant", 0.8, seed=99)
    x = torch.randn(1000)
    codes, mins, scales = quant._pack_on_host(x, hash_keys(mix_seed(99, 5)), None, "eager")
    packed = quant.pack(x, "linear", 5)
    assert torch.equal(packed.values, codes) and torch.equal(packed.mins, mins)
    assert torch.equal(packed.scales, scales)


def test_keys_made_together_are_the_keys_made_one_by_one() -> None:
    """A cache makes its draw keys a block at a time on a tensor (InputCache._next_block), and
    quant derives the blocks' hash keys together (remember_draws): the same integers as the
    per-pack Python hash, across blocks and steps, and the same pack bytes."""
    import random

    from dropit_core import build_strategy
    from dropit_core.formats.seeds import _signed64, mix_part, mix_seed
    from dropit_core.layers.cache import KEY_BLOCK, InputCache

    rng = random.Random(0)
    parts = [rng.getrandbits(64) for _ in range(2000)] + [0, 1 << 63, (1 << 64) - 1]
    state = rng.getrandbits(64)
    mixed = mix_part(state, torch.tensor([_signed64(p) for p in parts])).tolist()
    assert [m % (1 << 64) for m in mixed] == [mix_part(state, p) for p in parts]
    quant = build_strategy("quant", 0.8, seed=5)
    cache = InputCache(quant, stream=3)
    for step in (0, 1):
        cache.set_step(step, rank=2)
        count = 3 * KEY_BLOCK + 5  # past two block boundaries
        keys = [cache.next_key() for _ in range(count)]
        assert keys == [mix_seed(2, 3, step, p) for p in range(count)]
        assert all(quant._hashed[k] == quant.draw_keys(k) for k in keys[-5:])
    x = torch.randn(3000)
    fresh = build_strategy("quant", 0.8, seed=5)
    a, b = quant.pack(x, "linear", keys[-1]), fresh.pack(x, "linear", keys[-1])
    assert not fresh._hashed and quant._hashed  # one looked its hash keys up, one hashed
    assert all(torch.equal(u, v) for u, v in zip(a.stored(), b.stored(), strict=True))


def test_a_caches_key_table_is_rewritten_in_place_each_step() -> None:
    """The traced pack's draws as device data (``InputCache.draw_row``): each row the hash keys
    of eager's key at that position; ``set_step`` writes the new step's into the same memory, so
    a graph that replays reads them (it runs no Python), and two steps draw differently."""
    from dropit_core.formats.seeds import mix_seed
    from dropit_core.layers.cache import InputCache

    quant = build_strategy("quant", 0.8, seed=4)
    cache = InputCache(quant, stream=2)
    cache.set_step(3, rank=1)
    rows = [cache.draw_row(torch.device("cpu")) for _ in range(3)]
    want = [quant.draw_keys(mix_seed(1, 2, 3, p)) for p in range(3)]
    assert [tuple(r.tolist()) for r in rows] == [(*k, 0) for k in want]
    table = cache.keys.table
    address, before = table.data_ptr(), table[:3].clone()
    cache.set_step(4, rank=1)
    assert cache.keys.table is table and table.data_ptr() == address  # the same memory
    want = [quant.draw_keys(mix_seed(1, 2, 4, p)) for p in range(3)]
    assert [tuple(r) for r in table[:3].tolist()] == [(*k, 0) for k in want]
    assert not torch.equal(table[:3], before)
    # a forward that draws past the rows the last one read: those rows are this step's too
    rows = [cache.draw_row(torch.device("cpu")) for _ in range(5)]
    want = [quant.draw_keys(mix_seed(1, 2, 4, p)) for p in range(5)]
    assert [tuple(r.tolist()) for r in rows] == [(*k, 0) for k in want]

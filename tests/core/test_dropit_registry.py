"""The strategy registry: one declaration per strategy gives validation, config choices, docs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dropit_core import REGISTRY, STRATEGIES, Option, Registry, build_strategy
from dropit_core.formats.packed import BlocksMeta, ElementsMeta, PoolMeta, QuantMeta, UnitsMeta
from dropit_core.registry import DOCS_BEGIN, DOCS_END
from dropit_core.strategies.base import COMMON_OPTIONS
from dropit_core.strategies.magnitude import MinK

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/core/ is two below
OPTIONS_DOC = ROOT / "docs" / "dropit.md"  # the generated strategy and option tables

# Every declared option with a value of the wrong type, and where it has a range or choices,
# one outside them: (strategy, option, option object).
DECLARED = [(name, key, opt) for name in STRATEGIES for key, opt in REGISTRY.options(name).items()]


def test_the_docs_hold_exactly_the_generated_tables() -> None:
    text = OPTIONS_DOC.read_text(encoding="utf-8")
    assert text.count(DOCS_BEGIN) == 1 and text.count(DOCS_END) == 1
    start = text.index(DOCS_BEGIN)
    end = text.index(DOCS_END) + len(DOCS_END)
    assert text[start:end] == REGISTRY.markdown(), (
        "docs/dropit.md's DropIT-options tables are out of date: replace them with the output of "
        "`python -m dropit_core`"
    )


def test_the_setting_guide_names_every_strategy() -> None:
    # docs/dropit.md's "Setting DropIT" lists the names above the tables; a new one must join it
    section = OPTIONS_DOC.read_text(encoding="utf-8").split("## Setting DropIT")[1]
    section = section.split("\n## ")[0]
    for name in STRATEGIES:
        assert f"`{name}`" in section, name


@pytest.mark.slow  # a fresh interpreter
def test_python_m_dropit_core_prints_the_tables() -> None:
    out = subprocess.run(  # from the repository root: this checkout's dropit_core
        [sys.executable, "-m", "dropit_core"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert out == REGISTRY.markdown() + "\n"


def test_tables_list_every_strategy_and_option_once() -> None:
    table = REGISTRY.markdown()
    for name in STRATEGIES:
        assert len(re.findall(rf"^\| `{name}` \|", table, flags=re.M)) == 1
    options = {key for name in STRATEGIES for key in REGISTRY.options(name)}
    for key in options:
        assert len(re.findall(rf"^\| `{key}` \|", table, flags=re.M)) == 1, key


def test_defaults_reach_the_built_strategy() -> None:
    defaults = {o.name: o.default for o in COMMON_OPTIONS}
    for name in STRATEGIES:
        built = build_strategy(name, 0.75)
        codec = built.codec
        assert (codec.fmt, codec.int8_chunk, codec.int4_chunk) == (
            defaults["values"],
            defaults["int8_chunk"],
            defaults["int4_chunk"],
        )
        for option in REGISTRY.get(name).options:
            if option.default is not None:
                assert getattr(built, option.name) == option.default, (name, option.name)
    assert build_strategy("pool", 0.75).factor == 2  # default_doc: round(1/sqrt(1-gamma))
    assert build_strategy("pool", 0.9).factor == 3


def _wrong_type(opt: Option):
    return 1.5 if opt.type is not float else "1.5"


@pytest.mark.parametrize("name,key,opt", DECLARED, ids=[f"{n}.{k}" for n, k, _ in DECLARED])
def test_every_declared_option_checks_type_and_range(name: str, key: str, opt: Option) -> None:
    bad = _wrong_type(opt)
    with pytest.raises(
        ValueError, match=re.escape(f"DropIT option {key}={bad!r} has the wrong type")
    ):
        build_strategy(name, 0.5, **{key: bad})
    if opt.type is bool:
        with pytest.raises(ValueError, match=re.escape(f"{key}=1 has the wrong type")):
            build_strategy(name, 0.5, **{key: 1})  # an int is no bool
    else:
        with pytest.raises(ValueError, match=re.escape(f"{key}=True has the wrong type")):
            build_strategy(name, 0.5, **{key: True})  # a bool is no int
    if opt.minimum is not None:
        low = opt.minimum - 1
        with pytest.raises(
            ValueError,
            match=re.escape(f"{key}={low} is invalid: allowed integers >= {opt.minimum}"),
        ):
            build_strategy(name, 0.5, **{key: low})
        build_strategy(name, 0.5, **{key: opt.minimum})  # the bound itself is allowed
    if opt.choices is not None:
        outside = "nope" if opt.type is str else max(opt.choices) + 1
        with pytest.raises(ValueError, match=re.escape(f"{key}={outside!r} is invalid: allowed (")):
            build_strategy(name, 0.5, **{key: outside})
        for choice in opt.choices:
            build_strategy(name, 0.5, **{key: choice})


@pytest.mark.parametrize("name", STRATEGIES)
def test_options_of_other_strategies_are_refused_with_the_allowed_list(name: str) -> None:
    mine = REGISTRY.options(name)
    others = {o.name for s in STRATEGIES for o in REGISTRY.get(s).options} - set(mine)
    for key in sorted(others):
        message = (
            f"DropIT option {key!r} does not apply to strategy {name!r}: "
            f"allowed {', '.join(sorted(mine))}"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            build_strategy(name, 0.5, **{key: 1})


def test_unknown_strategy_and_bad_gamma_messages() -> None:
    allowed = ", ".join(STRATEGIES)
    for name in ("topk", ["mink"], None):
        with pytest.raises(
            ValueError, match=re.escape(f"unknown DropIT strategy {name!r}: allowed {allowed}")
        ):
            build_strategy(name, 0.5)
    with pytest.raises(ValueError, match="DropIT gamma='0.5' is not a number"):
        build_strategy("mink", "0.5")
    with pytest.raises(
        ValueError, match="DropIT gamma=1.0 is out of range: allowed 0 <= gamma < 1"
    ):
        build_strategy("mink", 1.0)


def test_types_are_checked_before_values() -> None:
    # a bad value and a bad type together: the type error is reported, whatever the order
    with pytest.raises(ValueError, match="int8_chunk='x' has the wrong type"):
        build_strategy("mink", 0.5, values="nope", int8_chunk="x")
    # values: the common options first, then positions, then the strategy's own (as before the
    # registry): the first bad one in that order is reported
    with pytest.raises(ValueError, match="values='nope' is invalid"):
        build_strategy("threshold", 0.5, sample=0, positions="rle", values="nope")
    with pytest.raises(ValueError, match="positions='rle' is invalid"):
        build_strategy("parallel_mink", 0.5, chunk=0, positions="rle")


def test_registry_rejects_inconsistent_declarations() -> None:
    class A(MinK):
        name = "a"

    class B(MinK):
        name = "a"

    with pytest.raises(ValueError, match="the name 'a' is taken"):
        Registry((A, B), COMMON_OPTIONS)

    class C(MinK):
        name = "c"
        options = (Option("values", str, "same", "clash"),)

    with pytest.raises(ValueError, match="'c': an option is declared twice"):
        Registry((C,), COMMON_OPTIONS)

    class D(MinK):
        name = "d"
        options = (Option("chunk", int, 0, "a default outside its own range", minimum=1),)

    with pytest.raises(ValueError, match="chunk=0 is invalid"):
        Registry((D,), COMMON_OPTIONS)


def test_packing_never_consults_the_registry(monkeypatch) -> None:
    # Validation happens when the strategy is built; pack and unpack run on every layer of
    # every step and must not pay for it.
    built = {name: build_strategy(name, 0.5) for name in STRATEGIES}

    def refuse(*args, **kwargs):
        raise AssertionError("the registry was consulted during pack/unpack")

    for method in ("get", "options", "resolve", "markdown"):
        monkeypatch.setattr(REGISTRY, method, refuse)
    x = torch.randn(2, 3, 6, 5, generator=torch.Generator().manual_seed(0))
    for strategy in built.values():
        assert strategy.unpack(strategy.pack(x, "conv")).shape == x.shape


META_TYPES = {
    "mink": ElementsMeta,
    "parallel_mink": ElementsMeta,
    "random": ElementsMeta,
    "threshold": ElementsMeta,
    "channel_mink": UnitsMeta,
    "channel_random": UnitsMeta,
    "block_mink": BlocksMeta,
    "pool": PoolMeta,
    "importance": ElementsMeta,
    "quant": QuantMeta,
}


@pytest.mark.parametrize("layout,shape", [("conv", (2, 3, 6, 5)), ("linear", (7, 9))])
def test_meta_is_a_named_structure(layout: str, shape) -> None:
    assert set(META_TYPES) == set(STRATEGIES)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    for name, kind in META_TYPES.items():
        packed = build_strategy(name, 0.5).pack(x, layout)
        meta = packed.meta
        assert type(meta) is kind, name
        assert meta.shape == tuple(x.shape) and meta.dtype == x.dtype
        if kind is ElementsMeta:
            assert meta.kept == packed.values.numel()
            assert (packed.bits is None) == (name == "random")
        if kind is UnitsMeta:
            assert meta.layout == layout
            assert meta.width == (shape[-2] * shape[-1] if layout == "conv" else shape[0])
        if kind is BlocksMeta:
            assert meta.block_rows * meta.block_cols * meta.planes >= packed.index.numel()


def test_a_strategy_refuses_the_common_options_it_skips() -> None:
    # quant stores codes, not kept values: the value formats do not apply to it.
    assert "values" not in REGISTRY.options("quant") and "rescale" in REGISTRY.options("quant")
    message = (
        "DropIT option 'values' does not apply to strategy 'quant': "
        "allowed bits, group, rescale, seed"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        build_strategy("quant", 0.5, values="int8")
    table = REGISTRY.markdown()
    assert "| `values` | all but `quant` |" in table and "| `rescale` | all |" in table

    class E(MinK):
        name = "e"
        skips_common = ("nope",)

    with pytest.raises(ValueError, match="'e': skips an option no strategy takes"):
        Registry((E,), COMMON_OPTIONS)


def test_description_omits_gamma_where_it_means_nothing() -> None:
    assert build_strategy("quant", 0.8, bits=2).describe() == "quant(bits=2, group=256)"
    assert build_strategy("random", 0.8, scale=True).describe() == "random(gamma=0.8, scale=true)"
    assert build_strategy("importance", 0.5).describe() == "importance(gamma=0.5, sample=65536)"

"""The module names from before dropit_core's subpackages still import, for one release: each
warns once, naming the new home, and reads every name from there."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from dropit_core import renamed


@pytest.mark.parametrize("old", sorted(renamed.RENAMED))
def test_an_old_module_name_warns_with_its_new_home_and_reads_from_it(old: str) -> None:
    name = f"dropit_core.{old}"
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    homes = [importlib.import_module(f"dropit_core.{h}") for h in renamed.RENAMED[old]]
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert len(messages) == 1 and all(h.__name__ in messages[0] for h in homes), messages
    for home in homes:  # every public name of every home, as the home has it
        public = [n for n in vars(home) if not n.startswith("_") and n != "annotations"]
        for attr in public:
            if getattr(module, attr) is not getattr(home, attr):
                # an earlier home has a name of the same spelling: it wins, as documented
                earlier = homes[: homes.index(home)]
                assert any(hasattr(h, attr) for h in earlier), (old, attr)
    with pytest.raises(AttributeError, match="no 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_split_modules_read_each_name_from_its_part() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from dropit_core.kernels import quant as old_kernels
        from dropit_core.patch import DropITConv2d, to_dropit
        from dropit_core.unbiased import Importance, Quant

    from dropit_core.convert import to_dropit as new_to_dropit
    from dropit_core.layers.modules import DropITConv2d as new_conv
    from dropit_core.strategies import Importance as new_importance
    from dropit_core.strategies import Quant as new_quant

    assert (to_dropit, DropITConv2d) == (new_to_dropit, new_conv)
    assert (Importance, Quant) == (new_importance, new_quant)
    # an old submodule of an old package name is the new module itself, not a second copy
    from dropit_core.backends.triton import quant as new_kernels

    assert old_kernels.quant_pack is new_kernels.quant_pack


def test_traced_reads_the_norm_operators_and_removed_helpers_name_their_replacement() -> None:
    # dropit_core.traced held the norm operators and autocast_inputs too, now in layers.norm and
    # layers.functions; helpers that went with issue 57 say what to call instead.
    import importlib
    import re

    from dropit_core.layers import functions, norm
    from dropit_core.renamed import REMOVED

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = importlib.import_module("dropit_core.traced")
        assert traced.batch_norm is norm.batch_norm and traced.group_norm is norm.group_norm
        assert traced.autocast_inputs is functions.autocast_inputs
        for (old, name), instead in REMOVED.items():
            module = importlib.import_module(f"dropit_core.{old}")
            message = f"{name} was removed: use {re.escape(instead)}"
            with pytest.raises(AttributeError, match=message):
                getattr(module, name)


@pytest.mark.parametrize(
    "module,setter,field,value",
    [
        ("dropit_core.backends.dispatch", "set_kernels", "kernels", "eager"),
        ("dropit_core.backends.native", "set_native", "native", False),
        ("dropit_core.layers.hooked", "set_hooked", "hooked", False),
        ("dropit_core.layers.library", "set_fuse", "fuse", True),
    ],
)
def test_the_setters_before_configure_warn_and_still_set(module, setter, field, value) -> None:
    import importlib

    from dropit_core import current_settings, reset_settings

    setter_fn = getattr(importlib.import_module(module), setter)
    reset_settings()
    default = getattr(current_settings(), field)
    try:
        with pytest.warns(DeprecationWarning, match=rf"{setter} is deprecated: .*{field}=\.\.\."):
            setter_fn(value)
        assert getattr(current_settings(), field) == value
        with pytest.warns(DeprecationWarning):
            setter_fn(None)  # back to what the environment says
        assert getattr(current_settings(), field) == default
    finally:
        reset_settings()

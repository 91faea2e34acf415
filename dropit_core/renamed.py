"""The module names of dropit_core before its subpackages (2026-12-02), kept one release.

``import dropit_core.ops`` (or ``from dropit_core.ops import X``) still works: it gives a module
that reads each name from its new home and warns once, naming the new module. The old modules
that were split read from each of their parts in turn. A few internal helpers went with issue
57 (:data:`REMOVED`); reading one raises an AttributeError that names what to call instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old name (under dropit_core) -> its new module(s), under dropit_core
RENAMED: dict[str, tuple[str, ...]] = {
    "base": ("formats.packed", "strategies.base"),
    "dispatch": ("backends.dispatch",),
    "elementwise": ("strategies.elementwise",),
    "frozen_norm": ("detection.frozen_norm",),
    "hooked": ("layers.hooked",),
    "keep_rule": ("strategies.keep_rule",),
    "kernels": ("backends.triton",),
    "kernels.compact": ("backends.triton.compact",),
    "kernels.launch": ("backends.triton.launch",),
    "kernels.noise": ("backends.triton.noise",),
    "kernels.quant": ("backends.triton.quant",),
    "kernels.relu": ("backends.triton.relu",),
    "kernels.select": ("backends.triton.select",),
    "lean": ("detection.lean",),
    "lean_detection": ("detection.forward",),
    "native": ("backends.native",),
    "norm": ("layers.norm",),
    "ops": ("layers.functions",),
    "packing": ("formats.bits", "formats.values"),
    "patch": ("convert", "layers.modules"),
    "pooling": ("layers.pooling",),
    "quant_format": ("formats.quant",),
    "seeds": ("formats.seeds",),
    "select": ("strategies.select", "formats.packed"),
    "traced": ("layers.library", "layers.norm", "layers.functions"),
    "unbiased": ("strategies.importance", "strategies.quant"),
}
PREFIX = "dropit_core."
# old module name, removed helper -> what to call instead
REMOVED = {
    ("dispatch", "use_kernels"): "dropit_core.backends.dispatch.choose(op, tensor)",
    ("dispatch", "kernel_mode"): "dropit_core.current_settings().kernels",
    ("native", "takes"): "dropit_core.backends.dispatch.choose(op, tensor)",
    ("native", "ready"): "dropit_core.backends.dispatch.choose(op, tensor)",
    ("kernels.quant", "rebuild_unchecked"): "quant_rebuild(..., check=False)",
    ("packing", "compact"): "values[mask]",
}


class _Renamed(types.ModuleType):
    """An old module name: each attribute read from the first new module that has it."""

    def __init__(self, name: str, homes: tuple[str, ...]) -> None:
        super().__init__(name)
        self.__homes = tuple(PREFIX + home for home in homes)
        if any(old.startswith(name[len(PREFIX) :] + ".") for old in RENAMED):
            # a package's old name: its old submodules import through this finder too (an
            # empty path, so that no other finder loads a second copy of a new module)
            self.__path__: list[str] = []

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # the import system's questions are about this module
            raise AttributeError(attr)
        for home in self.__homes:
            module = importlib.import_module(home)
            if hasattr(module, attr):
                return getattr(module, attr)
        instead = REMOVED.get((self.__name__[len(PREFIX) :], attr))
        if instead is not None:
            raise AttributeError(f"{self.__name__}.{attr} was removed: use {instead}")
        raise AttributeError(f"{self.__name__} (now {', '.join(self.__homes)}) has no {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted({a for h in self.__homes for a in dir(importlib.import_module(h))})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.startswith(PREFIX) and fullname[len(PREFIX) :] in RENAMED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        homes = RENAMED[spec.name[len(PREFIX) :]]
        return _Renamed(spec.name, homes)

    def exec_module(self, module: types.ModuleType) -> None:
        homes = ", ".join(PREFIX + home for home in RENAMED[module.__name__[len(PREFIX) :]])
        warnings.warn(
            f"{module.__name__} is deprecated: its names are now in {homes}",
            DeprecationWarning,
            stacklevel=3,
        )


def install() -> None:
    """Put the old names' finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())

"""The package's shape: no import cycles among the modules of rcnn_dropit, dropit_core and the
instruments, no private name (a leading underscore: "only this module") used from another
module, and the instruments apart from the product."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rcnn_dropit", "dropit_core", "instruments")
# Private names used across modules that other work is removing right now (dropit_core's own
# consolidation): (importing module, imported module, name). Delete an entry when it lands; an
# entry that no longer occurs fails the test, so the list cannot go stale.
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the packages (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(module: str, path: Path, known: dict[str, Path]):
    """(imported module, name or None, line) for every import of the file, wherever it stands
    (module level, inside functions, under TYPE_CHECKING): each is a dependency of the design."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:  # `from package import module`
                    yield sub, None, node.lineno
                else:
                    yield source, alias.name, node.lineno


def _module_aliases(module: str, path: Path, known: dict[str, Path]) -> dict[str, str]:
    """Local names bound to one of our modules (``import a.b as c``, ``from a import b``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path.name == "__init__.py", node)
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    return aliases


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_import_cycles() -> None:
    known = _modules()
    graph = {
        m: sorted({target for target, _, _ in _imports(m, p, known) if target in known} - {m})
        for m, p in known.items()
    }
    done: set[str] = set()
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycles.append(" -> ".join(stack[stack.index(node) :] + [node]))
            return
        if node in done:
            return
        for target in graph[node]:
            visit(target, [*stack, node])
        done.add(node)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in graph:
        visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_is_used_across_modules() -> None:
    known = _modules()
    found = set()
    where = {}
    for module, path in known.items():
        for target, name, line in _imports(module, path, known):
            if target in known and target != module and name is not None and _private(name):
                found.add((module, target, name))
                where[(module, target, name)] = f"{path.relative_to(REPO)}:{line}"
        aliases = _module_aliases(module, path, known)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != module
                and _private(node.attr)
            ):
                key = (module, aliases[node.value.id], node.attr)
                found.add(key)
                where[key] = f"{path.relative_to(REPO)}:{node.lineno}"
    new = sorted(found - KNOWN_PRIVATE)
    assert not new, "private names used across modules:\n" + "\n".join(
        f"{where[k]}: {k[0]} uses {k[1]}.{k[2]}" for k in new
    )
    assert not KNOWN_PRIVATE - found, (
        f"no longer used, remove from KNOWN_PRIVATE: {KNOWN_PRIVATE - found}"
    )


# Private attributes reached on an object (``x._name``, x not self, cls or super()) that this
# module does not define, where they stay: torch's and torchvision's own internals, each without
# a public equivalent that does the same. (module, the reach as written) -> why it is allowed. An
# entry that no longer occurs fails the test, so the list cannot go stale.
FOREIGN_PRIVATE: dict[tuple[str, str], str] = {
    ("dropit_core.detection.pooler", "torch.ops.torchvision._roi_align_backward"): (
        "torchvision's RoIAlign backward kernel, called per part of a level's RoIs"
    ),
    ("dropit_core.detection.pooler", "torchvision.extension._has_ops"): (
        "whether torchvision's compiled ops exist (else it pools in Python): no public test"
    ),
    ("dropit_core.detection.pooler", "torchvision._is_tracing"): (
        "torchvision's own ONNX-tracing test, which its RoI pooler asks too"
    ),
    ("dropit_core.layers.cache", "key._version"): "a tensor's in-place version counter",
    ("dropit_core.layers.casts", "p._version"): "a tensor's in-place version counter",
    ("dropit_core.layers.casts", "torch._C._is_any_autocast_enabled"): (
        "whether any device's autocast is on, in one call (torch >= 2.4): no public equivalent"
    ),
    ("dropit_core.layers.norm", "nn.modules.batchnorm._BatchNorm"): (
        "the base class of every BatchNorm, as an annotation"
    ),
    ("dropit_core.layers.norm", "module._check_input_dim"): (
        "the BatchNorm's own input check, which its forward (replaced here) runs"
    ),
    ("dropit_core.layers.norm", "F._verify_batch_size"): (
        "F.batch_norm's check of one value per channel, which the plain layer runs"
    ),
    ("dropit_core.layers.norm", "torch.ops.aten._batch_norm_with_update"): (
        "the aten op BatchNorm's forward runs (its reserve is what the backward reads)"
    ),
    ("dropit_core.memory", "nn.modules.batchnorm._NormBase"): (
        "the base class of every batch and instance norm"
    ),
    ("dropit_core.recompute", "bn._buffers"): (
        "running statistics swapped for copies in place, as registered buffers (a recompute "
        "must not update them twice)"
    ),
    ("dropit_core.saved", "t._base"): "a view's base tensor (a parameter's view stays dense)",
    ("dropit_core.saved", "t._version"): "a tensor's in-place version counter",
    ("rcnn_dropit.cli", "os._exit"): "the standard library's documented exit without cleanup",
    ("rcnn_dropit.models.buckets", "transform._skip_resize"): (
        "torchvision's transform takes it as a constructor argument: copied to the subclass"
    ),
    ("rcnn_dropit.models.buckets", "torchvision._is_tracing"): (
        "torchvision's own ONNX-tracing test, which its transform asks too"
    ),
    ("instruments.measure.live_probe", "sys._getframe"): "the standard library's caller frame",
    ("instruments.measure.live_probe", "torch._C._current_autograd_node"): (
        "the autograd node running a saved-tensor hook: whose tensor it is"
    ),
}
# namedtuple's API: underscored so as not to clash with field names, public all the same
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_field_defaults", "_make"}


def _defined_here(tree: ast.AST) -> set[str]:
    """Every name the file binds or defines: functions, classes, assigned names and arguments,
    attributes it assigns or deletes (``self._x = ...``, ``other._x = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _own(value: ast.expr) -> bool:
    """Whether an attribute's object is the instance or class at hand (self, cls, super())."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and ast.unparse(value.func) == "super"


def _private_reaches(path: Path, aliases: dict[str, str]):
    """(the reach as written, line) of each ``x._name`` read in the file whose ``_name`` the
    file does not define, x not self, cls, super() nor one of our modules (the import rule's);
    of a chain (``torch._C._autograd._push``) the whole reach only."""
    tree = ast.parse(path.read_text(), str(path))
    here = _defined_here(tree)
    reaches = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and _private(node.attr)
        and node.attr not in here
        and node.attr not in NAMEDTUPLE_API
        and not _own(node.value)
        and not (isinstance(node.value, ast.Name) and node.value.id in aliases)
    ]
    inner = {id(node.value) for node in reaches}
    for node in reaches:
        if id(node) not in inner:
            yield ast.unparse(node), node.lineno


def test_no_private_attribute_is_reached_across_modules() -> None:
    # A leading underscore on an attribute says "only the module that defines it": another
    # module that reads it (``strategy._inv_levels`` from the layers) breaks when it is renamed.
    # An attribute the reading module defines itself (an instance of its own class) is its own.
    known = _modules()
    found = {}
    for module, path in known.items():
        for reach, line in _private_reaches(path, _module_aliases(module, path, known)):
            found.setdefault((module, reach), f"{path.relative_to(REPO)}:{line}")
    new = sorted(set(found) - set(FOREIGN_PRIVATE))
    assert not new, "private attributes reached from another module:\n" + "\n".join(
        f"{found[k]}: {k[1]}" for k in new
    )
    stale = set(FOREIGN_PRIVATE) - set(found)
    assert not stale, f"no longer reached, remove from FOREIGN_PRIVATE: {stale}"


INSTRUMENTS = (
    "bench",
    "study",
    "grad_groups",
    "gpu_checks",
    "results_page",
)  # tools/ that run instruments


def test_the_tools_are_thin_and_import_nothing_private() -> None:
    # tools/*.py run a command from a checkout; nothing imports them. The product's tools import
    # the installed package; the instruments' tools put the checkout on the path first.
    for path in sorted((REPO / "tools").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        froms = [
            n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module != "pathlib"
        ]
        instrument = path.stem in INSTRUMENTS
        package = "instruments" if instrument else "rcnn_dropit"
        assert [n.module for n in froms] == [f"{package}.commands.{path.stem}"], path
        entry = "cli" if path.stem == "bench" else "main"
        assert [a.name for n in froms for a in n.names] == [entry], path
        assert ("sys.path" in path.read_text()) is instrument, path


def test_the_instruments_are_not_imported_by_the_product() -> None:
    known = _modules()
    product = [m for m in known if m.startswith(("rcnn_dropit", "dropit_core"))]
    uses = [
        f"{m} imports {target}"
        for m in product
        for target, _, _ in _imports(m, known[m], known)
        if target.split(".")[0] == "instruments"
    ]
    assert not uses, uses
    # the instruments left the installed package: neither the measure package nor the study's
    # report modules nor their commands are in it any more
    gone = ["rcnn_dropit/measure", *(f"rcnn_dropit/commands/{t}.py" for t in INSTRUMENTS)]
    gone += [f"rcnn_dropit/report/{m}.py" for m in ("choice", "goal", "notes", "seeded", "verdict")]
    assert not [g for g in gone if (REPO / g).exists()]


def test_the_library_tests_need_nothing_of_the_toolkit() -> None:
    # tests/core/ checks dropit_core as a library user has it: torch (torchvision models as test
    # subjects), never rcnn_dropit, the instruments or the toolkit's test helpers
    banned = ("rcnn_dropit", "instruments", "tests.helpers", "tests.toolkit", "pycocotools")
    for path in sorted((REPO / "tests" / "core").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.startswith(banned)], path


DROPIT = REPO / "dropit_core"
# Where rcnn_dropit and the instruments may import dropit_core from: the package, its public
# top-level modules, and the subpackages' own surfaces (their __init__), never a module inside a
# subpackage: those can move without a deprecation.
PUBLIC_SURFACES = {
    "dropit_core",
    "dropit_core.memory",
    "dropit_core.settings",
    *(f"dropit_core.{p.parent.name}" for p in DROPIT.glob("*/__init__.py")),
}


def test_dropit_core_keeps_a_dozen_entry_points_at_its_top_level() -> None:
    top = sorted(p.stem for p in DROPIT.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 12, top
    subpackages = sorted(p.parent.name for p in DROPIT.glob("*/__init__.py"))
    assert subpackages == ["backends", "detection", "formats", "layers", "strategies"]


def test_every_dropit_core_module_is_mapped_in_its_package_docstring() -> None:
    # a newcomer reads one docstring per package and finds every module named in it
    packages = [DROPIT, *(p.parent for p in DROPIT.rglob("*/__init__.py"))]
    for package in packages:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        modules = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
        modules += [p.parent.name for p in package.glob("*/__init__.py")]
        missing = [m for m in modules if f":mod:`.{m}`" not in doc]
        assert not missing, (package, missing)


def test_only_the_detection_subpackage_imports_torchvision() -> None:
    known = _modules()
    users = [
        m
        for m in known
        if m.startswith("dropit_core") and not m.startswith("dropit_core.detection")
        for target, _, _ in _imports(m, known[m], known)
        if target.split(".")[0] == "torchvision"
    ]
    assert not users, users


def test_the_toolkit_and_instruments_import_dropit_core_public_surfaces_only() -> None:
    import importlib

    known = _modules()
    wrong = []
    for m in known:
        if not m.startswith(("rcnn_dropit", "instruments")):
            continue
        for target, name, line in _imports(m, known[m], known):
            if not target.startswith("dropit_core"):
                continue
            if target not in PUBLIC_SURFACES:
                wrong.append(f"{m}:{line} imports {target}")
            elif name is not None:
                exported = getattr(importlib.import_module(target), "__all__", None)
                if _private(name) or (exported is not None and name not in exported):
                    wrong.append(f"{m}:{line} imports {target}.{name}, not in its __all__")
    assert not wrong, wrong

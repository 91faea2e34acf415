"""YAML configs: `_base_` inheritance, deep merge, `a.b=value` overrides, typing and validation."""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rcnn_dropit.config_schema import (
    Config,
    DataConfig,
    DropITConfig,
    ModelConfig,
    ShapesConfig,
    SolverConfig,
    TestConfig,
    TrainConfig,
    cross_check,
)
from rcnn_dropit.errors import MissingPathError, UsageError, require_path

__all__ = [
    "Config",
    "DataConfig",
    "DropITConfig",
    "ModelConfig",
    "ShapesConfig",
    "SolverConfig",
    "TestConfig",
    "TrainConfig",
    "config_from_dict",
    "config_yaml",
    "load_config",
    "with_overrides",
]

BASE_KEY = "_base_"


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config with its `_base_` files, apply `a.b=value` overrides, and validate."""
    if isinstance(overrides, str):  # a string is a sequence too, of one-character "overrides"
        raise UsageError(
            f"overrides: give a list of 'key=value' strings, not the string {overrides!r}"
        )
    path = Path(path)
    merged = _load_tree(path, stack=())
    for item in overrides:
        _apply_override(merged, item)
    if not merged.get("name"):
        merged["name"] = path.stem  # the run name defaults to the config file's stem
    source = f"{path} (with overrides)" if overrides else str(path)
    return _build(Config, merged, prefix="", source=source)


def config_from_dict(d: dict[str, Any]) -> Config:
    """Rebuild a validated Config from a plain dict (e.g. the one stored in a checkpoint)."""
    if not isinstance(d, dict):
        raise UsageError(f"config: expected a mapping, got {type(d).__name__}")
    return _build(
        Config, _check_tree(d, Config, "", "config dict"), prefix="", source="config dict"
    )


def with_overrides(cfg: Config, overrides: Sequence[str], source: str = "config") -> Config:
    """``cfg`` with `a.b=value` overrides applied as :func:`load_config` applies them, validated;
    ``source`` names where the overrides come from in error messages."""
    merged = cfg.to_dict()
    for item in overrides:
        _apply_override(merged, item)
    return _build(Config, merged, prefix="", source=f"{source} (with overrides)")


def config_yaml(cfg: Config) -> str:
    """The resolved config as YAML text (a run's config.yaml; loadable again with load_config)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


# --- reading files ---------------------------------------------------------------------------


def _read_yaml(path: Path) -> dict[str, Any]:
    require_path(path, "file", "config file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise UsageError(
            f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start})"
        ) from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UsageError(f"{path}:{where}: invalid YAML: {err.problem or err}") from None
    except (yaml.YAMLError, ValueError, OverflowError) as err:
        # ValueError: a scalar YAML resolves but cannot build, e.g. the date 2001-13-01
        raise UsageError(f"{path}: invalid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _load_tree(path: Path, stack: tuple[Path, ...]) -> dict[str, Any]:
    """Merged, type-checked dict of `path` and its bases (bases first, the file itself last)."""
    resolved = path.resolve()
    if resolved in stack:
        chain = " -> ".join(str(p) for p in (*stack, resolved))
        raise UsageError(f"{path}: circular _base_ inclusion: {chain}")
    data = _read_yaml(path)
    bases = data.pop(BASE_KEY, [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise UsageError(
            f"{path}: _base_ must be a file name or a list of file names, got {bases!r}"
        )
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = path.parent / base
        if not base_path.is_file():
            raise MissingPathError(f"{path}: _base_ file '{base_path}' does not exist")
        _merge(merged, _load_tree(base_path, (*stack, resolved)))
    _merge(merged, _check_tree(data, Config, "", str(path)))
    return merged


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """Deep merge in place: dicts merge key by key; lists and scalars replace."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = value


# --- overrides -------------------------------------------------------------------------------


def _apply_override(tree: dict[str, Any], item: str) -> None:
    """Merge one override into the config tree. A section given as a mapping merges key by key,
    as a `_base_` file does; a mapping-valued key (`dropit.options`) takes the value as written,
    so that `dropit.options={}` clears what a base config set."""
    parsed = _parse_override(item)
    parts = item.split("=", 1)[0].strip().split(".")
    if not _is_dict_type(_field_type(Config, parts)):
        _merge(tree, parsed)
        return
    for part in parts[:-1]:
        parsed = parsed[part]
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[parts[-1]] = parsed[parts[-1]]


def _parse_override(item: str) -> dict[str, Any]:
    """`a.b.c=value` -> {"a": {"b": {"c": typed value}}}, checked against the schema."""
    if "=" not in item:
        raise UsageError(f"override '{item}': expected key=value, e.g. solver.lr=0.01")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or not all(parts):
        raise UsageError(f"override '{item}': empty key part in '{key}'")
    source = f"override '{item}'"
    hint = _field_type(Config, parts)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # an unparsable value is taken as text, the type check decides
    if _is_str_type(hint) and not isinstance(value, (str, type(None))):
        value = raw.strip()  # `name=2017` means the text 2017 for a text key
    nested: Any = value
    for part in reversed(parts):
        nested = {part: nested}
    return _check_tree(nested, Config, "", source)


def _field_type(cls: type, parts: list[str]) -> Any:
    """The schema type at a dotted path, or None where the path is not in the schema."""
    hint: Any = cls
    for part in parts:
        if _is_dict_type(hint):
            return typing.get_args(hint)[1]
        if not dataclasses.is_dataclass(hint):
            return None
        hint = _fields(hint).get(part)
    return hint


# --- typing ----------------------------------------------------------------------------------


def _fields(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown(prefix: list[str], key: str, known: dict[str, Any], source: str) -> None:
    full = ".".join([*prefix, key])
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean '{'.'.join([*prefix, close[0]])}'?" if close else ""
    allowed = ", ".join(known)
    raise UsageError(f"{source}: unknown key '{full}'{hint} (allowed here: {allowed})")


def _check_tree(data: dict[str, Any], cls: type, prefix: str, source: str) -> dict[str, Any]:
    """Copy of `data` with every key known to `cls` and every value coerced to its type."""
    known = _fields(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in known:
            _unknown(prefix.split(".")[:-1] if prefix else [], str(key), known, source)
        out[key] = _coerce(value, known[key], f"{prefix}{key}", source)
    return out


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    """`value` converted to the schema type `hint`, or a ValueError naming key, value and type."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            _wrong(key, value, "a mapping", source)
        return _check_tree(value, hint, f"{key}.", source)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key, source)
    if origin is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        return [_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(items)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            _wrong(key, value, "a mapping with text keys", source)
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            _wrong(key, value, "true or false", source)
        return value
    if hint is int:
        return _to_int(value, key, source)
    if hint is float:
        return _to_float(value, key, source)
    if hint is str:
        if not isinstance(value, str):
            _wrong(key, value, "text (quote it in YAML)", source)
        return value
    raise TypeError(f"schema type {hint!r} of '{key}' is not supported")


def _to_int(value: Any, key: str, source: str) -> int:
    number: Any = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            as_float = float(value.strip())  # "1e3" reads as 1000
        except ValueError:
            as_float = None
        if as_float is not None and as_float.is_integer():
            number = int(as_float)
    if number is None:
        _wrong(key, value, "an integer", source)
    if abs(number) >= 2**63:  # torch seeds, sizes and counts are 64-bit
        _wrong(key, value, "an integer of at most 63 bits", source)
    return number


def _to_float(value: Any, key: str, source: str) -> float:
    number = None
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as text
            number = float(value.strip())
    except (ValueError, OverflowError):  # text that is no number; an int beyond float range
        pass
    if number is None or not math.isfinite(number):  # inf or nan would train to nan
        _wrong(key, value, "a finite number", source)
    return number


def _wrong(key: str, value: Any, expected: str, source: str) -> typing.NoReturn:
    shown = repr(value)
    if len(shown) > 60:  # e.g. a 400-digit number: the start identifies it
        shown = shown[:57] + "..."
    raise UsageError(f"{source}: {key} = {shown} has the wrong type; expected {expected}")


def _is_str_type(hint: Any) -> bool:
    return hint is str or (
        typing.get_origin(hint) in (typing.Union, types.UnionType) and str in typing.get_args(hint)
    )


def _is_dict_type(hint: Any) -> bool:
    return typing.get_origin(hint) is dict


# --- building and validating -----------------------------------------------------------------


def _build(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    """Instantiate `cls` from checked data and validate ranges, choices and cross-key rules."""
    obj = _instantiate(cls, data, prefix, source)
    errors = cross_check(obj) if cls is Config else []
    if errors:
        raise UsageError(f"{source}: {errors[0]}")
    return obj


def _instantiate(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    hints = _fields(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if f.name in data:
            value = data[f.name]
            if dataclasses.is_dataclass(hints[f.name]):
                value = _instantiate(hints[f.name], value, f"{key}.", source)
            kwargs[f.name] = value
            _validate(key, kwargs[f.name], f.metadata, source)
    return cls(**kwargs)


def _validate(key: str, value: Any, rules: typing.Mapping[str, Any], source: str) -> None:
    if value is None or not rules:
        return
    choices = rules.get("choices")
    if choices is not None and value not in choices:
        allowed = ", ".join(map(str, choices))
        raise UsageError(f"{source}: {key} = {value!r} is not one of {allowed}")
    ops = {"ge": (">=", operator.ge), "gt": (">", operator.gt)}
    ops |= {"le": ("<=", operator.le), "lt": ("<", operator.lt)}
    used = [r for r in ops if r in rules]
    # compared as they are: float() of a huge int overflows; NaN fails every comparison
    if any(not ops[r][1](value, rules[r]) for r in used):
        allowed = " and ".join(f"{ops[r][0]} {rules[r]}" for r in used)
        raise UsageError(f"{source}: {key} = {value!r} is out of range; it must be {allowed}")

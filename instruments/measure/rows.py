"""What a JSON file of bench rows holds: each ``--json`` kind is a non-empty list of objects, told
apart by the keys every one of its rows has (``tools/bench.py markdown`` picks its table so)."""

from __future__ import annotations

from typing import Any


def rows_with(data: Any, *keys: str) -> bool:
    """Whether parsed JSON is a non-empty list of objects, each with every one of ``keys``."""
    return (
        isinstance(data, list)
        and bool(data)
        and all(isinstance(r, dict) and all(k in r for k in keys) for r in data)
    )

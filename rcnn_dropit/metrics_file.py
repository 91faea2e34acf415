"""JSON-lines metrics file: the run's source of truth for losses, timings and AP."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _plain(value: Any) -> Any:
    """Turn tensors/numpy scalars into JSON numbers; non-finite floats become strings."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        # JSON has no NaN/Infinity; keep the information readable instead of writing invalid JSON.
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def read_metrics(path: str | Path) -> list[dict]:
    """Read every record of a metrics.jsonl file (missing file: empty list)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # A run killed mid-write can leave one partial last line; it carries nothing usable.
            continue
    return records


class MetricsWriter:
    """Appends one JSON object per line and flushes each, so a killed run loses nothing logged."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        """Append one record."""
        self._file.write(json.dumps(_plain(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (further writes are an error)."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullWriter:
    """Writer used on ranks other than 0: accepts records and drops them."""

    def write(self, record: dict) -> None:
        """Drop the record."""

    def close(self) -> None:
        """Nothing to close."""

"""Optional TensorBoard scalars, fed from the records of metrics.jsonl (the source of truth)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rcnn_dropit.errors import UsageError

INSTALL_HINT = "pip install 'rcnn-dropit[tensorboard]' (or pip install tensorboard)"
_NOT_SCALARS = ("type", "iter", "epoch")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """TensorBoard tags and values of a metrics record: 'train/loss', 'eval/bbox/AP', ...

    Nested dicts become tag paths; non-numbers (strings, lists, None) are left out.
    """
    prefix = str(record.get("type", "train"))
    out: dict[str, float] = {}

    def add(tag: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{tag}/{key}", inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)

    for key, value in record.items():
        if key not in _NOT_SCALARS:
            add(f"{prefix}/{key}", value)
    return out


def require_tensorboard() -> None:
    """Fail with one clear message, before anything runs, when tensorboard is not installed."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UsageError(
            f"train.tensorboard: true needs the tensorboard package; {INSTALL_HINT}, "
            "or set train.tensorboard=false"
        ) from None


class TensorBoardWriter:
    """Writes each record's numbers as scalars at step record['iter'] into a run folder."""

    def __init__(self, log_dir: Path | str) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        """Add the record's scalars."""
        step = int(record.get("iter", 0))
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()

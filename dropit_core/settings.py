"""How DropIT runs, in one place: the switches, read from the environment once, settable in code.

- ``kernels`` (``DROPIT_KERNELS``, default ``auto``): ``auto`` gives CUDA tensors the Triton
  kernels (when triton imports) and CPU tensors the C loops; ``triton`` the kernels for every
  tensor (on the CPU under ``TRITON_INTERPRET=1``: the tests); ``eager`` plain torch everywhere.
- ``native`` (``DROPIT_NATIVE``, default on): the C loops for CPU packs under ``auto``.
- ``fuse`` (``DROPIT_FUSE``, default off): under ``torch.compile``, quant packs and ReLU masks as
  plain torch ops that Inductor fuses (read while tracing: set it before the first compiled call).

Every path asks :func:`current`, so a change (:func:`configure`) takes effect at the next layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

KERNELS = ("auto", "triton", "eager")
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


@dataclass(frozen=True)
class Settings:
    """The switches; see the module's table."""

    kernels: str = "auto"
    native: bool = True
    fuse: bool = False

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"DropIT kernels={self.kernels!r} is invalid: allowed {KERNELS}")
        for name in ("native", "fuse"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DropIT {name}={getattr(self, name)!r} is invalid: a bool")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings ``environ`` asks for (unset variables: the defaults)."""
        fields: dict[str, object] = {}
        for name, var in ENVIRONMENT.items():
            raw = environ.get(var, "").strip().lower()
            if not raw:
                continue
            if name == "kernels":
                if raw not in KERNELS:
                    raise ValueError(f"{var}={raw!r} is invalid: allowed {', '.join(KERNELS)}")
                fields[name] = raw
            elif raw in _ON or raw in _OFF:
                fields[name] = raw in _ON
            else:
                raise ValueError(f"{var}={raw!r} is invalid: allowed {', '.join(_ON + _OFF)}")
        return cls(**fields)

    @property
    def loops(self) -> bool:
        """Whether CPU packs may take the C loops: on, and neither forced kernels nor eager."""
        return self.native and self.kernels == "auto"


ENVIRONMENT = {f.name: f"DROPIT_{f.name.upper()}" for f in dataclasses.fields(Settings)}
_current = Settings.from_environment()


def current() -> Settings:
    return _current


def configure(**changes: object) -> Settings:
    """Change the named fields (checked: one ValueError naming a bad one); returns the
    settings they replace, which ``configure(**dataclasses.asdict(previous))`` puts back."""
    global _current
    unknown = set(changes) - set(ENVIRONMENT)
    if unknown:
        raise ValueError(
            f"unknown DropIT setting(s) {sorted(unknown)}: allowed {list(ENVIRONMENT)}"
        )
    previous = _current
    _current = dataclasses.replace(_current, **changes)
    return previous


def reset_settings() -> Settings:
    """Read the environment anew, dropping what :func:`configure` set; returns the old ones."""
    global _current
    previous, _current = _current, Settings.from_environment()
    return previous


@contextlib.contextmanager
def override_settings(**changes: object) -> Iterator[Settings]:
    """The named fields changed inside a ``with`` block, put back after it."""
    global _current
    previous = configure(**changes)
    try:
        yield _current
    finally:
        _current = previous

"""What the core tests share: the layers every strategy's layer contract is checked on."""

from __future__ import annotations

import torch


def contract_layers() -> list[tuple[torch.nn.Module, tuple[int, ...]]]:
    """One conv, one transposed conv and one linear layer (seeded), each with an input shape:
    the layers every DropIT strategy's layer contract is checked on."""
    torch.manual_seed(5)
    return [
        (torch.nn.Conv2d(3, 4, 3, padding=1), (2, 3, 6, 6)),
        (torch.nn.ConvTranspose2d(3, 4, 2, stride=2), (2, 3, 4, 4)),
        (torch.nn.Linear(5, 4), (3, 2, 5)),
    ]

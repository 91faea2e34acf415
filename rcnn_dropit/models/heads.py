"""Box head with ReLU modules, so that module-level tools (DropIT) can see its activations."""

from __future__ import annotations

import torch
from torch import nn


class MLPHead(nn.Module):
    """Drop-in for torchvision's TwoMLPHead (same fc6/fc7 state_dict keys) using nn.ReLU modules."""

    def __init__(self, in_channels: int, representation_size: int) -> None:
        super().__init__()
        self.fc6 = nn.Linear(in_channels, representation_size)
        self.relu6 = nn.ReLU()
        self.fc7 = nn.Linear(representation_size, representation_size)
        self.relu7 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Flatten RoI features and apply fc6-relu-fc7-relu."""
        x = x.flatten(start_dim=1)
        return self.relu7(self.fc7(self.relu6(self.fc6(x))))

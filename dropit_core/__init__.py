"""DropIT: cache only the largest-magnitude part of conv/linear inputs for the backward pass."""

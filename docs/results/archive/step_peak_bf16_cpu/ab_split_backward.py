"""One P2-level DropIT conv's backward (quant 4-bit, 2 x 256 x 200 x 200, fp32, CPU), its
quant pack rebuilt an image at a time (`Strategy.unpack_part`) against the whole batch at once
(unpack_part made to refuse), alternating in one process: seconds per backward, medians of 8.

    PYTHONPATH=. python docs/results/step_peak_bf16_cpu/ab_split_backward.py
"""

import statistics
import time

import torch
from torch import nn

from dropit_core import set_step, to_dropit
from dropit_core.layers.cache import InputCache

torch.set_num_threads(2)
torch.manual_seed(0)
conv = to_dropit(nn.Sequential(nn.Conv2d(256, 256, 3, padding=1)), "quant", bits=4)
x = torch.randn(2, 256, 200, 200)
by_image = InputCache.unpack_part


def backward_seconds(by_part: bool) -> float:
    InputCache.unpack_part = by_image if by_part else (lambda *a: None)
    conv.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    set_step(conv, 1)
    out = conv(xi)
    grad = torch.ones_like(out)
    start = time.perf_counter()
    out.backward(grad)
    return time.perf_counter() - start


for _ in range(2):  # warm
    backward_seconds(True)
    backward_seconds(False)
seconds: dict[bool, list[float]] = {True: [], False: []}
for _ in range(8):
    for by_part in (True, False):
        seconds[by_part].append(backward_seconds(by_part))
print("by part", statistics.median(seconds[True]), "whole", statistics.median(seconds[False]))
print(seconds)

"""One P2-level DropIT conv's backward (quant 4-bit, 2 x 256 x 200 x 200, fp32, CPU), its
quant pack rebuilt an image at a time (`Strategy.unpack_part`) against the whole batch at once
(unpack_part made to refuse), alternating in one process: seconds per backward, medians of 8.

    PYTHONPATH=. python docs/results/step_peak_bf16_cpu/ab_split_backward.py
"""

import time, torch, statistics
from torch import nn
from dropit_core import to_dropit, set_step, ops
torch.set_num_threads(2)
torch.manual_seed(0)
conv = to_dropit(nn.Sequential(nn.Conv2d(256, 256, 3, padding=1)), "quant", bits=4)
x = torch.randn(2, 256, 200, 200)
orig = ops.InputCache.unpack_part
def run(by_part):
    ops.InputCache.unpack_part = orig if by_part else (lambda *a: None)
    conv.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    set_step(conv, 1)
    out = conv(xi)
    g = torch.ones_like(out)
    t = time.perf_counter()
    out.backward(g)
    return time.perf_counter() - t
for _ in range(2): run(True); run(False)
res = {True: [], False: []}
for _ in range(8):
    for b in (True, False):
        res[b].append(run(b))
print("by part", statistics.median(res[True]), "whole", statistics.median(res[False]))
print(res)

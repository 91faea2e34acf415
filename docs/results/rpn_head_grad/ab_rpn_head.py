"""The RPN head's step (forward and backward) at the COCO recipe's sizes, with its map gradient
made once (the lean head's _ReadersInputGrad) and the old way (each predictor's, then summed),
alternating in one process; prints the medians and each run's peak of live tensors.

    PYTHONPATH=. python docs/results/rpn_head_grad/ab_rpn_head.py [--images 2] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from functools import partial
from unittest import mock

import torch

from dropit_core import set_step, to_dropit
from dropit_core.detection import forward
from dropit_core.detection.forward import LeanRPNHead
from tests.core.allocations import allocations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    base = LeanRPNHead(256, 3)
    levels = [
        torch.randn(args.images, 256, 200 >> i, 200 >> i).to(dtype).requires_grad_()
        for i in range(5)
    ]  # P2-P6 of 800 px images
    print(f"{args.images} images, {args.dtype}, torch threads {torch.get_num_threads()}")
    for name, dropit in (("plain", False), ("quant_4bit", True)):
        head = copy.deepcopy(base)
        if dropit:
            to_dropit(head, strategy="quant", bits=4)
            set_step(head, 0)

        def step(head=head) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
                logits, boxes = head(levels)
            sum(o.float().sum() for o in logits + boxes).backward()
            for x in levels:
                x.grad = None
            head.zero_grad(set_to_none=True)

        def with_old(step=step) -> None:
            with mock.patch.object(forward, "_one_input_grad", lambda *a: False):
                step()

        runs = {"once": step, "summed": with_old}
        peaks = {k: allocations(partial(fn))[1].peak / 2**20 for k, fn in runs.items()}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for fn in runs.values():
            fn()  # warm
        for _ in range(args.rounds):
            for k, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - start)
        for k in runs:
            med = statistics.median(times[k])
            print(
                f"{name:11s} {k:7s} step {med:.4f} s (median of {args.rounds}), "
                f"peak {peaks[k]:.1f} MB of tensors"
            )


if __name__ == "__main__":
    main()

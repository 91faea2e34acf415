"""The step peak of the GPU table's setting on the CPU (8 images of 800 px, bf16) with a conv's
weight-gradient chunks capped at each CHUNK_BYTES candidate, one candidate after another in one
process (memory only: `--repeats 0`, which work beside it leaves exact).

    PYTHONPATH=. python docs/results/chunk_bytes/ab_chunk_bytes.py 8 32 64 128 > OUT.log
"""

from __future__ import annotations

import sys

from dropit_core.layers import functions
from instruments.commands.bench import main as bench
from instruments.commands.bench import restart_measuring

# the baseline does not chunk: measured once, with the first candidate
SETTINGS = ["quant_4bit", "checkpoint_stages_quant_4bit"]


def main() -> None:
    restart_measuring()
    for k, mib in enumerate(int(a) for a in sys.argv[1:]):
        functions.CHUNK_BYTES["cpu"] = mib << 20  # the CPU proxy of the GPU budget
        print(f"== CHUNK_BYTES {mib} MiB", flush=True)
        argv = ["--amp", "bf16", "--image-size", "800", "--images", "8", "--draws", "1"]
        argv += ["--repeats", "0", "--settings", *(["baseline"] if k == 0 else []), *SETTINGS]
        argv += ["--json", f"docs/results/chunk_bytes/bench_{mib}mib.json"]
        bench(argv)


if __name__ == "__main__":
    main()

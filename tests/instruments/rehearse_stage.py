"""Run one of tools/gpu_session.sh's commands as its CPU rehearsal does (``--rehearse``):
``python tests/instruments/rehearse_stage.py tools/bench.py ARGS...``.

The command runs unchanged, in this process, except that every bench model is made small: the
recipe (instruments.measure.workload.recipe_config, read by every instrument that builds the
bench's model) becomes ResNet-18 with the narrow widths of the tests (tests/helpers.py's
NARROW_BENCH) and 32 sampled RoIs per image, and the pooler bench pools 16 and 4 RoIs per image
at 16 channels. Sizes only: the settings, flags, files and writers are the lease's own.
"""

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from instruments.measure import pooler_bench, workload  # noqa: E402  (after the path is set)
from rcnn_dropit.config import with_overrides  # noqa: E402
from tests.helpers import NARROW_BENCH  # noqa: E402

recipe = workload.recipe_config


def narrow(scratch, image_size, rois_per_image=512, backbone="resnet50", heads="v1"):
    """The bench's recipe at the rehearsal's size."""
    small = recipe(scratch, image_size, min(rois_per_image, 32), "resnet18", heads)
    return with_overrides(small, NARROW_BENCH, source="rehearsal")


if __name__ == "__main__":
    # Before the script imports anything that reads the recipe by name: they all get this one.
    workload.recipe_config = narrow
    pooler_bench.CHANNELS = 16
    pooler_bench.POOLERS = {"box": (7, 16), "mask": (14, 4)}
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")

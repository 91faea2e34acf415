"""The COCO path of docs/training.md: its Triton check says which path DropIT's packs take."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from dropit_core import configure, reset_settings
from dropit_core.backends import dispatch
from tests.helpers import REPO

SECTION = "## From COCO on 8 GPUs to a table of AP, memory and speed"


def triton_check() -> str:
    """The Python code of the section's `python -c "..."` Triton check."""
    text = (REPO / "docs/training.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    found = re.search(r'python -c "(.*?)"\n', section, re.DOTALL)
    assert found, "no python -c check in the section"
    return found.group(1).replace("\\\n", "")  # the shell's line continuation


@pytest.mark.parametrize("mode, printed", [("triton", "triton"), ("eager", "eager")])
def test_the_documented_triton_check_names_the_path_the_packs_take(mode, printed) -> None:
    # On a GPU node the check asks about a CUDA tensor; here a CPU one, with the path forced as
    # DROPIT_KERNELS would force it: the check reads the same decision the packs do.
    if mode == "triton" and not dispatch.triton_available():
        pytest.skip("triton is not installed")
    code = triton_check()
    assert "pack_backend('cuda')" in code
    out = io.StringIO()
    configure(kernels=mode)
    try:
        with contextlib.redirect_stdout(out):
            exec(code.replace("pack_backend('cuda')", "pack_backend('cpu')"), {})
    finally:
        reset_settings()
    assert out.getvalue() == f"DropIT packs on CUDA: {printed}\n"

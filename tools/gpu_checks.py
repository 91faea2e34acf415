"""The instrument instruments/commands/gpu_checks.py, run from a checkout (`make setup` first).

The instruments are not installed with the package: this script puts the checkout on the path.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from instruments.commands.gpu_checks import main  # noqa: E402  (after the path is set)

if __name__ == "__main__":
    sys.exit(main())

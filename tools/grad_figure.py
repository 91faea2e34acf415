"""`dropit-grad-figure` run from a checkout (the package installed: `make setup`).

The command is rcnn_dropit/commands/grad_figure.py.
"""

import sys

from rcnn_dropit.commands.grad_figure import main

if __name__ == "__main__":
    sys.exit(main())

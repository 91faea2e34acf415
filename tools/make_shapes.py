"""`dropit-make-shapes` run from a checkout (the package installed: `make setup`).

The command is rcnn_dropit/commands/make_shapes.py.
"""

import sys

from rcnn_dropit.commands.make_shapes import main

if __name__ == "__main__":
    sys.exit(main())

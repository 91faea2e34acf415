"""`dropit-infer` run from a checkout (the package installed: `make setup`).

The command is rcnn_dropit/commands/infer.py.
"""

import sys

from rcnn_dropit.commands.infer import main

if __name__ == "__main__":
    sys.exit(main())

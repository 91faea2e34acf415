"""`dropit-grad-groups` run from a checkout (the package installed: `make setup`).

The command is rcnn_dropit/commands/grad_groups.py.
"""

import sys

from rcnn_dropit.commands.grad_groups import main

if __name__ == "__main__":
    sys.exit(main())

"""`dropit-study` run from a checkout (the package installed: `make setup`).

The command is rcnn_dropit/commands/study.py.
"""

import sys

from rcnn_dropit.commands.study import main

if __name__ == "__main__":
    sys.exit(main())

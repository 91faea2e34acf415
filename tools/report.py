"""`dropit-report` run from a checkout (the package installed: `make setup`).

The command is rcnn_dropit/commands/report.py.
"""

import sys

from rcnn_dropit.commands.report import main

if __name__ == "__main__":
    sys.exit(main())

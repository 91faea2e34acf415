"""`dropit-bench` run from a checkout (the package installed: `make setup`).

The command is rcnn_dropit/commands/bench.py.
"""

import sys

from rcnn_dropit.commands.bench import cli

if __name__ == "__main__":
    sys.exit(cli())

"""``python -m consumers MODULE ...``: the same as ``conveyor run MODULE ...``."""

import sys

from broker.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))

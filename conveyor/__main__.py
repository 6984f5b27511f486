"""``python -m conveyor``: the ``conveyor`` command; with no subcommand it starts a broker."""

import sys

from conveyor.broker.cli.main import COMMANDS, build_parser, main

if __name__ == "__main__":
    argv = sys.argv[1:]
    build_parser()
    if not argv or argv[0] not in (*COMMANDS, "--version", "-h", "--help"):
        argv = ["broker", *argv]
    sys.exit(main(argv))

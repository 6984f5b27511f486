"""``python -m broker``: start a broker (``python -m broker tail ...`` runs any subcommand)."""

import sys

from broker.cli import COMMANDS, build_parser, main

if __name__ == "__main__":
    argv = sys.argv[1:]
    build_parser()
    if not argv or argv[0] not in (*COMMANDS, "--version"):
        argv = ["broker", *argv]
    sys.exit(main(argv))

"""What every job shares: broker and Spark options on the command line, and the session."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from conveyor.broker.config.addresses import DEFAULT_BROKER
from conveyor.pipeline.session import get_session
from pyspark.sql import SparkSession

__all__ = ["job_parser", "session_from"]


def job_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--broker",
        default=os.environ.get("CONVEYOR_BROKER", DEFAULT_BROKER),
        help="broker address, reachable from every executor (env CONVEYOR_BROKER; default %(default)s)",
    )
    parser.add_argument(
        "--master",
        default=None,
        help="Spark master when run with python -m (default local[*]); spark-submit's own --master wins otherwise",
    )
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark settings")
    return parser


def session_from(args: argparse.Namespace, app_name: str) -> SparkSession:
    conf = dict(item.split("=", 1) for item in args.conf)
    return get_session(app_name, args.master, conf)


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    for item in args.conf:
        if "=" not in item:
            parser.error(f"--conf takes KEY=VALUE, not {item!r}")
    return args

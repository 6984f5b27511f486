"""``conveyor run MODULE[:ATTR] ...``: the consumer runner on the command line."""

from __future__ import annotations

import argparse
import logging

from conveyor.broker.cli.main import CLIENT_OPTIONS, client_options, command
from conveyor.broker.config.broker_settings import LOG_LEVELS
from conveyor.broker.config.options import Option, nonempty
from conveyor.broker.config.sources import add_options

RUN_OPTIONS = [
    *CLIENT_OPTIONS,
    Option("metrics-port", 9101, "port for /metrics and /healthz (-1: off)", int, minimum=-1, maximum=65535),
    Option("metrics-bind", "127.0.0.1", "address for the metrics HTTP server", nonempty),
    Option("concurrency", 0, "lanes per consumer, overriding each @consumer (0: as declared)", int, minimum=0),
    Option("graceful-timeout", 15.0, "seconds to finish in-flight messages on SIGTERM", float, minimum=0),
    Option(
        "unhealthy-after", 30.0, "seconds without the broker before /healthz says UNHEALTHY (503)", float, minimum=0
    ),
    Option("log-level", "INFO", "DEBUG, INFO, WARNING, ERROR or CRITICAL", choices=LOG_LEVELS),
]


def _setup(parser: argparse.ArgumentParser) -> None:
    add_options(parser, RUN_OPTIONS)
    parser.add_argument("modules", nargs="+", metavar="MODULE[:ATTR]", help="modules holding @consumer functions")


@command("run", "run the @consumer functions of some modules", _setup)
def cmd_run(args: argparse.Namespace) -> int:
    from conveyor.consumers.loader import load_consumers
    from conveyor.consumers.runner import Runner

    opts = client_options(args, "run", RUN_OPTIONS)
    logging.basicConfig(level=opts["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    consumers = load_consumers(args.modules)
    runner = Runner(
        consumers,
        broker=opts["broker"],
        concurrency=opts["concurrency"] or None,
        graceful_timeout=opts["graceful_timeout"],
        metrics_port=opts["metrics_port"],
        metrics_bind=opts["metrics_bind"],
        unhealthy_after=opts["unhealthy_after"],
    )

    port = runner.metrics_server.port if runner.metrics_server else None
    metrics = f"http://{opts['metrics_bind']}:{port}/metrics" if port else "off"

    def ready(r: Runner) -> None:
        names = ", ".join(f"{c.name} ({c.topic}/{c.group})" for c in consumers)
        print(
            f"conveyor runner ready: {len(consumers)} consumer(s) on {opts['broker']}: {names} (metrics {metrics})",
            flush=True,
        )

    print(
        f"conveyor runner: {len(consumers)} consumer(s), connecting to {opts['broker']} (metrics {metrics})",
        flush=True,
    )
    code = runner.run(ready=ready)
    if runner.abandoned:
        print(
            f"conveyor runner stopped: {runner.abandoned} message(s) given back for redelivery, their handlers "
            f"still running after --graceful-timeout {opts['graceful_timeout']:g} s (exit {code})",
            flush=True,
        )
    else:
        print("conveyor runner stopped cleanly", flush=True)
    return code

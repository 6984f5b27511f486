"""``conveyor run MODULE[:ATTR] ...``: the consumer runner on the command line."""

from __future__ import annotations

import argparse

from conveyor.broker.cli.main import CLIENT_OPTIONS, client_options, command
from conveyor.broker.config.broker_settings import LOG_FORMATS, LOG_LEVELS
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
    Option(
        "default-start",
        "earliest",
        "where a new group starts when its @consumer names no start=: earliest or latest",
        choices=("earliest", "latest"),
    ),
    Option(
        "backlog-warning",
        10_000,
        "warn (and count) when a new group would read more messages than this from earliest (0: off)",
        int,
        minimum=0,
    ),
    Option("log-level", "INFO", "DEBUG, INFO, WARNING, ERROR or CRITICAL", choices=LOG_LEVELS),
    Option(
        "log-format",
        "text",
        "text, or json: one JSON object per line (with topic, group, offset...)",
        choices=LOG_FORMATS,
    ),
    Option(
        "log-config", "", "a logging.config.dictConfig file (.json, .toml, or .yaml with PyYAML): it decides everything"
    ),
    Option(
        "middleware",
        "",
        "middleware around every consumer, MODULE:ATTR[,MODULE:ATTR...] (a class, an instance or a list), "
        "outside the modules' own `middleware = [...]`; may be repeated",
        repeat=True,
    ),
]


def _setup(parser: argparse.ArgumentParser) -> None:
    add_options(parser, RUN_OPTIONS)
    parser.add_argument("modules", nargs="+", metavar="MODULE[:ATTR]", help="modules holding @consumer functions")


@command("run", "run the @consumer functions of some modules", _setup)
def cmd_run(args: argparse.Namespace) -> int:
    from conveyor.consumers.loader import load_consumers, load_middleware
    from conveyor.consumers.middleware import parse_specs, resolve
    from conveyor.consumers.runner import Runner
    from conveyor.monitoring.logs import announce, configure

    opts = client_options(args, "run", RUN_OPTIONS)
    configure(opts["log_level"], opts["log_format"], opts["log_config"])
    consumers = load_consumers(args.modules)
    middleware = [m for spec in parse_specs(opts["middleware"]) for m in resolve(spec)]
    middleware += load_middleware(args.modules)
    runner = Runner(
        consumers,
        broker=opts["broker"],
        concurrency=opts["concurrency"] or None,
        graceful_timeout=opts["graceful_timeout"],
        metrics_port=opts["metrics_port"],
        metrics_bind=opts["metrics_bind"],
        unhealthy_after=opts["unhealthy_after"],
        default_start=opts["default_start"],
        backlog_warning=opts["backlog_warning"],
        middleware=middleware,
    )

    port = runner.metrics_server.port if runner.metrics_server else None
    metrics = f"http://{opts['metrics_bind']}:{port}/metrics" if port else "off"

    def ready(r: Runner) -> None:
        names = ", ".join(f"{c.name} ({c.topic}/{c.group})" for c in consumers)
        announce(
            f"conveyor runner ready: {len(consumers)} consumer(s) on {opts['broker']}: {names} (metrics {metrics})"
        )

    announce(f"conveyor runner: {len(consumers)} consumer(s), connecting to {opts['broker']} (metrics {metrics})")
    code = runner.run(ready=ready)
    if runner.abandoned:
        announce(
            f"conveyor runner stopped: {runner.abandoned} message(s) given back for redelivery, their handlers "
            f"still running after --graceful-timeout {opts['graceful_timeout']:g} s (exit {code})"
        )
    else:
        announce("conveyor runner stopped cleanly")
    return code

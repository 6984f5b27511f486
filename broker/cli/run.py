"""``conveyor run MODULE[:ATTR] ...``: the consumer runner on the command line."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any

from conveyor.broker.cli.main import CLIENT_OPTIONS, client_options, command
from conveyor.broker.config.broker_settings import LOG_FORMATS, LOG_LEVELS
from conveyor.broker.config.options import Option, nonempty
from conveyor.broker.config.sources import add_options

from conveyor import exitcodes

RUN_OPTIONS = [
    *CLIENT_OPTIONS,
    Option("metrics-port", 9101, "port for /metrics and /healthz (-1: off)", int, minimum=-1, maximum=65535),
    Option("metrics-bind", "127.0.0.1", "address for the metrics HTTP server", nonempty),
    Option(
        "workers",
        1,
        "runner processes under one supervisor (a dead one is restarted; SIGTERM drains all); one metrics port for all",
        int,
        minimum=1,
        maximum=1024,
    ),
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
        "trace",
        "off",
        "console: print each OpenTelemetry span as a JSON line on stdout (needs opentelemetry-sdk); "
        "off: none configured here (a TracerProvider your code sets is used)",
        choices=("off", "console"),  # conveyor.consumers.tracing.TRACE_CHOICES
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
    from conveyor.consumers.supervisor import MULTIPROC_ENV, follow_supervisor, notify_ready, worker_role
    from conveyor.consumers.tracing import configure as configure_tracing
    from conveyor.consumers.worker_health import start_reporting
    from conveyor.monitoring.logs import announce, configure

    opts = client_options(args, "run", RUN_OPTIONS)
    configure(opts["log_level"], opts["log_format"], opts["log_config"])
    role = worker_role()
    if role is None and opts["workers"] > 1:
        return _supervise(args, opts)
    if role is not None:  # one of a supervisor's workers: it serves the metrics, through the multiprocess files
        if not follow_supervisor(role):
            return exitcodes.OK  # the supervisor is gone already
        opts["metrics_port"] = -1
    who = f"conveyor runner worker {role.index} (pid {os.getpid()})" if role else "conveyor runner"
    configure_tracing(opts["trace"])  # before the modules load, so their tracers find the provider
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

    reporting = threading.Event()
    if role is not None and os.environ.get(MULTIPROC_ENV):
        start_reporting(os.environ[MULTIPROC_ENV], runner.health, reporting)  # the supervisor's /healthz reads it
    port = runner.metrics_server.port if runner.metrics_server else None
    metrics = f"http://{opts['metrics_bind']}:{port}/metrics" if port else "off"

    def ready(r: Runner) -> None:
        names = ", ".join(f"{c.name} ({c.topic}/{c.group})" for c in consumers)
        announce(f"{who} ready: {len(consumers)} consumer(s) on {opts['broker']}: {names} (metrics {metrics})")
        if role is not None:
            notify_ready(role)

    announce(f"{who}: {len(consumers)} consumer(s), connecting to {opts['broker']} (metrics {metrics})")
    try:
        code = runner.run(ready=ready)
    finally:
        reporting.set()
    if runner.abandoned:
        announce(
            f"{who} stopped: {runner.abandoned} message(s) given back for redelivery, their handlers "
            f"still running after --graceful-timeout {opts['graceful_timeout']:g} s (exit {code})"
        )
    else:
        announce(f"{who} stopped cleanly")
    return code


def _supervise(args: argparse.Namespace, opts: dict[str, Any]) -> int:
    """``--workers N``: N workers started from this command line, under a supervisor (consumers/supervisor.py)."""
    from conveyor.consumers.supervisor import Supervisor
    from conveyor.monitoring.logs import announce

    workers = opts["workers"]
    supervisor = Supervisor(
        worker_command(args),
        workers,
        graceful_timeout=opts["graceful_timeout"],
        metrics_port=opts["metrics_port"],
        metrics_bind=opts["metrics_bind"],
    )
    port = supervisor.metrics_server.port if supervisor.metrics_server else None
    metrics = f"http://{opts['metrics_bind']}:{port}/metrics" if port else "off"
    modules = " ".join(args.modules)

    def ready(s: Supervisor) -> None:
        announce(f"conveyor runner ready: {workers} workers of {modules} on {opts['broker']} (metrics {metrics})")

    announce(f"conveyor runner: starting {workers} workers of {modules} (metrics {metrics})")
    code = supervisor.run(ready=ready)
    if code == exitcodes.OK:
        announce(f"conveyor runner stopped cleanly: {workers} workers drained")
    elif supervisor.boot_error is not None:
        announce(f"conveyor runner stopped: a worker could not start, its error is above (exit {code})")
    else:
        announce(
            f"conveyor runner stopped: {supervisor.died} worker death(s) during the run, {supervisor.killed} killed "
            f"at the stop, {supervisor.restarts} restart(s) (exit {code})"
        )
    return code


def worker_command(args: argparse.Namespace) -> list[str]:
    """The argv of one worker: this command again with the flags it was given (variables and the --config
    file reach the worker as they reached this process); the worker finds its role in CONVEYOR_WORKER."""
    argv = [sys.executable, "-m", "conveyor", "run"]
    if getattr(args, "config", None):
        argv += ["--config", args.config]
    for opt in RUN_OPTIONS:
        raw = getattr(args, opt.dest, None)
        if raw is None:
            continue
        if opt.flag:
            argv.append(f"--{opt.name}" if raw else f"--no-{opt.name}")
        elif opt.repeat:
            for item in raw:
                argv += [f"--{opt.name}", str(item)]
        else:
            argv += [f"--{opt.name}", str(raw)]
    return [*argv, "--", *args.modules]

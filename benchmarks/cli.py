"""``conveyor bench``: run scenarios from JSON against Conveyor and its peers, write an HTML report."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from conveyor.errors import ConfigError

DEFAULT_CONFIG = Path(__file__).with_name("default.json")
SCALE_OUT_CONFIG = Path(__file__).with_name("scaleout.json")


def _setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="", metavar="JSON", help="scenarios (default: benchmarks/default.json)")
    parser.add_argument(
        "--scale-out",
        action="store_true",
        help="the scale-out run: 1, 2 and 4 partitions on as many brokers, CPU per stored message per broker "
        "(also against one broker paced to the same per-broker rate) and a projection for 8 and 32 cores "
        "(benchmarks/scaleout.json; needs etcd)",
    )
    parser.add_argument("--report", metavar="HTML", help="write the HTML report here")
    parser.add_argument("--json", metavar="PATH", help="write every number as JSON here")
    parser.add_argument("--broker", default="", metavar="ADDR", help="use this running Conveyor broker")
    parser.add_argument(
        "--systems",
        default="",
        metavar="LIST",
        help="comma-separated: conveyor, redis, nats, rabbitmq, forwarder (the bare pyzmq floor), or a variant "
        "like redis:always, nats:r3 or forwarder:fsync (default: all found)",
    )
    parser.add_argument("--scenarios", default="", metavar="LIST", help="comma-separated scenario names to run")
    parser.add_argument("--quick", action="store_true", help="each scenario's smaller 'quick' form (a 1-2 minute run)")
    parser.add_argument("--dir", metavar="DIR", help="where servers keep their data (default: the temp dir)")
    parser.add_argument(
        "--py-spy",
        metavar="DIR",
        help=(
            "profile every Python process of each run (broker, producers, consumers) with py-spy --gil "
            "(samples holding the GIL: CPU in Python) into DIR: raw stacks per process and DIR/summary.txt"
        ),
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run everything N times, interleaved, and report each run's median (p99 for paced scenarios)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--compare",
        metavar="OLD.json",
        help="after the run, print new/old ratios (throughput, p50, p99) for every scenario and variant also in "
        "OLD.json (an earlier --json), flagging regressions",
    )
    parser.add_argument(
        "--regression-threshold",
        type=float,
        default=10.0,
        metavar="PCT",
        help="with --compare: a change worse than this many percent is a regression (default 10)",
    )
    parser.add_argument(
        "--fail-on-regression",
        action="store_true",
        help="with --compare: exit 1 when there is a regression (default: the comparison is informational)",
    )


HELP = "run benchmark scenarios and write a report"


def setup(parser: argparse.ArgumentParser) -> None:
    _setup(parser)


def run(args: argparse.Namespace) -> int:
    from conveyor.benchmarks.suite.report import render_html
    from conveyor.benchmarks.suite.runner import Progress, run_bench
    from conveyor.benchmarks.suite.scenario import load_config
    from conveyor.benchmarks.suite.summary import markdown_table

    if args.repeat < 1:
        print("conveyor bench: --repeat must be at least 1", file=sys.stderr)
        return 2
    if args.scale_out and args.config:
        print(
            "conveyor bench: --scale-out runs benchmarks/scaleout.json; give it or --config, not both", file=sys.stderr
        )
        return 2
    old: dict[str, Any] | None = None
    if args.compare:
        try:
            old = json.loads(Path(args.compare).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--compare {args.compare}: {exc}", path=args.compare) from None
    args.config = args.config or str(SCALE_OUT_CONFIG if args.scale_out else DEFAULT_CONFIG)
    try:
        config = load_config(args.config, quick=args.quick)
    except (OSError, ValueError, TypeError) as exc:  # a wrong scenario file is a CONFIG_ERROR, not a traceback
        raise ConfigError(f"--config {args.config}: {exc}", path=args.config) from None
    if args.scenarios:
        keep = {s.strip() for s in args.scenarios.split(",") if s.strip()}
        missing = keep - {s.name for s in config.scenarios}
        if missing:
            print(f"conveyor bench: unknown scenarios {sorted(missing)}", file=sys.stderr)
            return 2
        config = type(config)(tuple(s for s in config.scenarios if s.name in keep), config.settings, config.source)
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()] or None
    progress = Progress(0, enabled=not args.no_progress)

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)  # servers and client processes are stopped on the way out
    signal.signal(signal.SIGINT, interrupted)
    try:
        report: dict[str, Any] = run_bench(
            config,
            wanted=wanted,
            broker=args.broker,
            progress=progress,
            workdir=args.dir,
            profile=Path(args.py_spy) if args.py_spy else None,
            repeat=args.repeat,
        )
    except ValueError as exc:
        print(f"conveyor bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nconveyor bench: interrupted; servers stopped", file=sys.stderr)
        return 130
    report["quick"] = args.quick
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.report:
        Path(args.report).write_text(render_html(report))
    print(markdown_table(report))
    if args.report:
        print(f"\nreport: {args.report}", file=sys.stderr)
    if args.py_spy:
        _write_profile_summary(Path(args.py_spy))
    ok = all(r.get("ok") for r in report["results"])
    if old is not None:
        from conveyor.benchmarks.suite.compare import compare, comparison_table

        threshold = args.regression_threshold / 100
        rows = compare(report, old, threshold)
        print("\n" + comparison_table(rows, threshold, args.compare))
        if args.fail_on_regression and any(r.regressions for r in rows):
            ok = False
    return 0 if ok else 1


def _write_profile_summary(directory: Path) -> None:
    """Every profiled process's top functions, in one file beside py-spy's raw stacks."""
    from conveyor.benchmarks.suite.profile import write_summary

    summary, processes = write_summary(directory)
    print(f"profiles: {summary} ({processes} processes)", file=sys.stderr)

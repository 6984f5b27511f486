"""Log lines for machines: one JSON object per line, and the message context the runner's lines carry.

``--log-format json`` makes every line of ``conveyor broker`` and ``conveyor run``
(their log records and their ready/stopped announcements) one JSON object:
``time``, ``level``, ``logger``, ``message`` and, where known, ``topic``,
``group``, ``partition``, ``offset``, ``attempt``, ``trace_id``, ``span_id``, ``exception``.
``--log-config FILE`` hands the whole logging setup to ``logging.config.dictConfig``
(a JSON, TOML or, with PyYAML installed, YAML file); ``JsonFormatter`` can be named there.

The runner knows which message a lane is handling; it says so with
``handling(consumer, messages)``, a context variable set around each handler
call (one ``ContextVar.set``: nothing is decoded then). A log record made
while it is set, by the runner or by the handler's own ``logging`` calls,
gets the message's fields when it is created, from the record factory that
``configure`` installs; its fields are worked out only when the record is
formatted (the headers read then, for the trace id). Fields given with
``extra=`` win over the context.

When an OpenTelemetry span is current as a record is made (the runner's
``process <topic>`` span around a handler, or any span of the program's own),
the record carries its ``trace_id`` and ``span_id`` (hex, as OpenTelemetry
shows them); without one, a handled message's ``trace_id`` is read from its
``traceparent`` header. Nothing of OpenTelemetry is imported here: the span is
looked up only if the program has imported ``opentelemetry.trace`` itself.
"""

from __future__ import annotations

import json
import logging
import logging.config
import sys
import threading
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from conveyor.errors import ConfigError

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELDS = (
    "topic",
    "group",
    "partition",
    "offset",
    "attempt",
    "trace_id",
    "span_id",
)  # in this order, after the four always there

# (consumer, messages) of the handler call running in this thread or task; None outside handlers.
_handling: ContextVar[Cursor | None] = ContextVar("conveyor_handling", default=None)
_format = "text"  # of the announcements (``announce``): what ``configure`` chose


# --- pure: a record's fields, a line ----------------------------------------------------------


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The JSON object of one record: the four fields always there, then those known, then the error."""
    out: dict[str, Any] = {
        "time": iso_time(record.created),
        "level": record.levelname,
        "logger": record.name,
        "message": record.getMessage(),
    }
    context = getattr(record, CONTEXT_ATTR, None)
    known = message_fields(*context) if context is not None else {}
    span = getattr(record, SPAN_ATTR, None)
    if span is not None:  # the current span's ids beat a header's trace id
        known["trace_id"], known["span_id"] = span
    for name in (*FIELDS, "batch"):
        value = getattr(record, name, None)  # extra= wins over the handled message's
        if value is None:
            value = known.get(name)
        if value is not None:
            out[name] = value
    if record.exc_info and record.exc_info[0] is not None:
        out["exception"] = logging.Formatter().formatException(record.exc_info)
    if record.stack_info:
        out["stack"] = record.stack_info
    return out


def iso_time(created: float) -> str:
    """``2026-11-27T10:41:50.123Z``: UTC, milliseconds, sortable as text."""
    return datetime.fromtimestamp(created, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def json_line(fields: Mapping[str, Any]) -> str:
    """One line, whatever the values hold (newlines are escaped; what JSON cannot hold becomes its str)."""
    return json.dumps(fields, ensure_ascii=False, default=str)


def trace_id(headers: Mapping[str, Any] | None) -> str | None:
    """The trace id of a W3C ``traceparent`` header (``00-<32 hex>-<16 hex>-<2 hex>``), or None."""
    value = (headers or {}).get("traceparent")
    if not isinstance(value, str):
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return parts[1].lower()


def message_fields(consumer: Any, messages: Sequence[Any]) -> dict[str, Any]:
    """What a log line says about the message(s) being handled: a batch names its first message and ``batch``."""
    if not messages:
        return {"topic": getattr(consumer, "topic", None), "group": getattr(consumer, "group", None)}
    first = messages[0]
    fields = {
        "topic": first.topic,
        "group": getattr(consumer, "group", None),
        "partition": first.partition,
        "offset": first.offset,
        "attempt": max(m.attempt for m in messages),
        "trace_id": trace_id(_headers(first)),
    }
    if len(messages) > 1:
        fields["batch"] = len(messages)
    return fields


def _headers(message: Any) -> Mapping[str, Any] | None:
    try:
        headers = message.headers
    except Exception:  # a record that does not decode: its log line goes out without a trace id
        return None
    return headers if isinstance(headers, Mapping) else None


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line (usable from a ``--log-config`` file: ``"()": ...JsonFormatter``)."""

    def format(self, record: logging.LogRecord) -> str:
        return json_line(record_fields(record))


# --- the runner's context ----------------------------------------------------------------------


class Cursor:
    """What a lane is handling now: set once per chunk (a ``ContextVar.set``), moved per message by one
    attribute store (``current``: a message, or a batch as a list), so the per-message cost stays tiny."""

    __slots__ = ("consumer", "current")

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.current: Any = None


@contextmanager
def handling(consumer: Any, messages: Sequence[Any]) -> Iterator[Cursor]:
    """Log records made inside carry these messages' topic, group, partition, offset, attempt and trace id."""
    token, cursor = enter_handling(consumer)
    cursor.current = list(messages)
    try:
        yield cursor
    finally:
        leave_handling(token)


def enter_handling(consumer: Any) -> tuple[Token[Any], Cursor]:
    """A cursor for this thread or task: the lane sets ``cursor.current`` per call (undo with ``leave_handling``)."""
    cursor = Cursor(consumer)
    return _handling.set(cursor), cursor


def leave_handling(token: Token[Any]) -> None:
    _handling.reset(token)


CONTEXT_ATTR = "conveyor_handling"  # a record's (consumer, messages), if made inside a handler call
SPAN_ATTR = "conveyor_span"  # a record's (trace id, span id), if an OpenTelemetry span was current


def current_span_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the OpenTelemetry span current in this thread or task, or None.

    Only if the program imported ``opentelemetry.trace`` (one dictionary look-up otherwise)."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    try:
        context = trace.get_current_span().get_span_context()
    except Exception:  # a log line must never fail for tracing's sake
        return None
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


_installed = False


def install_record_factory() -> None:
    """Records get the handled message's fields when made (in the handler's own thread or task). Once."""
    global _installed
    if _installed:
        return
    base = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = base(*args, **kwargs)
        span = current_span_ids()
        if span is not None:
            setattr(record, SPAN_ATTR, span)
        cursor = _handling.get()
        if cursor is not None and cursor.current is not None:
            # kept aside, not as fields (extra= may name them, and refuses to overwrite); the lane moves on
            current = cursor.current
            setattr(record, CONTEXT_ATTR, (cursor.consumer, current if isinstance(current, list) else [current]))
        return record

    logging.setLogRecordFactory(factory)
    _installed = True


# --- setup ----------------------------------------------------------------------------------


def configure(level: str = "INFO", log_format: str = "text", config_file: str = "") -> None:
    """The process's logging: ``config_file`` (dictConfig) if given, else one stderr handler in ``log_format``.

    With a file, the file decides everything (levels, handlers, formats); ``level`` and ``log_format`` are
    not applied to records, and the announcements stay text unless ``log_format`` is json.
    """
    global _format
    if log_format not in FORMATS:
        raise ConfigError(f"--log-format must be one of {', '.join(FORMATS)}, not {log_format!r}")
    install_record_factory()
    _format = log_format
    if config_file:
        config = load_config(config_file)
        try:
            logging.config.dictConfig(config)
        except (ValueError, TypeError, AttributeError, ImportError) as exc:
            raise ConfigError(f"--log-config {config_file}: {exc}", path=config_file) from None
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings.warn lines are log lines too, so JSON as well
    if log_format == "json":
        _log_uncaught()


def _log_uncaught() -> None:
    """An exception nobody caught (in the main thread or another) is a JSON line too, not a bare traceback."""
    log = logging.getLogger("conveyor")

    def main_hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        log.critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        exc_info = (args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)
        log.critical("uncaught %s in thread %s: %s", args.exc_type.__name__, name, args.exc_value, exc_info=exc_info)

    sys.excepthook = main_hook
    threading.excepthook = thread_hook


def load_config(path: str) -> dict[str, Any]:
    """A dictConfig dictionary from ``.json``, ``.toml`` or ``.yaml``/``.yml`` (YAML needs PyYAML)."""
    suffix = Path(path).suffix.lower()
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"--log-config {path}: not found", path=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--log-config {path}: cannot be read ({exc})", path=path) from None
    try:
        if suffix == ".json":
            config = json.loads(text)
        elif suffix == ".toml":
            config = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            config = _yaml(path, text)
        else:
            raise ConfigError(f"--log-config {path}: name a .json, .toml or .yaml file", path=path)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--log-config {path}: not valid {suffix[1:].upper()}: {exc}", path=path) from None
    if not isinstance(config, dict):
        raise ConfigError(f"--log-config {path}: must hold a table (dictConfig's dictionary)", path=path)
    config.setdefault("version", 1)
    # dictConfig's default (True) disables every logger made before it, conveyor.runner's and the handler
    # modules' among them: a file that does not say so would silence the runner
    config.setdefault("disable_existing_loggers", False)
    return config


def _yaml(path: str, text: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"--log-config {path}: YAML needs PyYAML (pip install pyyaml), or use .json/.toml") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--log-config {path}: not valid YAML: {exc}", path=path) from None


def announce(message: str, *, level: str = "INFO", stream: TextIO | None = None, logger: str = "conveyor") -> None:
    """A command's own line (ready, stopped, an error it exits with) on stdout, or ``stream``: the text as it
    is, or in json mode one JSON object like a log record's."""
    if _format == "json":
        now = datetime.now(UTC).timestamp()
        line = json_line({"time": iso_time(now), "level": level, "logger": logger, "message": message})
    else:
        line = message
    print(line, file=stream or sys.stdout, flush=True)

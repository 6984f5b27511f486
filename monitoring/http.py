"""``/metrics``, ``/healthz``, ``/livez`` and ``/readyz`` over HTTP, in a daemon thread.

Health is JSON ``{"status": "HEALTHY"|"DEGRADED"|"UNHEALTHY", "checks": {...}}``
with 503 when unhealthy; ``/livez`` and ``/readyz`` are the Kubernetes probes
(``monitoring.health`` says what each means). Every path answers HEAD as
well as GET: the same status and headers, no body.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from conveyor.monitoring.bounded_http import BoundedHandler, BoundedHTTPServer
from conveyor.monitoring.health import UNHEALTHY, HealthCheck, ready, safely
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from conveyor.errors import ConfigError

SHUTDOWN_POLL_SECONDS = 0.1
NOT_FOUND = b"not found: try /metrics, /healthz, /livez or /readyz\n"

Answer = tuple[int, str, bytes]


def _json(ok: bool, body: dict[str, Any]) -> Answer:
    return (200 if ok else 503), "application/json", json.dumps(body).encode()


def _handler(routes: dict[str, Callable[[], Answer]]) -> type[BoundedHandler]:
    class Handler(BoundedHandler):
        def do_GET(self) -> None:  # http.server names handlers this way
            self._answer(with_body=True)

        def do_HEAD(self) -> None:
            self._answer(with_body=False)

        def _answer(self, *, with_body: bool) -> None:
            route = routes.get(self.path.split("?", 1)[0])
            status, content_type, body = route() if route else (404, "text/plain", NOT_FOUND)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    return Handler


def _routes(
    registry: CollectorRegistry, health: HealthCheck, live: HealthCheck | None, readiness: HealthCheck | None
) -> dict[str, Callable[[], Answer]]:
    def healthz() -> Answer:
        found = safely(health)
        return _json(found.get("status") != UNHEALTHY, found)

    def livez() -> Answer:
        found = safely(live) if live else {"live": True}
        return _json(bool(found.get("live")), found)

    def readyz() -> Answer:
        found = safely(readiness) if readiness else ready(safely(health), serving=True)
        return _json(bool(found.get("ready")), found)

    def metrics() -> Answer:
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

    return {"/metrics": metrics, "/healthz": healthz, "/health": healthz, "/livez": livez, "/readyz": readyz}


class MetricsServer:
    """The HTTP endpoints of one process; ``live`` and ``ready`` default to "the server answers" and "not UNHEALTHY"."""

    def __init__(
        self,
        registry: CollectorRegistry,
        health: HealthCheck,
        *,
        host: str,
        port: int,
        live: HealthCheck | None = None,
        ready: HealthCheck | None = None,
    ) -> None:
        try:
            self.httpd = BoundedHTTPServer((host, port), _handler(_routes(registry, health, live, ready)))
        except OSError as exc:  # the port is taken, most often: say so, not with a traceback
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror} "
                "(--metrics-port 0 for any free port, -1 for none)",
                port=port,
            ) from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self._serve, name="conveyor-metrics", daemon=True)

    def _serve(self) -> None:
        # shutdown() waits for the next poll: 0.1 s instead of the default 0.5 s makes every stop faster.
        self.httpd.serve_forever(poll_interval=SHUTDOWN_POLL_SECONDS)

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread.is_alive():  # shutdown() waits for serve_forever(): it would hang if never started
            self.httpd.shutdown()
        self.httpd.server_close()

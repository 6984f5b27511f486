"""``/metrics`` and ``/healthz`` over HTTP, in a daemon thread.

Health is JSON ``{"status": "HEALTHY"|"DEGRADED"|"UNHEALTHY", "checks": {...}}``
with 503 when unhealthy, so load balancers and Kubernetes probes can use it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from broker.errors import ConfigError

HealthCheck = Callable[[], dict[str, Any]]
SHUTDOWN_POLL_SECONDS = 0.1


def _handler(registry: CollectorRegistry, health: HealthCheck) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server names handlers this way
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path in ("/healthz", "/health"):
                report = _report(health)
                status = 503 if report.get("status") == "UNHEALTHY" else 200
                self._send(status, "application/json", json.dumps(report).encode())
            else:
                self._send(404, "text/plain", b"not found: try /metrics or /healthz\n")

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    return Handler


def _report(health: HealthCheck) -> dict[str, Any]:
    """A health check that fails is itself a finding: UNHEALTHY, with the error, not a dropped connection."""
    try:
        return health()
    except Exception as exc:
        return {"status": "UNHEALTHY", "checks": {"health_check_error": f"{type(exc).__name__}: {exc}"}}


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, health: HealthCheck, *, host: str, port: int) -> None:
        try:
            self.httpd = ThreadingHTTPServer((host, port), _handler(registry, health))
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

"""A tiny topology registry: which parent each broker node mirrors from.

``conveyor registry --topology topology.json`` serves a JSON document::

    {"nodes": {"root": {"role": "root"},
               "l2-eu": {"role": "L2", "parent": "tcp://10.0.0.1:5555"},
               "l3-paris": {"role": "L3", "parent": "tcp://10.0.1.1:5555"}}}

at ``/topology`` (all of it) and ``/nodes/<name>`` (one node). A broker
started with ``--registry URL --node NAME`` reads its parent from there,
re-reads it periodically, and follows a change without losing offsets
(every level holds the same offsets, so the new parent continues where
the old one left off). The file is re-read on every request, so editing it
is how an operator moves a node.
"""

from __future__ import annotations

import difflib
import json
import logging
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.broker.config.addresses import check_address
from conveyor.monitoring.bounded_http import BoundedHandler, BoundedHTTPServer

from conveyor.errors import ConfigError

log = logging.getLogger("conveyor.registry")


class RegistryWatch:
    """Polls the registry in a daemon thread; the broker loop reads ``parent``."""

    def __init__(self, url: str, node: str, *, interval: float, wake: Callable[[], None]) -> None:
        self.url = url.rstrip("/")
        self.node = node
        self.interval = interval
        self.wake = wake
        self.parent = ""
        self.role = ""
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-registry", daemon=True)

    def read_parent(self) -> str:
        try:
            with urllib.request.urlopen(f"{self.url}/nodes/{self.node}", timeout=5) as response:
                entry = json.loads(response.read())
            parent = str(entry.get("parent") or "")
            if parent:
                check_address(parent)  # a typo in the registry must not reach the mirror's connect
            self.parent = parent
            self.role = str(entry.get("role") or "")
            self.error = ""
        except (OSError, ValueError, ConfigError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("registry %s unreadable: %s", self.url, self.error)
        return self.parent

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            before = self.parent
            if self.read_parent() != before:
                self.wake()


def _handler(path: Path) -> type[BoundedHandler]:
    class Handler(BoundedHandler):
        def do_GET(self) -> None:  # http.server names handlers this way
            try:
                topology = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                self._send(500, {"error": f"topology unreadable: {exc}"})
                return
            nodes = topology.get("nodes", {})
            if self.path.rstrip("/") in ("", "/topology"):
                self._send(200, topology)
            elif self.path.startswith("/nodes/") and self.path[7:] in nodes:
                self._send(200, {"name": self.path[7:], **nodes[self.path[7:]]})
            else:
                self._send(404, {"error": f"unknown node or path {self.path}"})

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    return Handler


def serve(topology: str, *, host: str, port: int) -> BoundedHTTPServer:
    path = Path(topology)
    check_topology(path)  # fail early, naming every problem; edits later are read on each request
    return BoundedHTTPServer((host, port), _handler(path))  # idle or slow clients cannot hold threads for ever


NODE_KEYS = ("role", "parent")


def check_topology(path: Path) -> dict[str, Any]:
    """The topology file, if it is ``{"nodes": {NAME: {"role": ..., "parent": ADDR}}}``; else a ``ConfigError``.

    Every problem is one line (an unknown key gets a did-you-mean): a
    misspelt ``parent`` would otherwise leave a node without its parent, silently.
    """
    try:
        topology = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--topology {path}: cannot be read ({exc.strerror})", path=str(path)) from None
    except ValueError as exc:
        raise ConfigError(f"--topology {path}: not valid JSON ({exc})", path=str(path)) from None
    if not isinstance(topology, dict) or not isinstance(topology.get("nodes"), dict):
        raise ConfigError(f'--topology {path}: expected {{"nodes": {{NAME: {{"parent": ADDR}}}}}}', path=str(path))
    problems = [f"unknown key {k!r}{_did_you_mean(k, ['nodes'])}" for k in topology if k != "nodes"]
    for name, node in topology["nodes"].items():
        if not isinstance(node, dict):
            problems.append(f"node {name!r} must be an object, not {json.dumps(node)}")
            continue
        problems += [
            f"node {name!r}: unknown key {k!r}{_did_you_mean(k, NODE_KEYS)}" for k in node if k not in NODE_KEYS
        ]
        if "parent" in node:
            try:
                check_address(node["parent"])
            except ConfigError as exc:
                problems.append(f"node {name!r}: parent {exc.message}")
        if not isinstance(node.get("role", ""), str):
            problems.append(f"node {name!r}: role must be a string")
    if problems:
        raise ConfigError("\n".join(f"--topology {path}: {p}" for p in problems), path=str(path))
    return topology


def _did_you_mean(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""

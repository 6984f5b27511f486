"""An HTTP server that a slow or idle client cannot exhaust.

``ThreadingHTTPServer`` gives each connection a thread and waits for its
request for ever: sockets opened and left idle (or a client sending one
header line every few seconds) each hold a thread, without bound. Here
each connection has a deadline, ``REQUEST_DEADLINE_SECONDS`` after it was
accepted, for its whole request (not per read); at most
``MAX_CONNECTIONS`` are served at once, plus ``PROBE_SLOTS`` that answer
only the health probes, so a scrape storm does not fail a kubelet's
``/livez``; beyond that a connection gets 503 at once and is closed.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REQUEST_DEADLINE_SECONDS = 5.0  # from accept to the end of the request's headers
WRITE_TIMEOUT_SECONDS = 5.0  # sending the answer to a client that does not read
MAX_CONNECTIONS = 64
PROBE_SLOTS = 8
PROBE_PATHS = frozenset({"/livez", "/readyz", "/healthz", "/health"})
BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n"
    b"Connection: close\r\n\r\nbusy\n"
)


class _DeadlineReader(io.RawIOBase):
    """Reads a socket until a fixed deadline: a trickling client cannot stretch it, read by read."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request deadline passed")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class _Slot:
    __slots__ = ("deadline", "probes_only")

    def __init__(self, deadline: float, probes_only: bool) -> None:
        self.deadline = deadline
        self.probes_only = probes_only


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a deadline per connection and a bounded number of connections."""

    daemon_threads = True
    request_queue_size = 128  # the default 5 leaves a burst of connects waiting on SYN-ACK retransmits
    request_deadline = REQUEST_DEADLINE_SECONDS
    max_connections = MAX_CONNECTIONS
    probe_slots = PROBE_SLOTS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots: dict[Any, _Slot] = {}
        self._slots_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._slots_lock:
            active = len(self._slots)
            if active < self.max_connections + self.probe_slots:
                deadline = time.monotonic() + self.request_deadline
                self._slots[request] = _Slot(deadline, probes_only=active >= self.max_connections)
                taken = True
            else:
                taken = False
        if taken:
            super().process_request(request, client_address)
        else:
            self._refuse(request)

    def _refuse(self, request: socket.socket) -> None:
        """503 without a thread: the send fits the socket's buffer, and nothing is read."""
        try:
            request.setblocking(False)
            request.send(BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._slots_lock:
                self._slots.pop(request, None)

    def slot(self, request: Any) -> _Slot | None:
        with self._slots_lock:
            return self._slots.get(request)

    @property
    def connections(self) -> int:
        with self._slots_lock:
            return len(self._slots)


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler for ``BoundedHTTPServer``: its request must arrive before the connection's deadline."""

    server: BoundedHTTPServer

    def setup(self) -> None:
        super().setup()
        slot = self.server.slot(self.request) if isinstance(self.server, BoundedHTTPServer) else None
        deadline = slot.deadline if slot else time.monotonic() + REQUEST_DEADLINE_SECONDS
        self._probes_only = bool(slot and slot.probes_only)
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        self.connection.settimeout(WRITE_TIMEOUT_SECONDS)  # the request is in: now the answer's own limit
        if self._probes_only and self.path.split("?", 1)[0] not in PROBE_PATHS:
            self.close_connection = True
            self.send_error(503, "busy: too many connections; only the health probes are answered")
            return False
        return True

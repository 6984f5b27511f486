"""An HTTP server that a slow or idle client cannot exhaust.

``ThreadingHTTPServer`` gives each connection a thread and waits for its
request for ever: sockets opened and left idle (or a client sending one
header line every few seconds) each hold a thread, without bound. Here a
connection first waits in a waiting room (one selector thread for all of
them, no thread each) until its request line is in; only then does it get
a thread and a slot. Each connection has one deadline,
``REQUEST_DEADLINE_SECONDS`` after it was accepted, for its whole request
(not per read). At most ``MAX_CONNECTIONS`` requests are served at once,
plus ``PROBE_SLOTS`` kept for the health probes: slots are given by the
request's path, so neither idle sockets nor a scrape storm can fail a
kubelet's ``/livez``. Beyond that, or beyond ``MAX_WAITING`` sockets in the
waiting room, a connection gets 503 at once and is closed.
"""

from __future__ import annotations

import io
import selectors
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REQUEST_DEADLINE_SECONDS = 5.0  # from accept to the end of the request's headers
WRITE_TIMEOUT_SECONDS = 5.0  # sending the answer to a client that does not read
MAX_CONNECTIONS = 64
PROBE_SLOTS = 8
MAX_WAITING = 512  # sockets waiting for their request line, all on one thread
MAX_REQUEST_LINE = 8192
PROBE_PATHS = frozenset({"/livez", "/readyz", "/healthz", "/health"})
BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n"
    b"Connection: close\r\n\r\nbusy\n"
)


class _DeadlineReader(io.RawIOBase):
    """Reads a socket until a fixed deadline: a trickling client cannot stretch it, read by read.

    ``head`` is what the waiting room already read (the request line); it is returned first.
    """

    def __init__(self, sock: socket.socket, deadline: float, head: bytes = b"") -> None:
        self.sock = sock
        self.deadline = deadline
        self.head = memoryview(head)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.head:
            n = min(len(buffer), len(self.head))
            buffer[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request deadline passed")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class _Slot:
    __slots__ = ("deadline", "head", "probes_only")

    def __init__(self, deadline: float, probes_only: bool, head: bytes) -> None:
        self.deadline = deadline
        self.probes_only = probes_only
        self.head = head


class _Waiting:
    __slots__ = ("address", "deadline", "head")

    def __init__(self, address: Any, deadline: float) -> None:
        self.address = address
        self.deadline = deadline
        self.head = bytearray()


def request_path(head: bytes) -> str:
    """The path of a request line (``GET /livez?x HTTP/1.1`` -> ``/livez``); empty if there is none."""
    parts = head.split(b"\n", 1)[0].split()
    return parts[1].split(b"?", 1)[0].decode("latin-1") if len(parts) >= 2 else ""


def _refuse(request: socket.socket) -> None:
    """503 without a thread: the send fits the socket's buffer, and nothing is read."""
    try:
        request.setblocking(False)
        request.send(BUSY)
    except OSError:
        pass
    try:
        request.shutdown(socket.SHUT_WR)  # the 503 goes out before the close, not a reset
    except OSError:
        pass
    request.close()


class _WaitingRoom:
    """Accepted sockets wait here, on one selector thread, until their request line is in or their deadline passes."""

    def __init__(self, server: BoundedHTTPServer) -> None:
        self.server = server
        self.selector = selectors.DefaultSelector()
        self.waiting: dict[socket.socket, _Waiting] = {}
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="http-waiting-room", daemon=True)
        self.thread.start()

    def add(self, request: socket.socket, address: Any) -> None:
        with self.lock:
            if self.closed or len(self.waiting) >= self.server.max_waiting:
                _refuse(request)
                return
            request.setblocking(False)
            self.waiting[request] = _Waiting(address, time.monotonic() + self.server.request_deadline)
            self.selector.register(request, selectors.EVENT_READ)
        self._wake()

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self._wake()

    def _wake(self) -> None:
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass  # its buffer is full: the thread is awake anyway

    def _run(self) -> None:
        while True:
            with self.lock:
                if self.closed:
                    break
                first = min((w.deadline for w in self.waiting.values()), default=None)
            timeout = None if first is None else max(0.0, first - time.monotonic())
            for key, _events in self.selector.select(timeout):
                if key.fileobj is self.wake_r:
                    self._drain_wake()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            self._expire()
        self._shut()

    def _drain_wake(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _read(self, sock: socket.socket) -> None:
        waiting = self.waiting.get(sock)
        if waiting is None:
            return
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock, close=True)
            return
        waiting.head += data
        if b"\n" in waiting.head or len(waiting.head) >= MAX_REQUEST_LINE:
            self._drop(sock, close=False)
            self.server.start(sock, waiting.address, waiting.deadline, bytes(waiting.head))

    def _expire(self) -> None:
        now = time.monotonic()
        for sock in [s for s, w in list(self.waiting.items()) if w.deadline <= now]:
            self._drop(sock, close=True)

    def _drop(self, sock: socket.socket, *, close: bool) -> None:
        with self.lock:
            self.waiting.pop(sock, None)
            try:
                self.selector.unregister(sock)
            except (KeyError, ValueError):
                pass
        if close:
            try:
                sock.close()
            except OSError:
                pass

    def _shut(self) -> None:
        with self.lock:
            for sock in list(self.waiting):
                sock.close()
            self.waiting.clear()
        self.selector.close()
        self.wake_r.close()
        self.wake_w.close()


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a deadline per connection and a bounded number of connections."""

    daemon_threads = True
    request_queue_size = 128  # the default 5 leaves a burst of connects waiting on SYN-ACK retransmits
    request_deadline = REQUEST_DEADLINE_SECONDS
    max_connections = MAX_CONNECTIONS
    probe_slots = PROBE_SLOTS
    max_waiting = MAX_WAITING

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots: dict[Any, _Slot] = {}
        self._slots_lock = threading.Lock()
        self._room: _WaitingRoom | None = None  # a bind that fails calls server_close from inside __init__
        super().__init__(*args, **kwargs)
        self._room = _WaitingRoom(self)

    def process_request(self, request: Any, client_address: Any) -> None:
        assert self._room is not None  # requests come only after __init__
        self._room.add(request, client_address)

    def start(self, request: socket.socket, client_address: Any, deadline: float, head: bytes) -> None:
        """Give a connection whose request line is in a slot and a thread, or 503 if none fits."""
        probe = request_path(head) in PROBE_PATHS
        with self._slots_lock:
            probes = sum(1 for slot in self._slots.values() if slot.probes_only)
            regular = len(self._slots) - probes
            if regular < self.max_connections:
                self._slots[request] = _Slot(deadline, False, head)
            elif probe and probes < self.probe_slots:
                self._slots[request] = _Slot(deadline, True, head)
            else:
                _refuse(request)
                return
        request.setblocking(True)
        super().process_request(request, client_address)

    def server_close(self) -> None:
        if self._room is not None:
            self._room.close()
        super().server_close()

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

    @property
    def waiting(self) -> int:
        """Sockets accepted whose request line is not in yet."""
        room = self._room
        if room is None:
            return 0
        with room.lock:
            return len(room.waiting)


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler for ``BoundedHTTPServer``: its request must arrive before the connection's deadline."""

    server: BoundedHTTPServer

    def setup(self) -> None:
        super().setup()
        slot = self.server.slot(self.request) if isinstance(self.server, BoundedHTTPServer) else None
        deadline = slot.deadline if slot else time.monotonic() + REQUEST_DEADLINE_SECONDS
        self._probes_only = bool(slot and slot.probes_only)
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline, slot.head if slot else b""))

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        self.connection.settimeout(WRITE_TIMEOUT_SECONDS)  # the request is in: now the answer's own limit
        if self._probes_only and self.path.split("?", 1)[0] not in PROBE_PATHS:
            self.close_connection = True
            self.send_error(503, "busy: too many connections; only the health probes are answered")
            return False
        return True

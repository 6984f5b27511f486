"""The etcd client: key-value calls, transactions, leases with keepalive, and a watch that resumes.

It talks to etcd's v3 JSON gateway (``POST /v3/kv/range`` and friends, etcd ≥ 3.4)
through ``requests`` sessions: TLS (``ca``, ``cert``/``key``, given with each request,
since a session's CA loses to a ``REQUESTS_CA_BUNDLE`` variable), a
token from ``POST /v3/auth/authenticate`` in the ``Authorization`` header when a
user is given (fetched again on a 401), and a list of endpoints tried in turn
when one cannot be reached. This is the only module that imports ``requests``;
it does so when an ``Etcd`` is made, so the records below (``KeyValue``,
``Compare``, ``Op``…) import without the ``[cluster]`` extra.

Why not ``etcd3gw`` (the client the design started from): its ``post`` takes one
timeout per client (a keepalive needs a shorter one than a range), folds a
connect failure and a read timeout into the same exception (only the first is
safe to retry on another endpoint: after a read timeout a txn may have been
applied), and hides the HTTP status (a 401 means "fetch a new token"). Its watch
ends silently when etcd restarts (measured), so the watch had to be written
here anyway. What was left of it is base64 and one ``session.post``.

Threads: ``Etcd``'s calls may come from any thread. Each ``Lease`` refreshes on
its own thread, which does nothing else, and each ``Watch`` reads its stream on
its own thread; both use their own session so neither waits for the other's
connection. Callbacks run on those threads: the owner hands them to its loop
through a queue.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConfigError, EtcdError

if TYPE_CHECKING:
    import requests

__all__ = [
    "Compare",
    "Etcd",
    "EtcdError",
    "KeyValue",
    "Lease",
    "Op",
    "TxnResult",
    "Watch",
    "WatchEvent",
]

log = logging.getLogger("conveyor.cluster.etcd")

EXTRA_HINT = "pip install 'conveyor[cluster]'"
UNAUTHENTICATED = 16  # gRPC status code: the token is missing, expired or unknown
NOT_FOUND = 5  # gRPC status code: e.g. "requested lease not found"
WATCH_IDLE_TIMEOUT = 10.0  # seconds without a line on a watch stream before it is opened again


def _requests() -> Any:
    """``requests``, or a ConfigError naming the extra that installs it."""
    try:
        import requests
    except ImportError as exc:  # pragma: no cover - the extra is installed in the test venv
        raise ConfigError(f"cluster mode needs the etcd client: {EXTRA_HINT} ({exc})") from exc
    return requests


# --- the records -------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _key(key: str) -> str:
    return _b64(key.encode())


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end`` for a prefix)."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return b"\0"  # every key
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KeyValue:
        return cls(
            key=_unb64(raw.get("key")).decode(),
            value=_unb64(raw.get("value")),
            create_revision=int(raw.get("create_revision", 0)),
            mod_revision=int(raw.get("mod_revision", 0)),
            version=int(raw.get("version", 0)),
            lease=int(raw.get("lease", 0)),
        )


_TARGET_FIELDS = {"CREATE": "create_revision", "MOD": "mod_revision", "VERSION": "version", "VALUE": "value"}
_RESULTS = {"=": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


@dataclass(frozen=True)
class Compare:
    """One txn condition: ``target`` of ``key`` ``op`` ``value`` (``Compare.modified("k", 7)``: MOD == 7)."""

    key: str
    target: str  # "CREATE" | "MOD" | "VERSION" | "VALUE"
    op: str  # "=" | "!=" | "<" | ">"
    value: int | bytes

    def __post_init__(self) -> None:
        if self.target not in _TARGET_FIELDS or self.op not in _RESULTS:
            raise ValueError(f"bad compare {self.target} {self.op}")

    @staticmethod
    def created(key: str, revision: int) -> Compare:
        """CREATE == revision: the key is the one made at that revision (0: the key is absent)."""
        return Compare(key, "CREATE", "=", revision)

    @staticmethod
    def modified(key: str, revision: int) -> Compare:
        """MOD == revision: nobody wrote the key since it was read."""
        return Compare(key, "MOD", "=", revision)

    @staticmethod
    def absent(key: str) -> Compare:
        return Compare(key, "CREATE", "=", 0)

    def to_json(self) -> dict[str, Any]:
        name = _TARGET_FIELDS[self.target]
        value = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _key(self.key), "target": self.target, "result": _RESULTS[self.op], name: value}


@dataclass(frozen=True)
class Op:
    """One txn operation: ``Op.put``, ``Op.delete`` or ``Op.get`` (whose KVs come back in ``TxnResult.ranges``)."""

    kind: str  # "put" | "delete" | "get"
    key: str
    value: bytes = b""
    lease: int = 0
    prefix: bool = False

    @staticmethod
    def put(key: str, value: bytes, lease: int = 0) -> Op:
        return Op("put", key, value, lease)

    @staticmethod
    def delete(key: str, *, prefix: bool = False) -> Op:
        return Op("delete", key, prefix=prefix)

    @staticmethod
    def get(key: str, *, prefix: bool = False) -> Op:
        return Op("get", key, prefix=prefix)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": _key(self.key)}
        if self.prefix:
            body["range_end"] = _b64(prefix_end(self.key.encode()))
        if self.kind == "put":
            body["value"] = _b64(self.value)
            if self.lease:
                body["lease"] = str(self.lease)
            return {"request_put": body}
        if self.kind == "delete":
            return {"request_delete_range": body}
        return {"request_range": body}


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    ranges: list[list[KeyValue]] = field(default_factory=list)  # the KVs each get-op returned, in order

    @property
    def current(self) -> KeyValue | None:
        """The first get-op's first KV: the record as it is, after a failed ``cas`` or ``put_if_absent``."""
        return self.ranges[0][0] if self.ranges and self.ranges[0] else None


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "PUT" | "DELETE"
    kv: KeyValue  # for DELETE: key and mod_revision set, value b""


def parse_txn(answer: dict[str, Any]) -> TxnResult:
    ranges = [
        [KeyValue.from_json(kv) for kv in item["response_range"].get("kvs", [])]
        for item in answer.get("responses", [])
        if "response_range" in item
    ]
    return TxnResult(bool(answer.get("succeeded", False)), _revision(answer), ranges)


def parse_events(result: dict[str, Any]) -> list[WatchEvent]:
    return [WatchEvent(event.get("type", "PUT"), KeyValue.from_json(event["kv"])) for event in result.get("events", [])]


def _revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


# --- the transport -------------------------------------------------------------


class _Transport:
    """Endpoints, TLS and the auth token, shared by the client, its leases and its watches."""

    def __init__(
        self,
        endpoints: Sequence[str],
        timeout: float,
        ca: str | None,
        cert: str | None,
        key: str | None,
        user: str | None,
        password: str | None,
    ) -> None:
        ca, cert, key, user, password = (option or None for option in (ca, cert, key, user, password))  # "": unset
        if not endpoints:
            raise ConfigError("etcd: no endpoint given")
        for endpoint in endpoints:
            if not endpoint.startswith(("http://", "https://")):
                raise ConfigError(f"etcd endpoint {endpoint!r}: expected http://HOST:PORT or https://HOST:PORT")
        if (cert is None) != (key is None):
            raise ConfigError("etcd: a client certificate needs both cert and key")
        if (user is None) != (password is None):
            raise ConfigError("etcd: auth needs both user and password")
        self.requests = _requests()
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self.timeout = timeout
        self.ca = ca
        self.cert = (cert, key) if cert and key else None
        self.user = user
        self.password = password
        self._current = 0
        self._token: str | None = None
        self._lock = threading.Lock()

    def session(self) -> requests.Session:
        return self.requests.Session()

    @property
    def tls(self) -> dict[str, Any]:
        """``verify`` and ``cert`` for each request: on the session, REQUESTS_CA_BUNDLE would override the CA."""
        options: dict[str, Any] = {}
        if self.ca:
            options["verify"] = self.ca
        if self.cert:
            options["cert"] = self.cert
        return options

    def rotation(self) -> list[str]:
        """The endpoints, the one that last answered first."""
        with self._lock:
            start = self._current
        return self.endpoints[start:] + self.endpoints[:start]

    def answered(self, endpoint: str) -> None:
        with self._lock:
            self._current = self.endpoints.index(endpoint)

    def headers(self, session: requests.Session, endpoint: str, timeout: float) -> dict[str, str]:
        if self.user is None:
            return {}
        with self._lock:
            token = self._token
        if token is None:
            token = self._authenticate(session, endpoint, timeout)
        return {"Authorization": token}

    def forget_token(self, token: str | None) -> None:
        with self._lock:
            if self._token == token:
                self._token = None

    def _authenticate(self, session: requests.Session, endpoint: str, timeout: float) -> str:
        body = {"name": self.user, "password": self.password}
        response = session.post(f"{endpoint}/v3/auth/authenticate", json=body, timeout=timeout, **self.tls)
        answer = _answer(response)
        token = str(answer["token"])
        with self._lock:
            self._token = token
        return token

    def post(self, session: requests.Session, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        """One unary call: the next endpoint on a connection failure, a new token on a 401.

        Only a failure to connect moves on to the next endpoint: after a read
        timeout the request may have been applied, so it is raised (EtcdError)
        and the caller re-reads.
        """
        timeout = self.timeout if timeout is None else timeout
        exceptions = self.requests.exceptions
        failures = []
        for endpoint in self.rotation():
            for attempt in (1, 2):
                try:
                    headers = self.headers(session, endpoint, timeout)
                    response = session.post(
                        f"{endpoint}/v3/{path}", json=body, headers=headers, timeout=timeout, **self.tls
                    )
                    if response.status_code == 401 and self.user is not None and attempt == 1:
                        self.forget_token(headers.get("Authorization"))
                        continue
                    answer = _answer(response)
                except (exceptions.ConnectTimeout, exceptions.SSLError) as exc:
                    failures.append(f"{endpoint}: {exc}")
                    break
                except exceptions.ReadTimeout as exc:
                    raise EtcdError(f"etcd {endpoint} did not answer {path} within {timeout:.1f} s") from exc
                except exceptions.ConnectionError as exc:
                    failures.append(f"{endpoint}: {exc}")
                    break
                except exceptions.RequestException as exc:
                    raise EtcdError(f"etcd {endpoint}: {path}: {exc}") from exc
                self.answered(endpoint)
                return answer
        raise EtcdError("etcd unreachable: " + "; ".join(failures), endpoints=list(self.endpoints))


def _answer(response: requests.Response) -> Any:
    """The JSON of a 200, or EtcdError with etcd's message and gRPC code."""
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if response.status_code == 200 and isinstance(answer, dict):
        return answer
    detail = answer if isinstance(answer, dict) else {}
    message = detail.get("message") or detail.get("error") or response.text[:200] or response.reason
    raise EtcdError(
        f"etcd {response.request.method} {response.url}: {response.status_code} {message}",
        grpc_code=int(detail.get("code", 0)),
        status=response.status_code,
    )


# --- the client --------------------------------------------------------------


class Etcd:
    """An etcd client (v3 JSON gateway). Methods raise ``EtcdError`` (retriable) when etcd cannot answer."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        timeout: float = 2.0,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        self.transport = _Transport(endpoints, timeout, ca, cert, key, user, password)
        self._session = self.transport.session()
        self._children: list[Lease | Watch] = []
        self._closed = False

    def call(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Any:
        """A raw gateway call (``path`` under ``/v3/``): for what the methods below do not cover."""
        return self.transport.post(self._session, path, body, timeout)

    # key-value

    def get(self, key: str) -> KeyValue | None:
        kvs = self.call("kv/range", {"key": _key(key)}).get("kvs", [])
        return KeyValue.from_json(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str, *, revision: int = 0) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the revision they were read at.

        ``revision``: read as of that revision (after ``on_resync(rev)``, the state the watch resumes from).
        """
        body: dict[str, Any] = {"key": _key(prefix), "range_end": _b64(prefix_end(prefix.encode()))}
        if revision:
            body["revision"] = str(revision)
        answer = self.call("kv/range", body)
        return [KeyValue.from_json(kv) for kv in answer.get("kvs", [])], _revision(answer)

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _key(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _revision(self.call("kv/put", body))

    def delete(self, key: str, *, prefix: bool = False) -> int:
        body: dict[str, Any] = {"key": _key(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key.encode()))
        return _revision(self.call("kv/deleterange", body))

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        body = {
            "compare": [item.to_json() for item in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        }
        return parse_txn(self.call("kv/txn", body))

    def put_if_absent(self, key: str, value: bytes, *, lease: int = 0) -> TxnResult:
        """Create ``key``; if it exists, ``succeeded`` is False and ``result.current`` is the record."""
        return self.txn([Compare.absent(key)], [Op.put(key, value, lease)], [Op.get(key)])

    def cas(
        self, key: str, value: bytes, mod_revision: int, *, extra: Sequence[Compare] = (), lease: int = 0
    ) -> TxnResult:
        """Write ``key`` if nobody did since ``mod_revision`` (and ``extra`` holds, e.g. the controller's fence).

        On a conflict ``succeeded`` is False and ``result.current`` is the record as it is now, in the same
        round trip (None if it was deleted).
        """
        compare = [Compare.modified(key, mod_revision), *extra]
        return self.txn(compare, [Op.put(key, value, lease)], [Op.get(key)])

    # leases

    def grant(self, ttl_seconds: int) -> int:
        answer = self.call("lease/grant", {"TTL": str(ttl_seconds)})
        if answer.get("error"):
            raise EtcdError(f"etcd refused a lease: {answer['error']}")
        return int(answer["ID"])

    def lease(self, ttl_seconds: int, *, on_lost: Callable[[], None]) -> Lease:
        """Grant a lease and keep it alive on its own thread until ``close()``, ``revoke()`` or loss."""
        asked = time.monotonic()  # etcd counts the TTL from the grant, so the first deadline does too
        lease = Lease(self, self.grant(ttl_seconds), ttl_seconds, on_lost, granted=asked)
        self._adopt(lease)
        lease.start()
        return lease

    def revoke(self, lease_id: int) -> None:
        """End a lease now (the keys under it vanish); a lease etcd no longer knows is not an error."""
        try:
            self.call("lease/revoke", {"ID": str(lease_id)})
        except EtcdError as exc:
            if exc.fields.get("grpc_code") != NOT_FOUND:
                raise

    def time_to_live(self, lease_id: int) -> int:
        """The seconds etcd still gives the lease (-1: it is gone)."""
        answer = self.call("lease/timetolive", {"ID": str(lease_id)})
        return int(answer.get("TTL", -1))

    # watches

    def watch(
        self,
        prefix: str,
        *,
        start_revision: int,
        on_event: Callable[[WatchEvent], None],
        on_resync: Callable[[int], None],
        idle_timeout: float = WATCH_IDLE_TIMEOUT,
    ) -> Watch:
        """Watch every key under ``prefix`` from ``start_revision`` on, on a thread of its own."""
        watch = Watch(self, prefix, start_revision, on_event, on_resync, idle_timeout)
        self._adopt(watch)
        watch.start()
        return watch

    def compact(self, revision: int) -> None:
        """Drop the history before ``revision`` (tests use it to make a watch resync)."""
        self.call("kv/compaction", {"revision": str(revision), "physical": True})

    def _adopt(self, child: Lease | Watch) -> None:
        """Keep what ``close`` must stop; a node that re-grants after each loss must not pile up dead ones."""
        self._children = [known for known in self._children if known.alive()]
        self._children.append(child)

    def close(self) -> None:
        """Stop the watches and keepalives this client started (leases are not revoked)."""
        self._closed = True
        for child in self._children:
            child.close()
        self._children.clear()
        self._session.close()

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Lease:
    """A granted lease kept alive by a thread that refreshes it every TTL/3 and does nothing else.

    ``lost`` is set, and ``on_lost`` called once from that thread, when etcd says
    the lease is gone, or when no refresh succeeded for a whole TTL (etcd may be
    down or cut off; then we cannot know, and a node must act as if its keys
    were gone). Note that etcd renews every lease when it restarts, so after an
    etcd outage longer than the TTL the lease may still exist although ``lost``
    is set: the owner revokes it and grants a new one.
    """

    def __init__(
        self, etcd: Etcd, lease_id: int, ttl: int, on_lost: Callable[[], None], *, granted: float | None = None
    ) -> None:
        self.id = lease_id
        self.ttl = ttl
        self.lost = threading.Event()
        # When the last successful refresh (or the grant) was sent: etcd's deadline is at most a TTL after it.
        self.last_refresh = time.monotonic() if granted is None else granted
        self.refreshes = 0
        self._etcd = etcd
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._session = etcd.transport.session()
        self._thread = threading.Thread(target=self._run, name=f"conveyor-lease-{lease_id:x}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        period = self.ttl / 3
        failures = 0
        while not self._stop.is_set():
            left = self.ttl - (time.monotonic() - self.last_refresh)
            if left <= 0:
                self._lose(f"no refresh succeeded for {self.ttl} s")
                return
            sent = time.monotonic()
            try:
                remaining = self._refresh(timeout=max(0.1, min(self._etcd.transport.timeout, left)))
            except EtcdError as exc:
                if exc.fields.get("grpc_code") == NOT_FOUND:
                    self._lose("etcd does not know the lease")
                    return
                failures += 1
                log.debug("lease %x: refresh failed (%s)", self.id, exc)
                self._stop.wait(min(period, 0.05 * 2**failures, max(0.0, left)))
                continue
            if remaining <= 0:
                self._lose("etcd says the lease is gone")
                return
            failures = 0
            self.last_refresh = sent
            self.refreshes += 1
            self._stop.wait(max(0.0, sent + period - time.monotonic()))

    def _refresh(self, timeout: float) -> int:
        answer = self._etcd.transport.post(self._session, "lease/keepalive", {"ID": str(self.id)}, timeout)
        result = answer.get("result", answer)
        if "error" in answer:
            raise EtcdError(f"lease keepalive: {answer['error']}")
        return int(result.get("TTL", 0))

    def _lose(self, why: str) -> None:
        if self._stop.is_set():
            return
        log.warning("lease %x lost: %s", self.id, why)
        self.lost.set()
        self._stop.set()
        try:
            self._on_lost()
        except Exception:
            log.exception("lease %x: on_lost failed", self.id)

    def alive(self) -> bool:
        """The keepalive thread still runs (not closed, revoked or lost)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def revoke(self) -> None:
        """End the lease now: the keys under it vanish at once (controlled shutdown)."""
        self.close()
        self._etcd.revoke(self.id)

    def close(self) -> None:
        """Stop refreshing without revoking (the keys stay until the TTL runs out)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._etcd.transport.timeout + 1)
        self._session.close()


class Watch:
    """A prefix watch on a thread of its own that resumes where it stopped.

    A streaming ``POST /v3/watch`` read line by line. After any stream error, end
    of stream (etcd restarted) or ``idle_timeout`` seconds without a line (etcd
    stopped, or the connection silently dead), it opens
    the stream again from the last revision seen + 1, on the next endpoint if
    need be, so no event is missed or repeated. When etcd answers that this
    revision was compacted away, it calls ``on_resync(rev)`` with the current
    revision: the owner re-reads the prefix (``get_prefix(prefix, revision=rev)``)
    and the watch goes on from ``rev + 1``.

    Progress notifications are asked for, but etcd sends them every 10 minutes
    unless started with ``--experimental-watch-progress-notify-interval 5s`` (3.4;
    advised): with them an idle watch is never reopened, and its resume revision
    follows etcd's, so a compaction of other keys' history does not force a resync.
    """

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        start_revision: int,
        on_event: Callable[[WatchEvent], None],
        on_resync: Callable[[int], None],
        idle_timeout: float = WATCH_IDLE_TIMEOUT,
    ) -> None:
        self.prefix = prefix
        self.next_revision = max(1, start_revision)
        self.streams = 0  # how many times the stream was opened (1 + reconnections)
        self.resyncs = 0
        self.connected = threading.Event()  # set while a stream is open and etcd confirmed the watch
        self._etcd = etcd
        self._on_event = on_event
        self._on_resync = on_resync
        self._idle = idle_timeout
        self._stop = threading.Event()
        self._session = etcd.transport.session()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"conveyor-watch-{prefix}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                for endpoint in self._etcd.transport.rotation():
                    if self._stop.is_set():
                        return
                    try:
                        self._stream(endpoint)
                        failures = 0
                        break
                    except (OSError, ValueError, EtcdError, self._etcd.transport.requests.RequestException) as exc:
                        if self._stop.is_set():
                            return
                        log.debug("watch %s on %s: %s", self.prefix, endpoint, exc)
                        failures += 1
            except Exception:  # a bug must not end the watch silently: log it and open the stream again
                log.exception("watch %s failed", self.prefix)
                failures += 1
            finally:
                self.connected.clear()
            # Reconnect at once after a clean end (etcd restarted), then back off up to 1 s.
            self._stop.wait(min(1.0, 0.05 * 2 ** min(failures, 5)) * random.uniform(0.5, 1) if failures else 0.01)

    def _stream(self, endpoint: str) -> None:
        transport = self._etcd.transport
        body: dict[str, Any] = {
            "create_request": {
                "key": _key(self.prefix),
                "range_end": _b64(prefix_end(self.prefix.encode())),
                "start_revision": str(self.next_revision),
                "progress_notify": True,
            }
        }
        headers = transport.headers(self._session, endpoint, transport.timeout)
        # etcd cancels the watch if its member loses the raft leader (clientv3's WithRequireLeader):
        # a member cut off from the quorum would otherwise keep the stream open and silent.
        require_leader = {"Grpc-Metadata-hasleader": "true"}
        response = self._session.post(
            f"{endpoint}/v3/watch",
            json=body,
            headers={**headers, **require_leader},
            stream=True,
            timeout=(transport.timeout, self._idle),
            **transport.tls,
        )
        self._response = response
        try:
            if response.status_code == 401:
                transport.forget_token(headers.get("Authorization"))
            if response.status_code != 200:
                _answer(response)  # raises with etcd's message
            self.streams += 1
            for line in _lines(response):
                if self._stop.is_set():
                    return
                self._handle(json.loads(line), headers)
            log.debug("watch %s: stream ended (etcd restarted?)", self.prefix)
        finally:
            self._response = None
            response.close()

    def _handle(self, message: dict[str, Any], headers: dict[str, str]) -> None:
        if "error" in message:
            error = message["error"]
            if isinstance(error, dict) and error.get("grpc_code", error.get("code")) == UNAUTHENTICATED:
                self._etcd.transport.forget_token(headers.get("Authorization"))
            raise EtcdError(f"watch {self.prefix}: {error}")
        result = message.get("result", {})
        if int(result.get("compact_revision", 0)):
            self._resync()
            raise EtcdError(f"watch {self.prefix}: history compacted, resynced")
        if result.get("canceled"):
            raise EtcdError(f"watch {self.prefix} canceled: {result.get('cancel_reason', '')}")
        if result.get("created"):
            self.connected.set()
            return
        events = parse_events(result)
        for event in events:
            try:
                self._on_event(event)
            except Exception:
                log.exception("watch %s: on_event failed", self.prefix)
        if events:
            self.next_revision = max(self.next_revision, events[-1].kv.mod_revision + 1)
        else:  # a progress notification: every event up to the header's revision was sent
            self.next_revision = max(self.next_revision, _revision(result) + 1)

    def _resync(self) -> None:
        # Only the current revision is needed: one key is enough to get the header.
        body = {"key": _key(self.prefix), "range_end": _b64(prefix_end(self.prefix.encode())), "keys_only": True}
        revision = _revision(self._etcd.transport.post(self._session, "kv/range", {**body, "limit": "1"}))
        self.resyncs += 1
        try:
            self._on_resync(revision)
        except Exception:
            log.exception("watch %s: on_resync failed", self.prefix)
        self.next_revision = revision + 1

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def close(self) -> None:
        """Stop the thread; a read in progress is cut by shutting the socket down."""
        self._stop.set()
        _shutdown(self._response)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._etcd.transport.timeout + 1)
        self._session.close()


def _lines(response: requests.Response) -> Iterator[bytes]:
    """The stream's lines as they come (the gateway sends one JSON message per line)."""
    pending = b""
    for chunk in response.iter_content(chunk_size=None):
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line.strip():
                yield line
    if pending.strip():
        yield pending


def _shutdown(response: Any) -> None:
    """Wake a thread blocked reading ``response``: closing a socket does not, shutting it down does."""
    if response is None:
        return
    connection = getattr(response.raw, "_connection", None) or getattr(response.raw, "connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

"""CURVE authentication and encryption (ZeroMQ's CurveZMQ, ZAP for authorization).

The broker holds a secret certificate and a directory of authorized client
public certificates; a client needs the broker's public key and its own
certificate. Certificates are ZeroMQ's files, made by ``conveyor keys``.
Clients read their keys from ``configure()`` or from the environment
(``CONVEYOR_CURVE_SERVER_KEY``: the broker's public key or its ``.key``
file; ``CONVEYOR_CURVE_KEY``: the client's ``.key_secret`` file), so every
client (producers, admin, consumers, the runner, mirrors) picks them up.

Refusals are visible on both sides. The broker watches its socket's failed
handshakes (``RefusalWatch``): each is counted in
``conveyor_auth_failures_total{reason}`` and logged, at most once per 10 s.
Each client watches its own (``HandshakeWatch``) and fails with
``AUTH_FAILED`` as soon as the broker refuses it, instead of timing out.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from conveyor.errors import AuthFailed, ConfigError

log = logging.getLogger("conveyor.security")


@dataclass(frozen=True)
class ClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes


_configured: ClientKeys | None = None


def configure(*, server_key: str | bytes, client_key_file: str | os.PathLike[str]) -> None:
    """Set the keys every client of this process uses."""
    global _configured
    _configured = load_client_keys(server_key, client_key_file)


def _public_key(value: str | bytes) -> bytes:
    text = value.decode() if isinstance(value, bytes) else value
    if os.path.exists(text):
        public, _secret = zmq.auth.load_certificate(text)
        return public
    if len(text) != 40:
        raise ConfigError("a CURVE public key is 40 Z85 characters, or the path of a .key file")
    return text.encode()


def load_client_keys(server_key: str | bytes, client_key_file: str | os.PathLike[str]) -> ClientKeys:
    """Keys for one client, read from where ``configure()`` and the environment name them.

    For clients whose keys travel with them rather than with the process (the
    Spark connector's readers and writers, pickled to executors).
    """
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(client_key_file))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the client certificate {client_key_file}: {exc}") from None
    if not secret:
        raise ConfigError(f"{client_key_file} holds no secret key: use the .key_secret file")
    return ClientKeys(_public_key(server_key), public, secret)


def client_keys() -> ClientKeys | None:
    if _configured is not None:
        return _configured
    server = os.environ.get("CONVEYOR_CURVE_SERVER_KEY")
    mine = os.environ.get("CONVEYOR_CURVE_KEY")
    if not (server or mine):
        return None
    if not (server and mine):
        raise ConfigError("CURVE needs both CONVEYOR_CURVE_SERVER_KEY and CONVEYOR_CURVE_KEY")
    return load_client_keys(server, mine)


def secure_client(sock: zmq.Socket[Any], keys: ClientKeys | None = None) -> None:
    """Make a client socket speak CURVE with ``keys``, else the process's keys if any (before connect)."""
    keys = keys or client_keys()
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def check_server_options(secret_key: str, authorized_keys: str, allow_any_client: bool) -> None:
    """Refuse CURVE settings that would not do what they seem to (a ``CONFIG_ERROR``, exit 2)."""
    if secret_key:  # the certificate first: a public key given as the secret one is the mistake to name
        _load_server_certificate(secret_key)
    if not secret_key:
        if authorized_keys or allow_any_client:
            flag = "--curve-authorized-keys" if authorized_keys else "--curve-allow-any-client"
            raise ConfigError(
                f"{flag} without --curve-secret-key: the broker would accept plaintext connections from anyone; "
                "give the broker's certificate with --curve-secret-key (`conveyor keys generate`)"
            )
        return
    if authorized_keys and allow_any_client:
        raise ConfigError("--curve-authorized-keys and --curve-allow-any-client contradict each other: give one")
    if not (authorized_keys or allow_any_client):
        raise ConfigError(
            "CURVE without --curve-authorized-keys would admit any client that knows the broker's public key: "
            "give the directory of authorized client keys (.key files), or --curve-allow-any-client to encrypt "
            "without checking who connects"
        )


def authorized_keys_in(directory: str) -> set[bytes]:
    """The public keys of every ``*.key`` file in ``directory``; a file that is not one is a ``CONFIG_ERROR``.

    pyzmq's own loader logs a bad file and then authorizes nobody at all: one bad
    file would lock every client out while the broker says it is ready.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(f"--curve-authorized-keys {directory} is not a directory")
    keys: set[bytes] = set()
    for path in sorted(folder.glob("*.key")):
        try:
            public, _secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not a CURVE public certificate ({exc})", path=str(path)) from None
        if not public or len(public) != 40:
            raise ConfigError(f"{path}: not a CURVE public certificate (no 40-character public-key)", path=str(path))
        keys.add(public)
    if not keys:
        log.warning("--curve-authorized-keys %s holds no .key file: every client will be refused", directory)
    return keys


class _KeyRing:
    """The authorized client keys, asked by the ZAP thread for each handshake; remembers the last one refused."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys
        self.peers: frozenset[bytes] = frozenset()  # other brokers of a cluster, beside the authorized directory
        self.last_refused = b""

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys or key in self.peers:
            return True
        self.last_refused = key
        return False


def _load_server_certificate(secret_key_file: str) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(secret_key_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the broker certificate {secret_key_file}: {exc}") from None
    if not secret:
        raise ConfigError(f"{secret_key_file} holds no secret key: use the .key_secret file")
    return public, secret


class ServerSecurity:
    """The broker side: its certificate on the socket, ZAP checking client keys, refusals counted and logged."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        secret_key_file: str,
        authorized_keys: str,
        *,
        allow_any_client: bool = False,
        failures: Any = None,
    ) -> None:
        """``failures``: the ``conveyor_auth_failures_total`` counter (labelled by reason)."""
        check_server_options(secret_key_file, authorized_keys, allow_any_client)
        self.public, self.secret = _load_server_certificate(secret_key_file)
        self.keyring = _KeyRing(set() if allow_any_client else authorized_keys_in(authorized_keys))
        self.authorized_keys = authorized_keys
        self.ctx = ctx
        self.failures = failures
        self.refusals: RefusalWatch | None = None
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("conveyor.zap"))
        self.auth.start()
        if allow_any_client:
            log.warning("CURVE with --curve-allow-any-client: traffic is encrypted, any client may connect")
            self.auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self.auth.configure_curve_callback(domain="*", credentials_provider=self.keyring)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server and watch its refused handshakes (before it binds)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        self.refusals = RefusalWatch(sock, self.failures, self.keyring, self.authorized_keys)

    def reload(self, authorized_keys: str) -> None:
        self.keyring.keys = authorized_keys_in(authorized_keys)

    def authorize_peers(self, keys: set[bytes]) -> None:
        """Let these public keys in as well (a cluster's brokers fetching as followers); kept across ``reload``."""
        self.keyring.peers = frozenset(keys)

    def peer_keys(self, server_public: bytes | None = None) -> ClientKeys:
        """This broker as a client of another one (a follower of its leader), with its own certificate.

        ``server_public``: the other broker's key; by default this broker's own, for brokers that share one.
        """
        return ClientKeys(server_public or self.public, self.public, self.secret)

    def stop(self) -> None:
        self.auth.stop()
        if self.refusals is not None:
            self.refusals.stop()


LOG_EVERY_SECONDS = 10.0


class RefusalWatch:
    """A thread reading the broker socket's failed handshakes: counted by reason, logged at most every 10 s.

    Only handshake failures are monitored, so this costs nothing per message.
    A client hanging up mid-handshake (a TCP probe, a restart) gives no
    detail and is not counted: it is not a refusal.
    """

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH

    def __init__(self, sock: zmq.Socket[Any], failures: Any, keyring: _KeyRing, directory: str) -> None:
        self.failures, self.keyring, self.directory = failures, keyring, directory
        endpoint = _monitor_endpoint()
        sock.monitor(endpoint, self.EVENTS)
        self.socket = sock.context.socket(zmq.PAIR)
        self.socket.connect(endpoint)
        self._sock = sock
        self._unlogged: dict[str, int] = {}
        self._next_log = 0.0
        self.thread = threading.Thread(target=self._run, name="conveyor-auth-refusals", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                event = parse_monitor_message(self.socket.recv_multipart())
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                self.refused(server_reason(event["event"], event["value"]))
        except zmq.ZMQError:  # the context is terminating
            return
        finally:
            self.socket.close(linger=0)

    def refused(self, reason: str) -> None:
        if self.failures is not None:
            self.failures.labels(reason).inc()
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        now = time.monotonic()
        if now < self._next_log:
            return
        self._next_log = now + LOG_EVERY_SECONDS
        counts = ", ".join(f"{n} {r}" for r, n in sorted(self._unlogged.items()))
        self._unlogged.clear()
        log.warning("refused CURVE client handshakes: %s%s", counts, self._detail(reason))

    def _detail(self, reason: str) -> str:
        if reason == "unknown_key" and self.keyring.last_refused:
            return (
                f" (last refused key {self.keyring.last_refused.decode()}: add its .key file to "
                f"{self.directory or 'the authorized directory'} to let it in)"
            )
        if reason == "mechanism_mismatch":
            return " (a client without CURVE keys, or not speaking CURVE)"
        if reason == "bad_handshake":
            return " (a client with the wrong broker public key, or a corrupt handshake)"
        return ""

    def stop(self) -> None:
        self.thread.join(timeout=2)  # the broker's socket closed: MONITOR_STOPPED ends the thread


def server_reason(event: int, value: int) -> str:
    """The ``reason`` label of a refused handshake on the broker."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "unknown_key"
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "mechanism_mismatch"
    return "bad_handshake"


# --- the client side ----------------------------------------------------------------------------------

_monitor_ids = itertools.count(1)
SILENT_FAILURES = 3  # handshakes ending without a reason, in a row, before a client calls it a refusal


def _monitor_endpoint() -> str:
    return f"inproc://conveyor-handshakes-{os.getpid()}-{next(_monitor_ids)}"


class HandshakeWatch:
    """A client socket's handshakes: ``AUTH_FAILED`` once they show the broker refuses this client.

    The broker refusing a key (ZAP) or the two sides disagreeing on CURVE is
    definite at once. A broker that hangs up without a reason (a wrong
    server key, or a CURVE broker meeting a plaintext client before the
    client saw its greeting) is only called a refusal after three such
    handshakes in a row: a broker restarting ends at most one. Any
    successful handshake clears everything. Attach before ``connect``.
    """

    EVENTS = (
        zmq.EVENT_DISCONNECTED  # counted (``disconnects``): a client following a cluster's leader reacts at once
        | zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )

    def __init__(self, sock: zmq.Socket[Any], address: str, keys: ClientKeys | None = None) -> None:
        self.address = address
        self._has_keys = keys is not None  # the keys the watched socket speaks CURVE with, for the messages
        endpoint = _monitor_endpoint()
        sock.monitor(endpoint, self.EVENTS)
        self.socket: zmq.Socket[Any] = sock.context.socket(zmq.PAIR)
        self.socket.connect(endpoint)
        self._sock = sock
        self.silent = 0
        self.disconnects = 0  # connections that ended (the peer died or hung up)
        self.failure: AuthFailed | None = None

    def read(self) -> AuthFailed | None:
        """Take every waiting event (never blocks); the refusal they show, if any."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.failure
            self.on_event(frames)

    def on_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_DISCONNECTED:
            self.disconnects += 1
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.silent, self.failure = 0, None
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.failure = self._refused(
                f"the broker refused this client's CURVE key (ZAP status {value}): its public key must be "
                "in the broker's --curve-authorized-keys directory"
            )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            self.failure = self._refused(_mismatch(self._has_keys))
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            self.failure = self._refused("the CURVE handshake failed: is CONVEYOR_CURVE_SERVER_KEY this broker's key?")
        elif kind in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            self.silent += 1
            if self.silent >= SILENT_FAILURES:
                self.failure = self._refused(
                    f"{self.silent} handshakes in a row ended without a reason: the broker requires other keys "
                    f"({_mismatch(False) if not self._has_keys else 'is CONVEYOR_CURVE_SERVER_KEY its public key?'})"
                )

    def _refused(self, why: str) -> AuthFailed:
        return AuthFailed(f"{self.address}: {why}", address=self.address)

    def close(self) -> None:
        """Stop watching; call before or after closing the watched socket."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass  # already closed
        self.socket.close(linger=0)


def _mismatch(has_keys: bool) -> str:
    if not has_keys:
        return (
            "the broker requires CURVE and this client has no keys: set CONVEYOR_CURVE_SERVER_KEY and "
            "CONVEYOR_CURVE_KEY (or --curve-server-key and --curve-key)"
        )
    return "this client speaks CURVE and the broker does not (or the other way round)"


def generate(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """``NAME.key`` (public, to share) and ``NAME.key_secret`` (keep private)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(os.fspath(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)

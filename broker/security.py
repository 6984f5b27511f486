"""CURVE authentication and encryption (ZeroMQ's CurveZMQ, ZAP for authorization).

The broker holds a secret certificate and a directory of authorized client
public certificates; a client needs the broker's public key and its own
certificate. Certificates are ZeroMQ's files, made by ``conveyor keys``.
Clients read their keys from ``configure()`` or from the environment
(``CONVEYOR_CURVE_SERVER_KEY``: the broker's public key or its ``.key``
file; ``CONVEYOR_CURVE_KEY``: the client's ``.key_secret`` file), so every
client (producers, admin, consumers, the runner, mirrors) picks them up.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from broker.errors import ConfigError

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
    _configured = _client_keys(server_key, client_key_file)


def _public_key(value: str | bytes) -> bytes:
    text = value.decode() if isinstance(value, bytes) else value
    if os.path.exists(text):
        public, _secret = zmq.auth.load_certificate(text)
        return public
    if len(text) != 40:
        raise ConfigError("a CURVE public key is 40 Z85 characters, or the path of a .key file")
    return text.encode()


def _client_keys(server_key: str | bytes, client_key_file: str | os.PathLike[str]) -> ClientKeys:
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
    return _client_keys(server, mine)


def secure_client(sock: zmq.Socket[Any]) -> None:
    """Make a client socket speak CURVE when keys are configured (before connect)."""
    keys = client_keys()
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


class ServerSecurity:
    """The broker side: its certificate on the socket, ZAP checking client keys."""

    def __init__(self, ctx: zmq.Context[Any], secret_key_file: str, authorized_keys: str) -> None:
        try:
            self.public, self.secret = zmq.auth.load_certificate(secret_key_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the broker certificate {secret_key_file}: {exc}") from None
        if not self.secret:
            raise ConfigError(f"{secret_key_file} holds no secret key: use the .key_secret file")
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("conveyor.zap"))
        self.auth.start()
        if authorized_keys:
            if not Path(authorized_keys).is_dir():
                raise ConfigError(f"--curve-authorized-keys {authorized_keys} is not a directory")
            self.auth.configure_curve(domain="*", location=authorized_keys)
        else:
            log.warning("CURVE without --curve-authorized-keys: any client with the broker's public key gets in")
            self.auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def reload(self, authorized_keys: str) -> None:
        self.auth.configure_curve(domain="*", location=authorized_keys)

    def stop(self) -> None:
        self.auth.stop()


def generate(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """``NAME.key`` (public, to share) and ``NAME.key_secret`` (keep private)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(os.fspath(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)

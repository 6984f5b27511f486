"""A real etcd in a subprocess, for tests and benchmarks (``conveyor.testing`` hands it out).

``EtcdProcess`` starts the ``etcd`` binary (Debian's ``etcd-server``; ``make deps``
installs it) as a one-member cluster on free loopback client and peer ports, in
a directory of its own, and waits until ``GET /health`` says ``true``. The fault
tests of replication need the rest: ``stop`` (SIGTERM), ``kill`` (-9), ``pause``
and ``resume`` (SIGSTOP/SIGCONT) and ``restart`` on the same data and ports.
With ``tls=EtcdTls.generate(dir)`` it serves https and asks for client
certificates (a test CA made with the ``openssl`` command). ``enable_auth``
turns on etcd's user/password auth. It signals only the process it started,
and needs no pytest and no ``requests``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_TIMEOUT = 60.0  # seconds: etcd is ready in 0.1-2 s, even on a loaded 2-core box


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class EtcdTls:
    """A test CA, etcd's server certificate (for 127.0.0.1) and a client certificate, as PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def generate(cls, directory: str | os.PathLike[str]) -> EtcdTls:
        """Make them with the ``openssl`` command (EC P-256, valid one day)."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        ca_ext = "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\nsubjectKeyIdentifier=hash\n"
        leaf_ext = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nsubjectAltName=IP:127.0.0.1\n"
        (folder / "ca.ext").write_text(ca_ext)
        (folder / "server.ext").write_text(leaf_ext + "extendedKeyUsage=serverAuth,clientAuth\n")
        (folder / "client.ext").write_text(leaf_ext + "extendedKeyUsage=clientAuth\n")
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        ca = folder / "ca.pem"
        _openssl("req", "-x509", *key, "-keyout", folder / "ca.key", "-out", ca, "-days", "1")
        _openssl(
            "x509", "-in", ca, "-signkey", folder / "ca.key", "-out", ca, "-days", "1", "-extfile", folder / "ca.ext"
        )
        for name in ("server", "client"):
            _openssl("req", *key, "-keyout", folder / f"{name}.key", "-out", folder / f"{name}.csr", subject=name)
            _openssl(
                "x509", "-req", "-in", folder / f"{name}.csr", "-CA", ca, "-CAkey", folder / "ca.key",
                "-CAcreateserial", "-out", folder / f"{name}.pem", "-days", "1", "-extfile", folder / f"{name}.ext",
            )  # fmt: skip
        return cls(ca, folder / "server.pem", folder / "server.key", folder / "client.pem", folder / "client.key")

    def etcd_flags(self) -> list[str]:
        """etcd's flags: serve TLS, and accept only clients with a certificate of this CA."""
        return [
            *("--cert-file", str(self.server_cert), "--key-file", str(self.server_key)),
            *("--trusted-ca-file", str(self.ca), "--client-cert-auth"),
        ]

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def _openssl(*args: str | Path, subject: str = "conveyor-test-ca") -> None:
    command = ["openssl", *map(str, args)]
    if args[0] == "req":
        command += ["-subj", f"/CN={subject}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")


class EtcdProcess:
    """One etcd member on 127.0.0.1: ``.endpoint`` is ``http://127.0.0.1:PORT`` (``https`` with ``tls``)."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        name: str = "conveyor-test",
        extra: list[str] | None = None,
        binary: str = "etcd",
        tls: EtcdTls | None = None,
        client_port: int = 0,
        peer_port: int = 0,
        new_session: bool = False,
    ) -> None:
        """``client_port``/``peer_port``: 0 picks free ones at the first start (both or neither);
        ``new_session``: its own session, so a terminal's Ctrl-C reaches only the process that started it."""
        self._own_directory = directory is None
        self.directory = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="conveyor-etcd-"))
        self.name = name
        self.extra = list(extra or [])
        self.binary = binary
        self.tls = tls
        self.client_port = client_port if peer_port else 0
        self.peer_port = peer_port if client_port else 0
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.auth: tuple[str, str] | None = None  # (user, password) once enable_auth() ran

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        return self.directory / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "etcd was not started"
        return self.proc.pid

    def command(self) -> list[str]:
        client = self.endpoint
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            *("--name", self.name, "--data-dir", str(self.data_dir)),
            *("--listen-client-urls", client, "--advertise-client-urls", client),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new"),
            *("--logger", "zap", "--log-level", "warn"),
            *(self.tls.etcd_flags() if self.tls else []),
            *self.extra,
        ]

    def start(self, timeout: float = START_TIMEOUT) -> EtcdProcess:
        """Start etcd (on new free ports the first time, on the same ones after) and wait until it is healthy."""
        if shutil.which(self.binary) is None:
            raise RuntimeError(f"{self.binary} not found: `make deps` installs it (Debian package etcd-server)")
        first = self.client_port == 0
        for _attempt in range(5 if first else 1):  # a free port may be taken between the probe and etcd's bind
            if first:
                self.client_port, self.peer_port = free_port(), free_port()
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=self.new_session
                )
            self.paused = False
            try:
                self.wait_healthy(timeout)
                return self
            except RuntimeError:
                self.kill()
                if not (first and "address already in use" in self.log_tail().lower()):
                    raise
        raise RuntimeError("etcd could not bind free ports:\n" + self.log_tail())

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with self._open(f"{self.endpoint}/health", timeout) as answer:
                return bool(json.loads(answer.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``/health`` is true; RuntimeError with the end of etcd's log if it exits or takes too long."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no etcd log)"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = START_TIMEOUT) -> None:
        """SIGTERM and wait (a paused etcd is resumed first, or it could not exit)."""
        if not self.running():
            return
        assert self.proc is not None
        if self.paused:
            self.resume()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL this etcd (only its own pid)."""
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(START_TIMEOUT)
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: etcd keeps its sockets but answers nothing (a hung or partitioned etcd)."""
        assert self.running(), "etcd is not running"
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def restart(self, *, kill: bool = False, down_for: float = 0.0, timeout: float = START_TIMEOUT) -> EtcdProcess:
        """Stop (or kill) and start again on the same data and ports, ``down_for`` seconds later."""
        self.kill() if kill else self.stop()
        if down_for:
            time.sleep(down_for)
        return self.start(timeout)

    def close(self) -> None:
        """Stop etcd and remove its directory if this object made it."""
        self.kill()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    # etcd's auth, through the JSON gateway (tests of the client's user/password support)

    def post(self, path: str, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
        """One call to etcd's v3 JSON gateway (``path`` under ``/v3/``)."""
        request = urllib.request.Request(
            f"{self.endpoint}/v3/{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **({"Authorization": token} if token else {})},
        )
        with self._open(request, 30) as answer:
            result: dict[str, Any] = json.loads(answer.read())
            return result

    def _open(self, request: str | urllib.request.Request, timeout: float) -> Any:
        context = self.tls.client_context() if self.tls else None
        return urllib.request.urlopen(request, timeout=timeout, context=context)

    def enable_auth(self, password: str = "conveyor-root", user: str = "root") -> tuple[str, str]:
        """Create ``root`` with a password and turn auth on: from then on every call needs a token.

        Returns (user, password). Another user than root gets the root role too (all permissions).
        """
        self.post("auth/role/add", {"name": "root"})
        if user != "root":
            self.post("auth/user/add", {"name": "root", "password": password})
            self.post("auth/user/grant", {"user": "root", "role": "root"})
        self.post("auth/user/add", {"name": user, "password": password})
        self.post("auth/user/grant", {"user": user, "role": "root"})
        self.post("auth/enable", {})
        self.auth = (user, password)
        return self.auth

    def put(self, key: str, value: bytes) -> None:
        """Write a key without a client (setup in tests); uses the auth set by ``enable_auth``."""
        token = None
        if self.auth:
            token = self.post("auth/authenticate", {"name": self.auth[0], "password": self.auth[1]})["token"]
        encoded = {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value).decode()}
        self.post("kv/put", encoded, token)

    def __enter__(self) -> EtcdProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["EtcdProcess", "EtcdTls", "free_port"]

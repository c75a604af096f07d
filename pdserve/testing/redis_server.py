"""Throwaway redis-server instances for tests and benchmarks.

    from pdserve.testing.redis_server import start_redis_server, redis_server

    url, proc = start_redis_server()      # caller stops it: stop_redis_server(proc)
    with redis_server() as (url, proc): ...   # stopped on exit
    start_redis_server(password="pw")     # requirepass; url is redis://:pw@127.0.0.1:PORT
    start_redis_server(tls=TLSFiles(cert, key, ca))   # TLS port only; url is rediss://...
"""
from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple
from urllib.parse import quote

from pdserve.wire.transport import free_port  # noqa: E402  (re-exported for tests)

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _ping(port: int, timeout: float = 0.2) -> bool:
    """Raw RESP PING, so this helper needs no client library."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class TLSFiles(NamedTuple):
    """PEM files for a TLS redis-server: its certificate, its key, and the CA that signed it."""
    cert: str
    key: str
    ca: str


def _resp(*args: str) -> bytes:
    """One command in RESP array form, so a password may hold spaces or quotes."""
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        raw = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


def _ping_secure(port: int, password: str | None, tls: TLSFiles | None, timeout: float = 0.5) -> bool:
    """PING after AUTH and/or over TLS: a requirepass server answers a bare PING with -NOAUTH."""
    try:
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=timeout))
            if tls is not None:  # wrap_socket detaches the plain socket: the wrapper must be closed
                ctx = ssl.create_default_context(cafile=tls.ca)
                sock = stack.enter_context(ctx.wrap_socket(sock, server_hostname="127.0.0.1"))
            sock.sendall((_resp("AUTH", password) if password is not None else b"") + _resp("PING"))
            reply, expected = b"", 1 + (password is not None)  # one reply line per command
            while reply.count(b"\r\n") < expected:
                chunk = sock.recv(64)
                if not chunk:
                    return False
                reply += chunk
            return reply.endswith(b"+PONG\r\n")
    except OSError:
        return False


def stop_redis_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _security_args(port: int, password: str | None, tls: TLSFiles | None) -> list[str]:
    args = ["--requirepass", password] if password is not None else []
    if tls is not None:  # TLS only: --port 0 closes the plain-TCP port
        args += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", tls.cert, "--tls-key-file", tls.key,
                 "--tls-ca-cert-file", tls.ca, "--tls-auth-clients", "no"]
    return args


def start_redis_server(timeout: float = 10.0, attempts: int = 3, *, password: str | None = None,
                       tls: TLSFiles | None = None, extra_args: Sequence[str] = (),
                       port: int | None = None) -> tuple[str, subprocess.Popen]:
    """Start redis-server on a free port with persistence off; return (url, process) once it
    answers PING. Retries on a new port if another process grabbed the chosen one first.
    password sets requirepass (the url carries it); tls serves TLS only (a rediss:// url);
    port: this port, no retries (a server restarted where its clients expect it)."""
    fixed_port = port
    for _ in range(attempts if fixed_port is None else 1):
        port = fixed_port or free_port()
        # Later options win in redis-server, so the security ones override the plain --port.
        proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(port), "--save", "", "--appendonly", "no",
             "--bind", "127.0.0.1", *_security_args(port, password, tls), *extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        secure = password is not None or tls is not None
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if _ping_secure(port, password, tls) if secure else _ping(port):
                auth = f":{quote(password, safe='')}@" if password is not None else ""
                return f"{'rediss' if tls else 'redis'}://{auth}127.0.0.1:{port}", proc
            time.sleep(0.02)
        stop_redis_server(proc)
    raise RuntimeError(f"redis-server ({REDIS_SERVER}) did not start")


@contextlib.contextmanager
def redis_server(timeout: float = 10.0, **kwargs) -> Iterator[tuple[str, subprocess.Popen]]:
    """start_redis_server's keyword options (password=, tls=, extra_args=) pass through."""
    url, proc = start_redis_server(timeout, **kwargs)
    try:
        yield url, proc
    finally:
        stop_redis_server(proc)

"""Throwaway redis-server instances for tests and benchmarks.

    from redis_util import start_redis_server, redis_server

    url, proc = start_redis_server()      # caller stops it: stop_redis_server(proc)
    with redis_server() as (url, proc): ...   # stopped on exit
"""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from typing import Iterator

from pdserve.transport import free_port  # noqa: E402  (re-exported for tests)

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _ping(port: int, timeout: float = 0.2) -> bool:
    """Raw RESP PING, so this helper needs no client library."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def stop_redis_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def start_redis_server(timeout: float = 10.0, attempts: int = 3) -> tuple[str, subprocess.Popen]:
    """Start redis-server on a free port with persistence off; return (url, process) once it
    answers PING. Retries on a new port if another process grabbed the chosen one first."""
    for _ in range(attempts):
        port = free_port()
        proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(port), "--save", "", "--appendonly", "no",
             "--bind", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if _ping(port):
                return f"redis://127.0.0.1:{port}", proc
            time.sleep(0.02)
        stop_redis_server(proc)
    raise RuntimeError(f"redis-server ({REDIS_SERVER}) did not start")


@contextlib.contextmanager
def redis_server(timeout: float = 10.0) -> Iterator[tuple[str, subprocess.Popen]]:
    url, proc = start_redis_server(timeout)
    try:
        yield url, proc
    finally:
        stop_redis_server(proc)

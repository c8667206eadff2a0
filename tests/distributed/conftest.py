"""Real components for the distributed tests: a redis-server on a random local port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process of the Debian package, persisting nothing."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except Exception:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def client(self):  # -> redis.Redis
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, db=0)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture
def unused_port() -> int:
    """A local port nothing listens on."""
    return free_port()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()

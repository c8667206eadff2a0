"""Real components for the distributed tests: a redis-server on a random local port."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
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


@pytest.fixture
def ray_head_without_kvfuzz(tmp_path: Path) -> Iterator[str]:
    """The address of a 1-CPU Ray head whose Python has ray but not kvfuzz: a venv that reads
    this one's site-packages through a plain path entry, so the editable kvfuzz install (a .pth
    hook there) is not active in it. Started in its own session and stopped by killing that
    session only (never `ray stop`, which would stop every Ray on the machine)."""
    pytest.importorskip("ray")
    venv = tmp_path / "venv-without-kvfuzz"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "ray.scripts.scripts", "start", "--head", "--block",
         "--port", str(port), "--num-cpus", "1", "--include-dashboard=false",
         "--disable-usage-stats"], cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or head.poll() is not None:
                    raise RuntimeError("the Ray head did not start") from None
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)
        # `ray start` names its head in this file for later `ray.init()` calls: not a dead one.
        current = Path("/tmp/ray/ray_current_cluster")
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()

"""A real Redis server (Debian's ``redis-server``, installed by ``.ci/run``) on a free loopback port,
started per test module and stopped after it. Without the binary the remote-tier tests skip and
say why (in CI, ``CI=true``, its absence is a failure)."""

from __future__ import annotations

import os
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
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start within 10 s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("redis-server is not installed; .ci/run installs Debian's redis-server")
        pytest.skip("redis-server is not installed (apt-get install redis-server): the remote tier needs a real Redis")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()

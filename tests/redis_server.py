"""A real Redis for tests: a private redis-server, or the machine's own, or a skip.

    with redis_server() as server:      # in a module- or session-scoped fixture
        client = redis.Redis.from_url(server.url)
        store = RedisSessionStore(client, namespace=server.namespace("test"))

1. `redis-server` on PATH: start one on a free loopback port in a temporary directory, with no
   persistence (--save "" --appendonly no), wait until it answers PING, stop it afterwards.
2. else a Redis answering PING on 127.0.0.1:6379: use it; every namespace handed out is unique
   and its keys are deleted afterwards.
3. else pytest.skip, saying why.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import redis

START_TIMEOUT_S = 10.0


@dataclass
class RedisServer:
    url: str
    _namespaces: list[str] = field(default_factory=list)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def namespace(self, label: str = "test") -> str:
        """A key namespace no other test uses."""
        name = f"rsd-test-{label}-{uuid.uuid4().hex[:12]}"
        self._namespaces.append(name)
        return name

    def delete_namespaces(self) -> None:
        client = self.client()
        for name in self._namespaces:
            keys = list(client.scan_iter(match=f"{name}:*", count=1000))
            if keys:
                client.delete(*keys)
        client.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pings(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


@contextmanager
def _private_server(executable: str) -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="rsd-redis-") as tmp:
        for _attempt in range(3):  # another process may grab the port between probe and bind
            port = _free_port()
            cmd = [executable, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp]
            cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + START_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline and not _pings(url):
                time.sleep(0.02)
            if proc.poll() is None and _pings(url):
                break
            proc.kill()
            log = proc.communicate()[0].decode(errors="replace")
        else:
            raise RuntimeError(f"redis-server did not start on a free port; last output:\n{log}")
        try:
            yield RedisServer(url)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    executable = shutil.which("redis-server")
    if executable is not None:
        with _private_server(executable) as server:
            yield server
        return
    url = "redis://127.0.0.1:6379/0"
    if not _pings(url):
        pytest.skip("no redis-server on PATH and no Redis answering on 127.0.0.1:6379")
    server = RedisServer(url)
    try:
        yield server
    finally:
        server.delete_namespaces()

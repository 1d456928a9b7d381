"""A real Redis for tests: a private redis-server, or the machine's own, or a skip.

    with redis_server() as server:      # in a module- or session-scoped fixture
        client = redis.Redis.from_url(server.url)
        store = RedisSessionStore(client, namespace=server.namespace("test"))

1. `redis-server` on PATH: start one on a free loopback port in a temporary directory, with no
   persistence (--save "" --appendonly no), wait until it answers PING, stop it afterwards.
2. else a Redis answering PING on 127.0.0.1:6379: use it; every namespace handed out is unique
   and its keys are deleted afterwards.
3. else pytest.skip, saying why.

persistent_redis() is a private server with an append-only file, for tests that restart Redis.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import redis

from rsd_tools.launcher import free_port, redis_pings

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


@contextmanager
def _private_server(executable: str) -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="rsd-redis-") as tmp:
        for _attempt in range(3):  # another process may grab the port between probe and bind
            port = free_port()
            cmd = [executable, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp]
            cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + START_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline and not redis_pings(url):
                time.sleep(0.02)
            if proc.poll() is None and redis_pings(url):
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


class PersistentRedis:
    """A private redis-server that keeps its data on disk (AOF, fsync on every write), so it can be
    killed and started again on the same port with every acknowledged write still there.

        with persistent_redis() as server:
            server.kill()      # SIGKILL: nothing acknowledged is lost (appendfsync always)
            server.start()     # the same port and data directory
    """

    def __init__(self, executable: str, data_dir: str):
        self.executable, self.data_dir = executable, data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.data_dir]
        cmd += ["--save", "", "--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no"]
        self.proc = subprocess.Popen([*cmd, "--loglevel", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not redis_pings(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.communicate()
        self.proc = None


@contextmanager
def persistent_redis() -> Iterator[PersistentRedis]:
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.skip("restarting Redis needs redis-server on PATH")
    with tempfile.TemporaryDirectory(prefix="rsd-redis-aof-") as tmp:
        server = PersistentRedis(executable, tmp)
        server.start()
        try:
            yield server
        finally:
            server.kill()


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    executable = shutil.which("redis-server")
    if executable is not None:
        with _private_server(executable) as server:
            yield server
        return
    url = "redis://127.0.0.1:6379/0"
    if not redis_pings(url):
        pytest.skip("no redis-server on PATH and no Redis answering on 127.0.0.1:6379")
    server = RedisServer(url)
    try:
        yield server
    finally:
        server.delete_namespaces()

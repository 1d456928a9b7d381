"""The gateway tests' fixtures: the tiny Qwen2 pair and its tokenizer, the servers' event loop, redis-server,
both session stores and a started stack (tests/fixtures/stack.py)."""

import time

import pytest

from gateway.store.memory_store import MemorySessionStore
from gateway.store.redis_store import RedisSessionStore
from rsd_runtime.models import load_model
from rsd_runtime.tokenizer import load_tokenizer
from rsd_tools.tiny import build_tiny_pair
from tests.fixtures.redis_server import redis_server
from tests.fixtures.stack import LoopThread, start_stack


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"), "qwen2")


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dirs):
    return load_tokenizer(tiny_dirs[1])


@pytest.fixture(scope="module")
def pair(tiny_dirs, tiny_tokenizer):
    return load_model(tiny_dirs[0]), load_model(tiny_dirs[1]), tiny_tokenizer


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as server:
        yield server.url


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        return MemorySessionStore()
    url = request.getfixturevalue("redis_url")
    return RedisSessionStore.from_url(url, namespace=f"rsd-test-gw-{time.monotonic_ns()}")


@pytest.fixture
def stack(loop, pair, store):
    s = start_stack(loop, pair, store)
    yield s
    s.stop()

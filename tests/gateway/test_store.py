"""gateway.store: one suite run against MemorySessionStore and RedisSessionStore (a real redis-server)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from gateway.store.memory_store import MemorySessionStore
from gateway.store.redis_store import RedisSessionStore
from gateway.store.session import KvLocation, SessionConflict, SessionExists, SessionNotFound, SessionStatus
from rsd_service.registry import ServiceInfo
from tests.fixtures.redis_server import redis_server

PROMPT = [5, 6, 7]
PARAMS = {"sampling": {"temperature": 0.7, "top_k": 20}, "method": {"name": "rsd_c", "shape": "2,2"}, "seed": 3}


@pytest.fixture(scope="module")
def redis_srv():
    with redis_server() as server:
        yield server


class FakeClock:
    """A monotonic clock that moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture(params=["memory", "redis"])
def make_store(request, clock):
    """make_store(session_ttl_s) -> a new empty store of the parametrized kind (memory: on `clock`)."""
    clients = []

    def make(session_ttl_s: float = 60.0):
        if request.param == "memory":
            return MemorySessionStore(session_ttl_s, clock=clock)
        server = request.getfixturevalue("redis_srv")
        clients.append(server.client())
        return RedisSessionStore(clients[-1], server.namespace(), session_ttl_s)

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def store(make_store):
    return make_store()


@pytest.fixture
def skip_ahead(clock):
    """skip_ahead(store, seconds): let that much time pass for the store's TTLs, without sleeping.
    The memory store's clock moves; in Redis every key of the store's namespace loses that much TTL
    (a key whose TTL reaches 0 is deleted by Redis itself, as expiry would)."""

    def skip(store, seconds: float) -> None:
        if isinstance(store, MemorySessionStore):
            clock.now += seconds
            return
        for key in store.client.scan_iter(match=f"{store.namespace}:*"):
            left_ms = store.client.pttl(key)
            if left_ms > 0:
                store.client.pexpire(key, left_ms - round(seconds * 1000))  # <= 0 deletes the key

    return skip


def started(store, session_id: str = "s1") -> int:
    """A session with its first run begun; returns the run's epoch."""
    store.create_session(session_id, PROMPT, PARAMS)
    return store.begin_epoch(session_id, 0, "drafter-0", "verifier-0")


def test_create_and_get(store):
    record = store.create_session("s1", PROMPT, PARAMS)
    assert record.prompt_ids == record.committed_ids == tuple(PROMPT)
    assert record.params == PARAMS
    assert record.status == SessionStatus.PENDING
    assert (record.drafter_id, record.verifier_id, record.kv, record.epoch) == ("", "", KvLocation(), 0)
    assert record.created_unix_ms == record.updated_unix_ms > 0
    assert store.get_session("s1") == record
    assert store.get_tokens("s1") == PROMPT
    assert store.get_tokens("s1", start=1) == PROMPT[1:]
    assert store.get_tokens("s1", start=10) == []


def test_params_come_back_as_json(store):
    store.create_session("s1", PROMPT, {"stop": ("a", "b")})
    assert store.get_session("s1").params == {"stop": ["a", "b"]}


def test_unknown_and_duplicate_sessions(store):
    store.create_session("s1", PROMPT, PARAMS)
    with pytest.raises(SessionExists):
        store.create_session("s1", [1], {})
    for call in (
        lambda: store.get_session("nope"),
        lambda: store.get_tokens("nope"),
        lambda: store.append_tokens("nope", 0, [1], 0),
        lambda: store.begin_epoch("nope", 0, "d", "v"),
        lambda: store.set_kv_length("nope", 0, 1),
        lambda: store.update_session("nope", status=SessionStatus.FAILED),
    ):
        with pytest.raises(SessionNotFound):
            call()
    assert store.delete_session("s1") is True
    assert store.delete_session("s1") is False
    with pytest.raises(SessionNotFound):
        store.get_session("s1")


def test_append_at_the_committed_length(store):
    epoch = started(store)
    assert store.append_tokens("s1", 3, [8, 9], epoch) == 5
    assert store.append_tokens("s1", 5, [10], epoch) == 6
    assert store.get_session("s1").committed_ids == (5, 6, 7, 8, 9, 10)
    assert store.get_tokens("s1", start=3) == [8, 9, 10]


def test_duplicate_and_out_of_order_appends_are_refused(store):
    epoch = started(store)
    store.append_tokens("s1", 3, [8, 9], epoch)
    for position in (3, 4, 6, 0):  # a retry of the same step, an overlap, a gap, the start
        with pytest.raises(SessionConflict) as err:
            store.append_tokens("s1", position, [8, 9], epoch)
        assert (err.value.committed_length, err.value.epoch) == (5, epoch)
    assert store.get_tokens("s1") == [5, 6, 7, 8, 9]


def test_stale_epochs_are_refused(store):
    old = started(store)
    new = store.begin_epoch("s1", old, "drafter-1", "verifier-1")
    assert new == old + 1
    with pytest.raises(SessionConflict) as err:
        store.append_tokens("s1", 3, [8], old)
    assert (err.value.committed_length, err.value.epoch) == (3, new)
    with pytest.raises(SessionConflict):
        store.begin_epoch("s1", old, "drafter-2", "verifier-2")  # a second gateway lost the race
    with pytest.raises(SessionConflict):
        store.set_kv_length("s1", old, 3)
    with pytest.raises(SessionConflict):
        store.update_session("s1", status=SessionStatus.FINISHED, epoch=old)
    assert store.append_tokens("s1", 3, [8], new) == 4
    record = store.get_session("s1")
    assert (record.drafter_id, record.verifier_id, record.status) == ("drafter-1", "verifier-1", SessionStatus.RUNNING)


def test_only_one_of_racing_appends_wins(store):
    epoch = started(store)
    wins, conflicts = [], []

    def append(token: int) -> None:
        try:
            wins.append(store.append_tokens("s1", 3, [token, token], epoch))
        except SessionConflict:
            conflicts.append(token)

    threads = [threading.Thread(target=append, args=(100 + i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins == [5] and len(conflicts) == 7
    tokens = store.get_tokens("s1")
    assert len(tokens) == 5 and tokens[3] == tokens[4] not in conflicts


def test_kv_location_follows_the_runs(store):
    epoch = started(store)
    assert store.get_session("s1").kv == KvLocation("verifier-0", 0, epoch)
    store.set_kv_length("s1", epoch, 3)
    epoch = store.begin_epoch("s1", epoch, "drafter-1", "verifier-0")  # drafter restarted: cache kept
    assert store.get_session("s1").kv == KvLocation("verifier-0", 3, epoch)
    epoch = store.begin_epoch("s1", epoch, "drafter-1", "verifier-1")  # verifier moved: cache lost
    assert store.get_session("s1").kv == KvLocation("verifier-1", 0, epoch)


def test_update_session(store, skip_ahead):
    epoch = started(store)
    before = store.get_session("s1")
    skip_ahead(store, 0.002)  # the memory store's clock; Redis TIME moves by itself:
    time.sleep(0.002)
    store.update_session("s1", status=SessionStatus.FINISHED, params={"seed": 9}, epoch=epoch)
    after = store.get_session("s1")
    assert (after.status, after.params) == (SessionStatus.FINISHED, {"seed": 9})
    assert after.updated_unix_ms > before.updated_unix_ms
    store.update_session("s1", status=SessionStatus.CANCELLED)  # no epoch: unconditional
    assert store.get_session("s1").status == SessionStatus.CANCELLED


def test_finish_reason_is_kept_until_the_next_run(store):
    epoch = started(store)
    assert store.get_session("s1").finish_reason == ""
    store.update_session("s1", status=SessionStatus.FINISHED, finish_reason="eos", epoch=epoch)
    assert store.get_session("s1").finish_reason == "eos"
    store.begin_epoch("s1", epoch, "drafter-0", "verifier-0")  # the next turn: not finished yet
    assert store.get_session("s1").finish_reason == ""
    with pytest.raises(ValueError):
        store.update_session("s1", finish_reason="Not a reason")


def test_running_sessions(store):
    epoch = started(store, "s1")
    started(store, "s2")
    store.create_session("s3", PROMPT, PARAMS)  # pending: no turn yet
    assert store.running_sessions() == ["s1", "s2"]
    store.update_session("s1", status=SessionStatus.FINISHED, epoch=epoch)
    store.delete_session("s2")
    assert store.running_sessions() == []
    store.begin_epoch("s1", epoch, "drafter-0", "verifier-0")
    assert store.running_sessions() == ["s1"]


def test_leases_are_stamped_by_the_stores_clock(store):
    """updated_unix_ms comes from the store's clock (Redis TIME), which now_ms() reads: comparable
    whatever the clock of the process that wrote it."""
    before = store.now_ms()
    epoch = started(store)
    stamped = store.get_session("s1").updated_unix_ms
    store.append_tokens("s1", 3, [8], epoch)
    after = store.now_ms()
    assert before <= stamped <= store.get_session("s1").updated_unix_ms <= after


def test_the_memory_stores_clock_can_be_injected():
    now = [1000.0]
    store = MemorySessionStore(clock=lambda: now[0])
    epoch = started(store)
    assert store.now_ms() == store.get_session("s1").updated_unix_ms == 1_000_000
    now[0] = 1007.5
    store.update_session("s1", epoch=epoch)
    assert store.get_session("s1").updated_unix_ms == store.now_ms() == 1_007_500


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.create_session("a:b", PROMPT, {}),  # ':' would reach into another key
        lambda s: s.create_session("", PROMPT, {}),
        lambda s: s.create_session("s2", [], {}),
        lambda s: s.create_session("s2", [-1], {}),
        lambda s: s.create_session("s2", [2**32], {}),
        lambda s: s.append_tokens("s1", 3, [], 1),
        lambda s: s.append_tokens("s1", -1, [1], 1),
        lambda s: s.get_tokens("s1", start=-1),
        lambda s: s.register_service(ServiceInfo("verifier", "v 1", "x:1"), 1.0),
        lambda s: s.register_service(ServiceInfo("verifier", "v1", "x:1"), 0),
    ],
)
def test_bad_arguments_raise_value_error(store, call):
    started(store)
    with pytest.raises(ValueError):
        call(store)
    assert store.get_tokens("s1") == PROMPT


def test_sessions_expire_unless_written(make_store, skip_ahead):
    store = make_store(session_ttl_s=60)
    epoch = started(store)
    skip_ahead(store, 40)
    store.append_tokens("s1", 3, [8], epoch)  # refreshes the TTL
    skip_ahead(store, 40)
    assert store.get_tokens("s1") == [*PROMPT, 8]  # 80 s after creation, 40 s after the write
    skip_ahead(store, 30)
    with pytest.raises(SessionNotFound):
        store.get_session("s1")
    store.create_session("s1", [1], {})  # an expired id is free again


def test_service_registry_heartbeats_expire(store, skip_ahead):
    v0 = ServiceInfo("verifier", "v0", "127.0.0.1:7001", capacity=8, load=1)
    v1 = ServiceInfo("verifier", "v1", "127.0.0.1:7002", capacity=8, load=0)
    store.register_service(v1, ttl_s=40)
    store.register_service(v0, ttl_s=40)
    store.register_service(ServiceInfo("drafter", "d0", "127.0.0.1:7101"), ttl_s=500)
    assert store.list_services("verifier") == [v0, v1]
    skip_ahead(store, 25)
    v0_loaded = ServiceInfo("verifier", "v0", "127.0.0.1:7001", capacity=8, load=5)
    store.register_service(v0_loaded, ttl_s=40)  # heartbeat with the new load
    skip_ahead(store, 25)
    assert store.list_services("verifier") == [v0_loaded]  # v1 missed its heartbeat
    store.unregister_service("verifier", "v0")
    assert store.list_services("verifier") == []
    assert [s.service_id for s in store.list_services("drafter")] == ["d0"]
    assert store.list_services("nobody") == []


def test_registry_entries_carry_max_len_and_ignore_unknown_fields(redis_srv):
    """max_len travels with an entry; an older entry (no max_len) reads as 0, not advertised; a newer
    service's fields this version does not know are dropped, not a TypeError for every gateway."""
    client = redis_srv.client()
    store = RedisSessionStore(client, redis_srv.namespace("fields"), session_ttl_s=30)
    store.register_service(ServiceInfo("verifier", "v0", "127.0.0.1:7001", 4, 1, max_len=512), ttl_s=10)
    assert store.list_services("verifier")[0].max_len == 512
    old = {"role": "verifier", "service_id": "v0", "address": "a:1", "capacity": 4, "load": 1}
    assert ServiceInfo.from_json(json.dumps(old)) == ServiceInfo("verifier", "v0", "a:1", 4, 1, max_len=0)
    newer = json.dumps({**old, "max_len": 64, "gpu": "h200"}).encode()
    assert ServiceInfo.from_json(newer) == ServiceInfo("verifier", "v0", "a:1", 4, 1, max_len=64)
    client.close()


def test_redis_keys_are_namespaced_and_expire(redis_srv):
    client = redis_srv.client()
    a = RedisSessionStore(client, redis_srv.namespace("a"), session_ttl_s=30)
    b = RedisSessionStore(client, redis_srv.namespace("b"), session_ttl_s=30)
    epoch = started(a)
    a.append_tokens("s1", 3, [8], epoch)
    a.register_service(ServiceInfo("verifier", "v0", "127.0.0.1:7001"), ttl_s=10)
    with pytest.raises(SessionNotFound):
        b.get_session("s1")
    assert b.list_services("verifier") == []
    b.create_session("s1", [1, 2], {})  # the same id in another namespace is another session
    assert a.get_tokens("s1") == [*PROMPT, 8] and b.get_tokens("s1") == [1, 2]

    keys = {k.decode() for k in client.scan_iter(match=f"{a.namespace}:*")}
    assert set(a.session_keys("s1")) <= keys and any(":v0" in k for k in keys)  # the session and the registry
    assert f"{a.namespace}:running" in keys  # the running-turns set the orphan sweep reads
    assert all(0 < client.pttl(k) <= 30_000 for k in keys)  # every key expires
    assert client.strlen(f"{a.namespace}:session:s1:tokens") == 4 * 4  # packed uint32
    client.close()


def test_redis_store_rejects_a_decoding_client(redis_srv):
    import redis

    with pytest.raises(ValueError, match="decode_responses"):
        RedisSessionStore(redis.Redis.from_url(redis_srv.url, decode_responses=True))

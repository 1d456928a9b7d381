"""The Ray verifier pool (deploy/ray_pool.py): its scaling policy alone, its command line, and a real
local Ray cluster whose replicas serve sessions of a real gateway + drafter through a real Redis.

Ray binds to the machine's routable address even when told 127.0.0.1, so the `ray` tests run only
inside a private network namespace with just loopback up; scripts/test.sh starts them that way:
    unshare -n sh -c 'ip link set lo up && RSD_NETNS=1 .venv/bin/pytest -m ray tests/e2e/test_ray_pool.py'
Everything they need (redis-server, drafter, gateway, Ray) starts inside that namespace. One Ray
cluster and one pool serve all of them, in order: spread, kill + failover, scale up, drain + scale down.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest

from deploy.ray_pool import PoolConfig, ScalingPolicy, desired_replicas, parse_args
from verifier_service.config import VerifierConfig

# ---------------------------------------------------------------------------------------------
# The policy, alone (no Ray)

POLICY = ScalingPolicy(
    min_replicas=1, max_replicas=4, sessions_per_replica=3, scale_up_cooldown_s=10, scale_down_cooldown_s=60
)


@pytest.mark.parametrize(
    ("current", "samples", "since_change_s", "expected"),
    [
        (2, [7], 100, 3),  # 7 sessions need ceil(7/3) = 3 replicas
        (2, [0, 20], 100, 4),  # up to what the latest needs, capped at max
        (2, [20, 0], 100, 2),  # the latest is low, but 20 sessions in the window: no scale-down
        (2, [3, 2, 1], 100, 1),  # the whole window fits in one replica
        (3, [0, 0], 100, 2),  # down one replica at a time
        (2, [4, 6, 5], 100, 2),  # inside the band (fits 2, not 1): nothing changes (hysteresis)
        (2, [7], 5, 2),  # scale-up cooldown
        (2, [0], 30, 2),  # scale-down cooldown
        (1, [0], 1000, 1),  # never below min
        (0, [], 0, 1),  # below min: corrected at once, cooldown or not
        (6, [50], 0, 4),  # above max: corrected at once
        (2, [], 100, 2),  # no sample yet: keep
    ],
)
def test_desired_replicas(current, samples, since_change_s, expected):
    assert desired_replicas(POLICY, current, samples, since_change_s) == expected


def test_policy_is_stable_under_a_steady_load():
    """A load that sits in the band moves nothing, sample after sample."""
    counts = {desired_replicas(POLICY, 2, [4 + (i % 3)] * 5, 1000) for i in range(20)}
    assert counts == {2}


def test_command_line_splits_pool_and_verifier_flags():
    env = {"RSD_POOL_MAX_REPLICAS": "5", "RSD_VERIFIER_NUM_SLOTS": "16"}
    argv = ["--replicas", "2", "--model", "/m", "--min-replicas=1", "--device", "cuda:0", "--num-gpus-per-replica", "1"]
    pool, verifier = parse_args([*argv, "--dtype", "bfloat16", "--redis-url", "redis://r:6379/0"], env=env)
    assert (pool.replicas, pool.min_replicas, pool.max_replicas, pool.num_gpus_per_replica) == (2, 1, 5, 1.0)
    assert (verifier.model, verifier.device, verifier.dtype, verifier.num_slots) == ("/m", "cuda:0", "bfloat16", 16)
    assert verifier.redis_url == "redis://r:6379/0"
    with pytest.raises(ValueError, match="replicas"):
        PoolConfig(replicas=3, min_replicas=1, max_replicas=2)
    assert PoolConfig(replicas=2).bounds == (2, 2)  # fixed size unless min/max say otherwise


# ---------------------------------------------------------------------------------------------
# A real Ray cluster (inside a private network namespace)

in_netns = pytest.mark.skipif(
    os.environ.get("RSD_NETNS") != "1",
    reason="needs a private network namespace: unshare -n (scripts/test.sh runs `pytest -m ray` so)",
)
PROMPTS = [f"w2 w{10 + i} w{30 + 2 * i}" for i in range(6)]
GREEDY = {"temperature": 0.0, "seed": 0, "method": "sd", "shape": "2"}


@dataclasses.dataclass
class Cluster:
    loop: object
    pool: object
    store: object  # RedisSessionStore of the gateway's namespace: sessions and the registry
    pair: tuple
    address: str

    def client(self):
        from rsd_service.client import RsdClient

        return RsdClient(self.address, timeout_s=300)

    def live_verifiers(self) -> set[str]:
        return {s.service_id for s in self.store.list_services("verifier")}

    def expected(self, prompt: str, max_new_tokens: int) -> list[int]:
        from tests.gateway.test_engine import reference

        ids = self.pair[2].encode(prompt, add_special_tokens=False)
        return reference(self.pair, ids, GREEDY["method"], GREEDY["shape"], max_new_tokens)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Logical CPUs only (what actors reserve); workers share the machine's real cores.
    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=100 * 1024**2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory):
    from deploy.ray_pool import ReplicaPool
    from drafter_service.config import DrafterConfig
    from drafter_service.server import create_server as create_drafter
    from gateway.config import GatewayConfig
    from gateway.server import create_server as create_gateway
    from gateway.store.redis_store import RedisSessionStore
    from rsd_runtime.models import load_model
    from rsd_runtime.tokenizer import load_tokenizer
    from rsd_tools.tiny import build_tiny_pair
    from tests.fixtures.redis_server import redis_server
    from tests.fixtures.stack import LoopThread

    draft_dir, target_dir = build_tiny_pair(tmp_path_factory.mktemp("tiny"), "qwen2")
    pair = (load_model(draft_dir), load_model(target_dir), load_tokenizer(target_dir))
    with redis_server() as redis:
        namespace = redis.namespace("ray")
        # Short heartbeats: a killed replica's entry lingers one TTL (1.5 s).
        registry = {"redis_url": redis.url, "redis_namespace": namespace, "heartbeat_s": 0.5, "registration_ttl_s": 1.5}
        verifier = VerifierConfig(model=str(target_dir), num_slots=4, threads=1, **registry)
        pool_config = PoolConfig(
            replicas=2, min_replicas=1, max_replicas=3, num_cpus_per_replica=1, window_s=1.0, drain_timeout_s=30
        )
        pool = ReplicaPool(verifier, pool_config)
        pool.start(timeout_s=300)
        loop = LoopThread()

        async def start():
            server, _, handle = await create_drafter(DrafterConfig(drafter_id="d0", threads=1, **registry), pair[0])
            store = RedisSessionStore.from_url(redis.url, namespace=namespace)
            config = GatewayConfig(port=0, redis_url=redis.url, redis_namespace=namespace)
            gateway, port, _ = await create_gateway(config, store=store, tokenizer=pair[2])
            return (server, handle), gateway, port

        dserver, gateway, port = loop.run(start(), timeout_s=300)
        try:
            yield Cluster(
                loop, pool, RedisSessionStore.from_url(redis.url, namespace=namespace), pair, f"127.0.0.1:{port}"
            )
        finally:
            loop.run(gateway.stop(0))
            loop.run(dserver[1].close(dserver[0], 0))
            loop.close()
            pool.close(drain=False)


def _generate_all(cluster: Cluster, prompts: list[str], max_new_tokens: int) -> dict[int, object]:
    """Run the prompts as concurrent sessions; returns {index: Generation}."""
    results: dict[int, object] = {}

    def run(i):
        with cluster.client() as client:
            results[i] = client.generate(prompts[i], max_new_tokens=max_new_tokens, **GREEDY).wait()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def _verifier_of(cluster: Cluster, session_id: str) -> str:
    with cluster.client() as client:
        return client.get_session(session_id).verifier_id


@pytest.mark.ray
@in_netns
def test_sessions_spread_over_the_replicas(cluster):
    assert cluster.live_verifiers() == {"verifier-pool-0", "verifier-pool-1"}
    # One after the other, each while the ones before still run: the gateway counts a running turn
    # on its verifier. (A burst of sessions that arrive together all land on the same replica: the
    # gateway picks before it counts, see the report.)
    with cluster.client() as client:
        running = []
        for prompt in PROMPTS[:4]:
            gen = client.generate(prompt, max_new_tokens=60, **GREEDY)
            running.append((gen, iter(gen)))
            next(running[-1][1])
        for _, events in running:
            list(events)
    for prompt, (gen, _) in zip(PROMPTS, running, strict=False):
        assert gen.token_ids == cluster.expected(prompt, 60)
    served = {_verifier_of(cluster, gen.session_id) for gen, _ in running}
    assert served == {"verifier-pool-0", "verifier-pool-1"}


@pytest.mark.ray
@in_netns
def test_killed_replica_sessions_finish_on_another(cluster):
    import ray

    with cluster.client() as client:
        gen = client.generate(PROMPTS[4], max_new_tokens=300, **GREEDY)
        events = iter(gen)
        first = next(events)
        victim = client.get_session(gen.session_id).verifier_id
        ray.kill(cluster.pool.replicas[victim].actor)  # no drain: the process is gone at once
        deltas = [first, *events]
        session = client.get_session(gen.session_id, include_token_ids=True)
    prompt_ids = cluster.pair[2].encode(PROMPTS[4], add_special_tokens=False)
    expected = cluster.expected(PROMPTS[4], 300)
    assert gen.token_ids == expected
    position = len(prompt_ids)
    for delta in deltas:  # no gap, no repeat
        assert delta.start_position == position
        position += len(delta.token_ids)
    assert list(session.committed_token_ids) == prompt_ids + expected
    assert session.verifier_id != victim and session.kv_location.epoch == 2
    # The pool notices the dead replica (min_replicas is 1: nothing to replace).
    cluster.pool.step()
    assert victim not in cluster.pool.replicas and cluster.pool.size == 1


def _step_until(pool, done, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the pool did not get there in time"
        pool.step()
        time.sleep(0.1)


@pytest.mark.ray
@in_netns
def test_scale_up_under_load_then_drain_and_scale_down(cluster):
    import ray

    pool = cluster.pool
    # One active session per replica, no scale-up cooldown: the measured load alone grows the pool;
    # no scale-down yet (the samples before the load starts are 0).
    pool.policy = dataclasses.replace(
        pool.policy, sessions_per_replica=1, scale_up_cooldown_s=0, scale_down_cooldown_s=1e9
    )
    before = set(pool.replicas)
    loaded: dict[int, object] = {}
    load = threading.Thread(target=lambda: loaded.update(_generate_all(cluster, PROMPTS[:4], 200)))
    load.start()
    _step_until(pool, lambda: pool.size == 3)  # 4 sessions running on 1 replica: 4 wanted, 3 at most
    load.join(300)
    added = set(pool.replicas) - before
    pool.wait_serving(3, timeout_s=300)
    for i, gen in loaded.items():
        assert gen.token_ids == cluster.expected(PROMPTS[i], 200), i

    # New sessions go to the new, least loaded replica.
    fresh = _generate_all(cluster, PROMPTS[4:6], 12)
    assert {_verifier_of(cluster, gen.session_id) for gen in fresh.values()} & added

    # Drain a replica while it runs a session: it leaves the registry at once, keeps streaming.
    with cluster.client() as client:
        gen = client.generate(PROMPTS[0], max_new_tokens=300, **GREEDY)
        events = iter(gen)
        next(events)
        draining = client.get_session(gen.session_id).verifier_id
        pool.drain(draining)
        deadline = time.monotonic() + 10
        while draining in cluster.live_verifiers():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        open_streams, _, _ = ray.get(pool.replicas[draining].actor.load.remote())
        list(events)
        session = client.get_session(gen.session_id)
    assert open_streams == 1  # the drain waits for it
    assert gen.token_ids == cluster.expected(PROMPTS[0], 300)
    assert session.verifier_id == draining and session.kv_location.epoch == 1  # never moved

    # No load, no cooldown: down to min_replicas, one drained replica at a time.
    pool.policy = dataclasses.replace(pool.policy, scale_down_cooldown_s=0)
    _step_until(pool, lambda: pool.size == 1 and not pool.in_state("draining"))
    (last,) = pool.replicas
    deadline = time.monotonic() + 10
    while cluster.live_verifiers() != {last}:  # drained replicas unregistered themselves
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (after,) = _generate_all(cluster, PROMPTS[1:2], 12).values()
    assert after.token_ids == cluster.expected(PROMPTS[1], 12)
    assert _verifier_of(cluster, after.session_id) == last

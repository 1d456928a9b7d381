"""Faults injected for real: `kill -9` of a verifier, a drafter or a gateway mid-generation (resumed on
another gateway, or finished there by its orphan sweep), Redis killed and restarted mid-generation, a
verifier that answers late or drops its stream.

The process faults run the services as real processes (`python -m verifier_service` ..., started with
rsd_tools.launcher) on tiny Qwen2 models, with a redis-server that keeps an
append-only file (tests/fixtures/redis_server.py), so it can be killed and restarted with its data. One cluster
serves the module: two verifiers, two drafters, two gateways; a test that needs a role it killed
earlier starts a new process of that role.

Every generation is greedy (T=0), or seeded at T=1 (with every core busy while the service is killed), so its
tokens must equal those of an uninterrupted run through the same cluster. The client's stream must have no
gap and no repeat (absolute positions), and the store's committed tokens must be the prompt plus exactly those
tokens. Recovery times (kill -> next token at
the client) are printed; with RSD_FAULTS_REPORT=path they are written there as markdown
(benchmarks/results/faults.md). No timed assertion: tests check behaviour.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from gateway.requests import finish_reason_name
from gateway.store.redis_store import RedisSessionStore
from rsd_service.client import RsdClient
from rsd_tools.launcher import (
    Cluster,
    Process,
    drafter_command,
    free_port,
    gateway_command,
    service_env,
    verifier_command,
    wait_all_ready,
)
from rsd_tools.tiny import build_tiny_pair
from rsd_wire import gateway_pb2
from tests.fixtures.load import busy_cores
from tests.fixtures.redis_server import persistent_redis

PROMPT = "w2 w10 w11 w12"
LONG = {"method": "sd", "shape": "2", "temperature": 0.0, "seed": 0, "max_new_tokens": 400}
SAMPLED = {"method": "rsd_s", "shape": "2x3", "temperature": 1.0, "seed": 5, "max_new_tokens": 160}
RECOVERY: dict[str, float] = {}  # fault -> seconds from the kill to the next token at the client


class FaultCluster:
    """Processes of each role on loopback, registered in one Redis; start more, kill one."""

    def __init__(self, run_dir: Path, models: tuple[Path, Path], redis):
        self.cluster, self.redis = Cluster(run_dir), redis
        self.draft_dir, self.target_dir = models
        self.env = service_env()
        self.count = 0

    def alive(self, role: str) -> list[Process]:
        return [p for p in self.cluster.processes if p.name.startswith(role) and p.proc.poll() is None]

    def ensure(self, **wanted: int) -> None:
        """At least `n` live processes of each role (started in parallel, then waited for)."""
        started = []
        for role, n in wanted.items():
            for _ in range(n - len(self.alive(role))):
                started.append(self._spawn(role))
        if not started:
            return
        wait_all_ready(started, 120.0)
        store = RedisSessionStore.from_url(self.redis.url)
        deadline = time.monotonic() + 30
        for p in started:  # the gateway finds services in the registry: wait until they are listed there
            role = p.name.rstrip("0123456789")
            while role != "gateway" and p.name not in {s.service_id for s in store.list_services(role)}:
                assert time.monotonic() < deadline, f"{p.name} never registered"
                time.sleep(0.1)
        store.client.close()

    def _spawn(self, role: str) -> Process:
        name, port = f"{role}{self.count}", free_port()
        self.count += 1
        registry = ["--redis-url", self.redis.url]
        if role == "gateway":
            cmd = gateway_command(port, self.target_dir, *registry, "--gateway-id", name)
        elif role == "verifier":
            cmd = verifier_command(port, self.target_dir, name, *registry, "--threads", "1")
        else:
            cmd = drafter_command(port, self.draft_dir, name, *registry, "--threads", "1")
        return self.cluster.spawn(name, cmd, self.env, f"127.0.0.1:{port}")

    def process(self, name: str) -> Process:
        return next(p for p in self.cluster.processes if p.name == name)

    def kill(self, name: str) -> None:
        """kill -9: no drain, no unregister, no goodbye to any peer."""
        proc = self.process(name).proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        self.cluster.stop(3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    models = build_tiny_pair(tmp_path_factory.mktemp("tiny"), "qwen2")
    with persistent_redis() as redis:
        c = FaultCluster(tmp_path_factory.mktemp("faults"), models, redis)
        try:
            c.ensure(verifier=2, drafter=2, gateway=2)
            yield c
        finally:
            c.stop()
    _write_report()


@pytest.fixture(scope="module")
def expected(cluster):
    """The uninterrupted run every faulty one must equal."""
    with RsdClient(cluster.alive("gateway")[0].address, timeout_s=120) as client:
        gen = client.generate(PROMPT, **LONG).wait()
    assert len(gen.token_ids) > 20
    return gen


def _write_report() -> None:
    path = os.environ.get("RSD_FAULTS_REPORT")
    if not path or not RECOVERY:
        return
    lines = [
        "# Fault recovery (tests/e2e/test_faults.py)",
        "",
        "Tiny Qwen2 pair, every service a real process on loopback, 2-core CPU shared with other work;",
        "greedy sd 2, 400 new tokens. Recovery: from the kill to the next token at the client.",
        "",
        "| fault | recovery (s) |",
        "| --- | --- |",
        *(f"| {fault} | {seconds:.2f} |" for fault, seconds in RECOVERY.items()),
        "",
        "- verifier / drafter: the drafter's stream breaks at once; the gateway probes both services' health,",
        "  drops the dead one, begins a new epoch and re-runs from the committed tokens in Redis (a verifier",
        "  re-prefills them). Every token equal to the uninterrupted run, positions contiguous.",
        "- gateway: the client's stream fails UNAVAILABLE; it resumes on the other gateway with (session id,",
        "  position). That gateway takes the turn over once the dead one's turn lease (turn_lease_s = 5 s,",
        "  refreshed every 1.7 s, compared on Redis's clock) has expired, so the figure is the lease plus a poll.",
        "  With no client coming back, the other gateway's orphan sweep (every 2 s) finishes the turn alone.",
        "- Redis: down for 1 s (SIGKILL, append-only file with fsync always), then restarted on its port; the",
        "  gateway retries its store calls (up to store_retry_s = 15 s, then UNAVAILABLE) and the generation",
        "  goes on where it was, no committed token lost.",
        "- a verifier that answers late (past the drafter's per-step deadline) or drops its stream after",
        "  committing: the drafter resends the same tree on a fresh stream and gets the stored verdict; the",
        "  verifier's KV cache and sequence hold every step once (T=0.8, seeded: equal to the in-process run).",
        "",
    ]
    Path(path).write_text("\n".join(lines))


def follow(gen, position: int, events: list) -> int:
    """Consume a stream, checking each delta starts where the last ended; -> the position after it."""
    for delta in gen:
        assert delta.start_position == position, "a gap or a repeat in the stream"
        position += len(delta.token_ids)
        events.append((time.perf_counter(), delta))
    return position


def first_delta(gen, prompt_len: int, events: list):
    """Read the stream up to its first tokens; -> (position after them, the rest of the stream)."""
    rest = iter(gen)
    delta = next(rest)
    while not delta.token_ids:
        delta = next(rest)
    assert delta.start_position == prompt_len
    events.append((time.perf_counter(), delta))
    return prompt_len + len(delta.token_ids), rest


def check_session(client: RsdClient, gen_session: str, prompt_len: int, expected_ids: list[int]):
    session = client.get_session(gen_session, include_token_ids=True)
    assert list(session.committed_token_ids)[prompt_len:] == expected_ids  # nothing lost, nothing twice
    assert session.committed_length_tokens == prompt_len + len(expected_ids)
    return session


def _after(events: list, t_kill: float) -> float:
    return next(t for t, delta in events if t > t_kill and delta.token_ids) - t_kill


def _kill_mid_generation(cluster, role: str, params: dict, expected) -> list:
    """Generate with `params`, kill -9 the session's `role` after its first tokens: the session finishes on the
    other one (a verifier re-prefilled from the committed tokens), every token the uninterrupted run's."""
    cluster.ensure(**{"verifier": 1, "drafter": 1, "gateway": 1, role: 2})
    prompt_len = expected.started.start_position
    with RsdClient(cluster.alive("gateway")[0].address, timeout_s=120) as client:
        gen = client.generate(PROMPT, **params)
        events: list = []
        position, rest = first_delta(gen, prompt_len, events)
        victim = getattr(client.get_session(gen.session_id), f"{role}_id")
        t_kill = time.perf_counter()
        cluster.kill(victim)
        for delta in rest:
            assert delta.start_position == position, "a gap or a repeat in the stream"
            position += len(delta.token_ids)
            events.append((time.perf_counter(), delta))
        assert gen.token_ids == expected.token_ids and gen.text == expected.text
        session = check_session(client, gen.session_id, prompt_len, list(expected.token_ids))
    assert getattr(session, f"{role}_id") != victim and session.kv_location.epoch >= 2  # it failed over
    return [(t - t_kill, delta) for t, delta in events]


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_kill_9_of_a_service_mid_generation(cluster, expected, role):
    """The session finishes on the other verifier (re-prefilled from the committed tokens) or drafter."""
    events = _kill_mid_generation(cluster, role, LONG, expected)
    RECOVERY[f"kill -9 {role}"] = _after(events, 0.0)
    print(f"\n[faults] kill -9 {role}: next token after {RECOVERY[f'kill -9 {role}']:.2f} s")


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_kill_9_at_t1_under_load_keeps_the_seeded_tokens(cluster, role):
    """T = 1, seeded: the run killed mid-stream on a machine whose every core is busy equals the undisturbed run
    on an idle one, token for token. The resumed run re-prefills the committed tokens in one forward and
    drafts its next trees from there; the step draws are keyed by position and each row's bits are its own
    (rsd_runtime.models.batch_variance), so it draws what the undisturbed run drew."""
    with RsdClient(cluster.alive("gateway")[0].address, timeout_s=120) as client:
        undisturbed = client.generate(PROMPT, **SAMPLED).wait()
    assert len(undisturbed.token_ids) > 20
    with busy_cores(max_s=120):
        _kill_mid_generation(cluster, role, SAMPLED, undisturbed)


def test_kill_9_of_the_gateway_and_resume_elsewhere(cluster, expected):
    """The client resumes on another gateway with (session id, position); that gateway sees the dead one's
    lease run out and takes the turn over with a new epoch."""
    cluster.ensure(verifier=1, drafter=1, gateway=2)
    first, second = cluster.alive("gateway")[:2]
    prompt_len = expected.started.start_position
    events: list = []
    with RsdClient(first.address, timeout_s=120) as client:
        gen = client.generate(PROMPT, **LONG)
        position, rest = first_delta(gen, prompt_len, events)
        t_kill = time.perf_counter()
        cluster.kill(first.name)
        with pytest.raises(grpc.RpcError) as lost:
            for delta in rest:  # what the gateway sent before dying still counts
                assert delta.start_position == position
                position += len(delta.token_ids)
                events.append((time.perf_counter(), delta))
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    received = list(gen.token_ids)
    with RsdClient(second.address, timeout_s=120) as client:
        resumed = client.generate(session_id=gen.session_id, resume_from_position=position)
        follow(resumed, position, events)
        assert received + resumed.token_ids == list(expected.token_ids)
        session = check_session(client, gen.session_id, prompt_len, list(expected.token_ids))
    assert session.status == gateway_pb2.SESSION_STATUS_FINISHED
    assert session.kv_location.epoch >= 2  # the other gateway began a new epoch
    RECOVERY["kill -9 gateway (resume on another)"] = _after(events, t_kill)
    print(f"\n[faults] kill -9 gateway: next token after {RECOVERY['kill -9 gateway (resume on another)']:.2f} s")


def test_kill_9_of_the_gateway_and_no_client_comes_back(cluster, expected):
    """Nobody resumes the orphaned turn: the other gateway's orphan sweep sees its lease run out on Redis's
    clock, takes it over with a new epoch and finishes it; the store then holds the uninterrupted run and
    why it ended, which a later resume reports."""
    cluster.ensure(verifier=1, drafter=1, gateway=2)
    first, second = cluster.alive("gateway")[:2]
    prompt_len = expected.started.start_position
    with RsdClient(first.address, timeout_s=120) as client:
        gen = client.generate(PROMPT, **LONG)
        first_delta(gen, prompt_len, [])
        cluster.kill(first.name)
    store = RedisSessionStore.from_url(cluster.redis.url)
    try:
        deadline = time.monotonic() + 300
        while (record := store.get_session(gen.session_id)).status == "running":
            assert time.monotonic() < deadline, "the orphaned turn was never taken over and finished"
            time.sleep(0.2)
    finally:
        store.client.close()
    assert record.status == "finished" and record.epoch >= 2  # the sweep began a new epoch
    assert list(record.committed_ids)[prompt_len:] == list(expected.token_ids)
    assert record.finish_reason == finish_reason_name(expected.finished.reason)
    with RsdClient(second.address, timeout_s=120) as client:
        resumed = client.generate(session_id=gen.session_id, resume_from_position=prompt_len).wait()
    assert resumed.token_ids == list(expected.token_ids) and resumed.finished.reason == expected.finished.reason


def test_redis_killed_and_restarted_mid_generation(cluster, expected):
    """Redis dies (kill -9) and comes back on the same port with its append-only file: the gateway retries
    its store calls meanwhile, the generation goes on, and no committed token is lost."""
    cluster.ensure(verifier=1, drafter=1, gateway=1)
    prompt_len = expected.started.start_position
    events: list = []
    with RsdClient(cluster.alive("gateway")[0].address, timeout_s=120) as client:
        gen = client.generate(PROMPT, **LONG)
        position, rest = first_delta(gen, prompt_len, events)
        t_kill = time.perf_counter()
        cluster.redis.kill()
        time.sleep(1.0)  # down for a while: steps pile up at the gateway
        cluster.redis.start()
        for delta in rest:
            assert delta.start_position == position
            position += len(delta.token_ids)
            events.append((time.perf_counter(), delta))
        assert gen.token_ids == expected.token_ids
        check_session(client, gen.session_id, prompt_len, list(expected.token_ids))
    RECOVERY["Redis kill -9 + restart after 1 s"] = _after(events, t_kill)
    print(f"\n[faults] Redis restart: next token after {RECOVERY['Redis kill -9 + restart after 1 s']:.2f} s")


def test_redis_down_for_good_is_unavailable(cluster):
    """A new request while Redis is away past the retry window gets UNAVAILABLE with the reason."""
    cluster.ensure(verifier=1, drafter=1, gateway=1)
    cluster.redis.kill()
    try:
        address = cluster.alive("gateway")[0].address
        with RsdClient(address, timeout_s=60) as client, pytest.raises(grpc.RpcError) as error:
            client.get_session("nobody")
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "store unavailable" in error.value.details()
    finally:
        cluster.redis.start()


def test_slow_and_dropped_verify_steps_are_retried_without_a_second_commit(tmp_path):
    """In-process drafter and verifier. One step's forward takes longer than the drafter's deadline; another
    step's verdict is committed but its stream is dropped before the answer. The drafter resends each tree
    on a fresh stream; the verifier answers the repeat with its stored verdict. Sampling at T=0.8 with a
    seed, so a second verification (a second RNG draw) would change the tokens; the cache holds exactly
    the committed tokens but the last."""
    from drafter_service import server as drafter_server
    from drafter_service.config import DrafterConfig
    from rsd.methods import Method
    from rsd.sampling import SamplingParams
    from rsd_runtime.generator import SpeculativeGenerator
    from rsd_runtime.models import load_model
    from rsd_runtime.runner import ModelRunner
    from rsd_wire import GRPC_OPTIONS, common_pb2, drafter_pb2, drafter_pb2_grpc
    from verifier_service import server as verifier_server
    from verifier_service.config import VerifierConfig
    from verifier_service.servicer import RpcError

    draft_dir, target_dir = build_tiny_pair(tmp_path, "qwen2")
    draft, target = load_model(draft_dir), load_model(target_dir)
    prompt, new_tokens, seed = [2, 10, 11, 12], 40, 7
    method, sampling = Method.parse("rsd_c", "2,2"), SamplingParams(0.8)
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256), draft_top_k=256)
    expected = gen.generate(prompt, method, sampling, max_new_tokens=new_tokens, seed=seed).token_ids

    async def main():
        vserver, _, v = await verifier_server.create_server(VerifierConfig(max_len=256, verifier_id="v"), target)
        dserver, _, d = await drafter_server.create_server(DrafterConfig(max_len=256, verify_timeout_s=0.5), draft)
        forwards, answers = [0], [0]
        verify_batch, verify_one = v.engine.verify_batch, v.servicer._verify

        def slow_batch(requests):  # the 3rd forward outlasts the deadline
            forwards[0] += 1
            if forwards[0] == 3:
                time.sleep(1.5)
            return verify_batch(requests)

        async def dropping(msg):  # the 6th verdict is committed, then its stream breaks
            reply = await verify_one(msg)
            answers[0] += 1
            if answers[0] == 6:
                raise RpcError(grpc.StatusCode.UNAVAILABLE, "stream dropped (test)")
            return reply

        v.engine.verify_batch, v.servicer._verify = slow_batch, dropping
        params = common_pb2.GenerationParams(
            sampling=common_pb2.SamplingParams(temperature=0.8), method=common_pb2.Method(name="rsd_c", shape="2,2")
        )
        params.seed = seed
        request = drafter_pb2.RunRequest(
            session_id="slow", epoch=1, committed_token_ids=prompt, params=params, max_new_tokens=new_tokens,
            verifier_address=v.address, verifier_id="v",
        )  # fmt: skip
        tokens = []
        try:
            async with grpc.aio.insecure_channel(d.address, options=GRPC_OPTIONS) as channel:
                async for event in drafter_pb2_grpc.DrafterStub(channel).Run(request):
                    assert event.start_position == len(prompt) + len(tokens)
                    tokens += event.token_ids
            committed = v.servicer.sessions["slow"].committed
            return tokens, committed, v.engine.cached_length("slow"), forwards[0], answers[0]
        finally:
            await d.close(dserver, 0)
            await v.close(vserver, 0)

    tokens, committed, cached, num_forwards, num_answers = asyncio.run(main())
    assert num_forwards >= 3 and num_answers >= 7  # both faults happened
    assert tokens == expected
    # Every step once in the verifier's sequence (its last verdict may run past the drafter's budget) ...
    assert committed[: len(prompt) + new_tokens] == prompt + expected
    assert cached == len(committed) - 1  # ... and in its KV cache

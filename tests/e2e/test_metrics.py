"""Prometheus metrics of every service, scraped over HTTP after a real generation, and JSON logs.

The verifier, drafter and gateway run in-process on loopback (tiny models), each with its own
registry and exporter on a free port; the scrape is parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from drafter_service.config import DrafterConfig
from drafter_service.server import create_server as create_drafter
from gateway.config import GatewayConfig
from gateway.server import create_server as create_gateway
from gateway.store.memory_store import MemorySessionStore
from rsd_runtime.models import load_model
from rsd_runtime.tokenizer import load_tokenizer
from rsd_service.client import RsdClient
from rsd_service.logs import ContextFilter, JsonFormatter, log_context
from rsd_service.security import ClientSecurity
from rsd_tools.tiny import build_tiny_pair
from tests.fixtures.stack import LoopThread
from tests.gateway.test_engine import PROMPT, greedy, status_of
from verifier_service.config import VerifierConfig
from verifier_service.server import create_server as create_verifier


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics page."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    draft_dir, target_dir = build_tiny_pair(tmp_path_factory.mktemp("tiny"), "qwen2")
    draft_model, target_model, tokenizer = load_model(draft_dir), load_model(target_dir), load_tokenizer(target_dir)
    loop = LoopThread()
    ports = {name: free_port() for name in ("verifier", "drafter", "gateway")}

    async def start():
        verifier = await create_verifier(VerifierConfig(verifier_id="v0", metrics_port=ports["verifier"]), target_model)
        drafter = await create_drafter(DrafterConfig(drafter_id="d0", metrics_port=ports["drafter"]), draft_model)
        cfg = GatewayConfig(
            port=0,
            drafters=f"d0={drafter[2].address}",
            verifiers=f"v0={verifier[2].address}",
            metrics_port=ports["gateway"],
            auth_token="t0ken",
        )
        gateway = await create_gateway(cfg, store=MemorySessionStore(), tokenizer=tokenizer)
        return [verifier, drafter, gateway]

    servers = loop.run(start(), timeout_s=120)
    yield f"127.0.0.1:{servers[2][1]}", ports, servers

    async def stop():
        for server, _, handle in reversed(servers):
            await handle.close(server, 0)

    loop.run(stop())
    loop.close()


def settled(check, timeout_s: float = 30.0) -> None:
    """Run `check` until it passes (the last failure is raised after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_every_service_exports_its_metrics(cluster):
    address, ports, servers = cluster
    assert [handle.metrics.port for _, _, handle in servers] == [ports["verifier"], ports["drafter"], ports["gateway"]]
    with RsdClient(address, timeout_s=60, security=ClientSecurity(token="t0ken")) as client:
        gen = client.generate(PROMPT, method="rsd_s", shape="2x3", max_new_tokens=16, **greedy()).wait()
    with RsdClient(address, timeout_s=60) as client:  # no token: counted as UNAUTHENTICATED
        assert status_of(lambda: client.get_session("abc")).code() == grpc.StatusCode.UNAUTHENTICATED
    assert gen.finished.num_new_tokens == 16
    steps = len(gen.steps)

    def check() -> None:
        g = scrape(ports["gateway"])
        assert total(g, "rsd_gateway_requests_total", method="Generate", code="OK") == 1
        assert total(g, "rsd_gateway_requests_total", method="GetSession", code="UNAUTHENTICATED") == 1
        assert total(g, "rsd_gateway_generated_tokens_total", method="rsd_s") == 16
        assert total(g, "rsd_gateway_time_to_first_token_seconds_count", method="rsd_s") == 1
        assert total(g, "rsd_gateway_token_latency_seconds_count", method="rsd_s") == len(gen.steps) - 1
        assert total(g, "rsd_gateway_tokens_per_step_count", method="rsd_s") == steps
        assert total(g, "rsd_gateway_tokens_per_step_sum", method="rsd_s") == 16
        spec = {"method": "rsd_s", "verification": "token", "rule": "greedy"}  # T = 0
        assert total(g, "rsd_gateway_spec_decode_num_drafts_total", **spec) == steps
        drafted = total(g, "rsd_gateway_spec_decode_num_draft_tokens_total", **spec)
        assert drafted == sum(s.num_draft_tokens for s in gen.steps) > 0
        accepted = sum(s.num_accepted_tokens for s in gen.steps)
        assert total(g, "rsd_gateway_spec_decode_num_accepted_tokens_total", **spec) == accepted
        assert total(g, "rsd_gateway_spec_decode_num_accepted_tokens_per_pos_total", **spec) == accepted
        assert total(g, "rsd_gateway_spec_decode_num_emitted_tokens_total", **spec) == 16
        assert total(g, "rsd_gateway_running_turns") == 0 and total(g, "rsd_gateway_open_streams") == 0

        v = scrape(ports["verifier"])
        assert total(v, "rsd_verifier_requests_total", method="Attach", code="OK") == 1
        assert total(v, "rsd_verifier_requests_total", method="Verify") == 1
        assert total(v, "rsd_verifier_forward_seconds_count") == steps  # one session: one forward per step
        assert total(v, "rsd_verifier_batch_trees_sum") == steps and total(v, "rsd_verifier_tree_nodes_count") == steps
        assert total(v, "rsd_verifier_batch_nodes_sum") >= steps * 7  # a 2x3 tree has 7 nodes
        assert total(v, "rsd_verifier_sessions") == 1 and total(v, "rsd_verifier_queue_depth") == 0

        d = scrape(ports["drafter"])
        assert total(d, "rsd_drafter_requests_total", method="Run", code="OK") == 1
        assert total(d, "rsd_drafter_draft_seconds_count") == steps and total(d, "rsd_drafter_draft_seconds_sum") > 0
        assert total(d, "rsd_drafter_running") == 0
        # batched drafting (on by default): one session alone, so every packed forward served one forward
        assert total(d, "rsd_drafter_packed_forwards") == total(d, "rsd_drafter_packed_session_forwards") > 0
        # pre-drafting (on by default; how much it does depends on timing): the gateway's step stats and
        # the drafter's counters agree
        assert total(d, "rsd_drafter_predraft_hits_total") == sum(s.predraft_hit for s in gen.steps)
        misses = sum(s.num_predrafted_trees > 0 and not s.predraft_hit for s in gen.steps)
        assert total(d, "rsd_drafter_predraft_misses_total") == misses
        assert total(d, "rsd_drafter_wasted_draft_forwards_total") == sum(s.wasted_draft_forwards for s in gen.steps)

    settled(check)  # a call's counters are recorded as it closes, which may be just after the client saw its end


def test_two_servers_in_one_process_keep_their_own_counts(cluster):
    _, ports, _ = cluster
    assert total(scrape(ports["drafter"]), "rsd_gateway_requests_total") == 0  # no gateway metric leaks


def test_json_logs_carry_the_call_ids():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("rsd.test.json")
    logger.addHandler(handler)
    logger.propagate = False
    token = log_context.set((("method", "Generate"), ("session_id", "s1"), ("request_id", "r1")))
    try:
        logger.warning("turn of %s failed", "s1", extra={"position": 7})
    finally:
        log_context.reset(token)
        logger.removeHandler(handler)
    record = json.loads(out.getvalue())
    assert record["message"] == "turn of s1 failed" and record["level"] == "WARNING"
    assert (record["session_id"], record["request_id"], record["method"], record["position"]) == (
        "s1",
        "r1",
        "Generate",
        7,
    )
    assert record["logger"] == "rsd.test.json" and "time" in record

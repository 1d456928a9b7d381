"""The delay relay (rsd_bench.netem): bytes arrive intact and in order both ways, whatever the jitter; a
chunk never leaves before its delay nor before the chunk ahead of it. No clock is asserted on."""

from __future__ import annotations

import random
import socket
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rsd_bench.netem import DelayRelay, departure


def test_departures_keep_order_and_delay():
    rng = random.Random(0)
    arrivals = sorted(rng.uniform(0, 1) for _ in range(200))
    previous, out = 0.0, []
    for a in arrivals:
        delay = 0.01 * (1 + rng.uniform(-0.5, 0.5))
        previous = departure(a, delay, previous)
        out.append(previous)
        assert previous >= a + delay
    assert out == sorted(out)


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_bytes_arrive_intact_and_in_order_both_ways():
    server, thread = _echo_server()
    payload = bytes(random.Random(1).randrange(256) for _ in range(300_000))
    with DelayRelay(f"127.0.0.1:{server.getsockname()[1]}", delay_ms=2, jitter=0.9, seed=3) as relay:
        host, _, port = relay.address.rpartition(":")
        with socket.create_connection((host, int(port))) as conn:
            rng, sent = random.Random(2), 0
            while sent < len(payload):  # many small writes: many chunks, each with its own jittered delay
                n = rng.randrange(1, 5000)
                conn.sendall(payload[sent : sent + n])
                sent += n
            conn.shutdown(socket.SHUT_WR)  # the end of the stream crosses the relay too
            received = bytearray()
            while data := conn.recv(65536):
                received += data
        stats = relay.describe()
    thread.join(5)
    server.close()
    assert bytes(received) == payload
    assert stats["up"]["bytes"] == stats["down"]["bytes"] == len(payload)
    assert stats["up"]["chunks"] > 1 and stats["connections"] == 1


def test_grpc_through_the_relay(grpc_health_server):
    with DelayRelay(grpc_health_server, delay_ms=1) as relay, grpc.insecure_channel(relay.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def grpc_health_server():
    from concurrent import futures

    from grpc_health.v1 import health

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_refuses_a_jitter_that_could_go_negative():
    with pytest.raises(ValueError, match="jitter"):
        DelayRelay("127.0.0.1:1", 10, jitter=1.0)

"""Bootstrap of the verifier service: load the target, start the batcher and the gRPC server,
register in Redis with a heartbeat, drain on SIGTERM.

    python -m verifier_service --model /path/to/target --port 7001 --num-slots 8 --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health

from rsd_runtime.attention import UnsupportedModelError
from rsd_runtime.compute import service_compute, single_threaded
from rsd_runtime.constraint import folder_automata
from rsd_runtime.models import load_model
from rsd_service.metrics import VerifierMetrics
from rsd_service.placement import Placement, PlacementError, apply_placement
from rsd_service.registry import ServiceInfo
from rsd_service.serving import (
    Heartbeat,
    RegisteredHandle,
    default_service_id,
    run_service,
    serve_until_signal,
    start_service,
)
from rsd_wire import verifier_pb2_grpc
from verifier_service.batcher import Batcher
from verifier_service.config import VerifierConfig
from verifier_service.engine import VerifierPool
from verifier_service.servicer import VerifierServicer

log = logging.getLogger(__name__)
SERVICE_NAME = "rsd.v1.Verifier"


@dataclass
class VerifierHandle(RegisteredHandle):
    """What create_server started, for serve_until_signal, tests and the launcher."""

    config: VerifierConfig
    verifier_id: str
    address: str
    engine: VerifierPool
    batcher: Batcher
    servicer: VerifierServicer
    health: health.aio.HealthServicer
    metrics: VerifierMetrics
    heartbeat: Heartbeat | None = None
    placement: Placement | None = None  # the cores and threads applied at start

    def service_info(self) -> ServiceInfo:
        capacity, load = self.config.num_slots, self.servicer.num_sessions
        return ServiceInfo("verifier", self.verifier_id, self.address, capacity, load, self.config.max_len)

    def load(self) -> tuple[int, int, int]:
        """(sessions with an open Verify stream, sessions holding a KV slot, slots)."""
        return self.servicer.num_open_streams, self.servicer.num_sessions, self.config.num_slots

    async def drain_streams(self, timeout_s: float, settle_s: float = 0.5) -> int:
        """Leave the registry, then wait until no Verify stream has been open for settle_s (or timeout_s).
        Returns the sessions still streaming (0 = a clean drain); the server keeps running.

        Sessions that merely hold a slot (finished turns kept for a continuation) are not waited for: no
        gateway finds this verifier any more, so their next turn re-prefills elsewhere."""
        await self.drain()
        loop = asyncio.get_running_loop()
        deadline, idle_since = loop.time() + timeout_s, None
        while loop.time() < deadline:
            if self.servicer.num_open_streams:
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            elif loop.time() - idle_since >= settle_s:  # a turn attached just before we left may still open one
                break
            await asyncio.sleep(0.05)
        return self.servicer.num_open_streams

    async def stop_parts(self) -> None:
        await self.batcher.stop()
        if self.batcher.compute is not None:
            self.batcher.compute.close()


async def create_server(
    config: VerifierConfig, model: torch.nn.Module | None = None
) -> tuple[grpc.aio.Server, int, VerifierHandle]:
    """Start the verifier on config.host:config.port (0 picks a port). A `model` already loaded
    replaces config.model (tests share one model between servers). Placement (cores, threads)
    applies first, before the model loads."""
    if model is None and not config.model:
        raise ValueError("--model is required: a local folder holding the target model")
    placement = apply_placement(config.cores, config.threads)
    compute = service_compute(placement.cores, placement.threads, "verifier-compute")  # loads and runs the target
    try:
        if model is None:
            model = await compute.call(
                load_model,
                config.model,
                config.device,
                config.dtype,
                config.attn_implementation,
                numeric=config.numeric,
            )
        engine = await compute.call(VerifierPool, model, config.num_slots, config.max_len)  # its probe forward too
    except BaseException:
        compute.close()
        raise
    batcher = Batcher(engine, config.max_batch_nodes, config.batch_wait_ms, config.batching, compute)
    automata = folder_automata(config.tokenizer or config.model)  # structured output, loaded at first use
    servicer = VerifierServicer(
        engine,
        batcher,
        config.verifier_id,
        config.max_tree_nodes,
        config.attach_grace_s,
        config.attach_wait_s,
        automata,
    )
    metrics = VerifierMetrics(servicer, batcher)
    server, port, health_servicer = await start_service(
        config, (verifier_pb2_grpc.add_VerifierServicer_to_server, servicer), SERVICE_NAME, metrics
    )
    servicer.verifier_id = config.verifier_id or default_service_id("verifier", config.host, port)
    address = config.advertise_address or f"{config.host}:{port}"
    batcher.start()
    handle = VerifierHandle(config, servicer.verifier_id, address, engine, batcher, servicer, health_servicer, metrics)
    handle.placement = placement
    await handle.register(server, config)
    log.info(
        "verifier %s on %s: numeric %s, %d slots, max_len %d, cores %s, %d threads",
        handle.verifier_id,
        address,
        getattr(model, "rsd_numeric", "exact"),
        config.num_slots,
        config.max_len,
        placement.cores,
        placement.threads,
    )
    return server, port, handle


async def serve(config: VerifierConfig) -> None:
    server, _, handle = await create_server(config)
    single_threaded()  # the target runs on its compute thread; nothing else here makes an OpenMP team
    try:
        await serve_until_signal(server, handle.health, grace_s=config.drain_s, on_drain=handle.drain)
    finally:
        await handle.close(server, 0)


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Refuse to start, with the reason, rather than serve a wrong law or run on cores it may not use.
    run_service(VerifierConfig, "verifier", serve, argv, refusals=(UnsupportedModelError, PlacementError))

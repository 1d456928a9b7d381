"""Bootstrap of the drafter service: load the draft model, start the gRPC server, register in
Redis with a heartbeat, drain on SIGTERM (running sessions get drain_s to finish).

    python -m drafter_service --model /path/to/draft --port 7002 --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health

from drafter_service.config import DrafterConfig
from drafter_service.engine import DrafterPool
from drafter_service.servicer import DrafterServicer
from rsd_runtime.attention import UnsupportedModelError
from rsd_runtime.compute import service_compute, single_threaded
from rsd_runtime.models import load_model, prepare_draft
from rsd_service.metrics import DrafterMetrics
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
from rsd_wire import drafter_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "rsd.v1.Drafter"


@dataclass
class DrafterHandle(RegisteredHandle):
    """What create_server started, for serve_until_signal, tests and the launcher."""

    config: DrafterConfig
    drafter_id: str
    address: str
    engine: DrafterPool
    servicer: DrafterServicer
    health: health.aio.HealthServicer
    metrics: DrafterMetrics
    heartbeat: Heartbeat | None = None
    placement: Placement | None = None  # the cores and threads applied at start
    quantize: str = "none"  # what quantize_draft applied to the loaded model ("none" for a given model)

    def service_info(self) -> ServiceInfo:
        capacity, load = self.config.max_sessions, self.engine.num_running
        return ServiceInfo("drafter", self.drafter_id, self.address, capacity, load, self.config.max_len)

    async def stop_parts(self) -> None:
        if self.engine.compute is not None:
            self.engine.compute.close()


async def create_server(
    config: DrafterConfig, model: torch.nn.Module | None = None
) -> tuple[grpc.aio.Server, int, DrafterHandle]:
    """Start the drafter on config.host:config.port (0 picks a port). A `model` already loaded
    replaces config.model (tests share one model between servers) and is used as given: draft_vocab
    and quantize apply to a model this function loads. Placement (cores, threads) applies first."""
    if model is None and not config.model:
        raise ValueError("--model is required: a local folder holding the draft model")
    placement = apply_placement(config.cores, config.threads)
    compute = service_compute(placement.cores, placement.threads, "drafter-compute")  # loads and runs the draft model
    quantize = "none"
    try:
        if model is None:
            model, quantize = await compute.call(load_draft, config)
        engine = await compute.call(DrafterPool, model, config, compute)  # its probe forward too
    except BaseException:
        compute.close()
        raise
    servicer = DrafterServicer(engine)
    metrics = DrafterMetrics(engine)
    server, port, health_servicer = await start_service(
        config, (drafter_pb2_grpc.add_DrafterServicer_to_server, servicer), SERVICE_NAME, metrics
    )
    drafter_id = config.drafter_id or default_service_id("drafter", config.host, port)
    address = config.advertise_address or f"{config.host}:{port}"
    handle = DrafterHandle(config, drafter_id, address, engine, servicer, health_servicer, metrics)
    handle.placement, handle.quantize = placement, quantize
    await handle.register(server, config)
    log.info(
        "drafter %s on %s: %d sessions, max_len %d, quantize %s, cores %s, %d threads",
        drafter_id,
        address,
        config.max_sessions,
        config.max_len,
        quantize,
        placement.cores,
        placement.threads,
    )
    return server, port, handle


def load_draft(config: DrafterConfig) -> tuple[torch.nn.Module, str]:
    """The draft model as the config says: loaded, vocabulary pruned, then quantised (in that order:
    rsd_runtime.models.quantize_draft). Returns (model, the quantisation applied)."""
    model = load_model(config.model, config.device, config.dtype, config.attn_implementation, numeric=config.numeric)
    return model, prepare_draft(model, config.draft_vocab, config.quantize, config.dtype)


async def serve(config: DrafterConfig) -> None:
    server, _, handle = await create_server(config)
    single_threaded()  # the draft model runs on its compute thread; sampling here makes no OpenMP team
    try:
        await serve_until_signal(server, handle.health, grace_s=config.drain_s, on_drain=handle.drain)
    finally:
        await handle.close(server, 0)


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Refuse to start, with the reason, rather than serve a wrong law or run on cores it may not use.
    run_service(DrafterConfig, "drafter", serve, argv, refusals=(UnsupportedModelError, PlacementError))

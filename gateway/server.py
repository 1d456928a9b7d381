"""Bootstrap of the gateway: config -> store, tokenizer, engine -> a grpc.aio server.

    server, port, handle = await create_server(config)   # port 0 picks one (tests)
    handle.http.base_url                                  # the OpenAI-compatible HTTP API (http_port >= 0)
    python -m gateway --tokenizer DIR --redis-url redis://127.0.0.1:6379/0 \\
        --drafters d0=127.0.0.1:7002 --verifiers v0=127.0.0.1:7001 --cores 0   # pinned to core 0 (main)
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.config import GatewayConfig
from gateway.engine import GatewayEngine
from gateway.openai.api import HttpApiServer, start_http_api
from gateway.servicer import GatewayServicer
from gateway.store.memory_store import MemorySessionStore
from gateway.store.redis_store import RedisSessionStore
from gateway.store.session import SessionStore
from rsd_service.metrics import GatewayMetrics
from rsd_service.placement import Placement, apply_placement
from rsd_service.serving import load_config, serve_until_signal, setup_logging, start_service
from rsd_wire import gateway_pb2_grpc

log = logging.getLogger("rsd.gateway")


@dataclass
class GatewayHandle:
    engine: GatewayEngine
    servicer: GatewayServicer
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    metrics: GatewayMetrics
    http: HttpApiServer | None = None  # the OpenAI-compatible HTTP API, when config.http_port >= 0

    async def drain(self, grace_s: float) -> None:
        """Let running turns finish for grace_s (then cancel them), stop the HTTP API (/health: 503 from now)."""
        if self.http is not None:
            self.http.api.draining = True
        await self.engine.drain(grace_s)
        if self.http is not None:
            await self.http.stop(grace_s)

    async def close(self, server: grpc.aio.Server, grace_s: float = 1.0) -> None:
        """Report NOT_SERVING, let running turns finish for grace_s, stop the servers and the engine."""
        await self.health.enter_graceful_shutdown()
        await self.drain(grace_s)
        await server.stop(grace_s)
        await self.engine.close()
        self.metrics.close()


def make_store(config: GatewayConfig) -> SessionStore:
    if config.redis_url:
        return RedisSessionStore.from_url(config.redis_url, config.redis_namespace, config.session_ttl_s)
    return MemorySessionStore(config.session_ttl_s)


def load_gateway_tokenizer(config: GatewayConfig) -> Any:
    if not config.tokenizer:
        raise ValueError("tokenizer: give the model folder whose tokenizer the gateway uses (--tokenizer DIR)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rsd_runtime.tokenizer import load_tokenizer

    return load_tokenizer(config.tokenizer)


async def create_server(
    config: GatewayConfig, store: SessionStore | None = None, tokenizer: Any = None
) -> tuple[grpc.aio.Server, int, GatewayHandle]:
    """Start the gateway (store and tokenizer from the config unless given); returns (server, port, handle)."""
    store = store if store is not None else make_store(config)
    tokenizer = tokenizer if tokenizer is not None else load_gateway_tokenizer(config)
    engine = GatewayEngine(config, store, tokenizer)
    engine.start()
    servicer = GatewayServicer(engine)
    metrics = GatewayMetrics(engine)
    server, port, health = await start_service(
        config, (gateway_pb2_grpc.add_GatewayServicer_to_server, servicer), "rsd.v1.Gateway", metrics, "auth_token"
    )
    handle = GatewayHandle(engine, servicer, health, metrics)
    if config.http_port >= 0:
        try:
            handle.http = await start_http_api(config, engine, metrics)
        except BaseException:
            await server.stop(0)
            metrics.close()
            raise
    return server, port, handle


async def serve(config: GatewayConfig, placement: Placement) -> None:
    server, port, handle = await create_server(config)
    store = "redis " + config.redis_url if config.redis_url else "embedded store"
    log.info("gateway %s serving on %s:%d (%s), cores %s", config.gateway_id, config.host, port, store, placement.cores)
    print(f"gateway listening on {config.host}:{port}", flush=True)
    if handle.http is not None:
        log.info("OpenAI-compatible HTTP API at %s (model %s)", handle.http.base_url, handle.http.api.model_name)
        print(f"gateway HTTP API at {handle.http.base_url}", flush=True)
    await serve_until_signal(
        server, handle.health, grace_s=config.drain_s, on_drain=lambda: handle.drain(config.drain_s)
    )
    await handle.engine.close()
    handle.metrics.close()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(GatewayConfig, "gateway", sys.argv[1:] if argv is None else argv)
        if not config.tokenizer:
            raise ValueError("--tokenizer DIR is required: the model folder whose tokenizer the gateway uses")
        # Pin before the server, the store and the tokenizer start their threads (any already running
        # move too). torch, imported by now through rsd.methods, runs nothing here; its pool gets the cores.
        placement = apply_placement(config.cores)
    except ValueError as e:  # a PlacementError too: cores this process may not use, named with the allowed ones
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_format)
    asyncio.run(serve(config, placement))
    return 0

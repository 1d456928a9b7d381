"""What every rsd gRPC service shares: its config (a frozen dataclass whose defaults are overridden
by RSD_<SERVICE>_<FIELD> environment variables, then by --field flags), a grpc.aio server with
explicit message limits, health and reflection, TLS and interceptors (rsd_service.security,
rsd_service.metrics), text or JSON logs with the call's ids, and a graceful drain on SIGTERM / SIGINT.

    config = load_config(VerifierConfig, "verifier", argv)          # RSD_VERIFIER_PORT=7001 or --port 7001
    setup_logging(config.log_format)
    metrics = VerifierMetrics(servicer, batcher)                    # rsd_service.metrics
    server, port, health = await start_service(config, (add_VerifierServicer_to_server, servicer),
                                               "rsd.v1.Verifier", metrics)  # start_server as the config says
    await serve_until_signal(server, health, grace_s=config.drain_s, on_drain=servicer.drain)

The fields every service config shares (host, port, TLS, limits, metrics_port, ...) are in
rsd_service.config.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rsd_service.config import load_config
from rsd_service.logs import LOG_FORMATS, log_context, setup_logging  # noqa: F401  (re-exported)
from rsd_service.registry import RedisServiceRegistry
from rsd_service.security import ClientSecurity, ServerSecurity, channel, server_security
from rsd_wire import GRPC_OPTIONS, grpc_options

if TYPE_CHECKING:  # rsd_service.metrics imports this module
    from rsd_service.config import ServiceConfig
    from rsd_service.metrics import ServiceMetrics

T = TypeVar("T")


def run_service(
    cls: type[T],
    service: str,
    serve: Callable[[T], Any],
    argv: Sequence[str] | None = None,
    refusals: tuple[type[Exception], ...] = (),
) -> None:
    """A service's main: read its config (defaults < env < flags), set up logging, run serve(config).
    A bad flag or env value, or one of `refusals` raised while starting (a model it cannot serve
    exactly, cores it may not use), ends the process with the reason and no traceback."""
    try:
        config = load_config(cls, service, argv)
    except ValueError as e:
        raise SystemExit(f"{service}: {e}") from None
    setup_logging(config.log_format)
    try:
        asyncio.run(serve(config))
    except refusals as e:
        logging.getLogger(service).error("%s cannot start: %s", service, e)
        raise SystemExit(f"{service}: cannot start: {e}") from None


async def start_server(
    servicers: Sequence[tuple[Callable[[Any, grpc.aio.Server], None], Any]],
    service_names: Sequence[str],
    host: str,
    port: int,
    *,
    security: ServerSecurity | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_message_bytes: int = 0,
    max_concurrent_rpcs: int = 0,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start a grpc.aio server with the servicers, health (SERVING) and reflection; port 0 picks one.

    security: TLS / mTLS and the bearer token (rsd_service.security); `interceptors` run before the
    token check (so metrics count refused calls). max_message_bytes: 0 = rsd_wire's default.
    max_concurrent_rpcs: more calls at once are answered RESOURCE_EXHAUSTED by gRPC (0 = no limit)."""
    security = security or ServerSecurity()
    server = grpc.aio.server(
        options=grpc_options(max_message_bytes) if max_message_bytes else GRPC_OPTIONS,
        interceptors=[*interceptors, *security.interceptors()],
        maximum_concurrent_rpcs=max_concurrent_rpcs or None,
    )
    for add, servicer in servicers:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    credentials = security.credentials()
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


async def start_service(
    config: ServiceConfig,
    servicer: tuple[Callable[[Any, grpc.aio.Server], None], Any],
    service_name: str,
    metrics: ServiceMetrics,
    token_field: str = "internal_token",
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """start_server as a service config says: on config.host:config.port with its TLS and the token its
    callers must carry (the config's `token_field`, e.g. the gateway's "auth_token"), its message and
    concurrency limits, `metrics` counting every call; then the metrics exporter on config.metrics_port
    (0 = off). When the exporter cannot start, the server is stopped and the error raised."""
    server, port, health_servicer = await start_server(
        [servicer],
        [service_name],
        config.host,
        config.port,
        security=server_security(config, token_field),
        interceptors=[metrics.interceptor()],
        max_message_bytes=config.max_message_bytes,
        max_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    try:
        metrics.serve(config.host, config.metrics_port)
    except Exception:
        await server.stop(0)
        raise
    return server, port, health_servicer


async def serve_until_signal(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    grace_s: float = 10.0,
    on_drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run until SIGTERM/SIGINT, then: report NOT_SERVING, let `on_drain` finish work, stop with grace."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    if on_drain is not None:
        await on_drain()
    await server.stop(grace_s)


async def wait_healthy(
    address: str, service: str = "", timeout_s: float = 60.0, security: ClientSecurity | None = None
) -> None:
    """Poll a server's health until SERVING (used by the launcher and tests); `security` for TLS."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with channel(address, security) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} not healthy after {timeout_s} s")
            await asyncio.sleep(0.2)


class Heartbeat:
    """Keeps a service registered in a registry (rsd_service.registry: register_service /
    unregister_service) while it runs: registers now, refreshes every `every_s`, and the entry
    expires `ttl_s` after the last refresh, so a crashed service disappears by itself.

        heartbeat = Heartbeat(store, lambda: ServiceInfo("verifier", id, address, capacity, load), 2.0, 6.0)
        await heartbeat.start()        # raises (the store's client closed) if the registry is unreachable
        ...
        await heartbeat.close()        # stop, unregister, close the store's client
    """

    def __init__(self, store: Any, info: Callable[[], Any], every_s: float, ttl_s: float):
        if not 0 < every_s < ttl_s:
            raise ValueError(f"need 0 < every_s < ttl_s, got {every_s} and {ttl_s}")
        self.store, self.info, self.every_s, self.ttl_s = store, info, every_s, ttl_s
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        try:
            await self._beat()
        except Exception:  # nothing left open: the caller only reports the error
            self.store.client.close()
            raise
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def stop(self, unregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if unregister:
            info = self.info()
            try:
                await asyncio.to_thread(self.store.unregister_service, info.role, info.service_id)
            except Exception as e:  # the entry expires anyway
                logging.getLogger(__name__).warning("unregister %s failed: %s", info.service_id, e)

    async def close(self, unregister: bool = True) -> None:
        """stop(), then close the store's client: the heartbeat owns that connection."""
        await self.stop(unregister)
        self.store.client.close()

    async def _beat(self) -> None:
        await asyncio.to_thread(self.store.register_service, self.info(), self.ttl_s)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self._beat()
            except Exception as e:  # the registry is away for a moment: keep serving, retry next beat
                logging.getLogger(__name__).warning("heartbeat of %s failed: %s", self.info().service_id, e)


class RegisteredHandle:
    """What a model service's handle (DrafterHandle, VerifierHandle) shares: its entry in the registry,
    kept by a heartbeat while it serves, left on drain. The handle provides `service_info()` (its
    current ServiceInfo), `metrics`, and `stop_parts()` for what it started besides the server."""

    heartbeat: Heartbeat | None = None

    def service_info(self) -> Any:
        raise NotImplementedError

    async def stop_parts(self) -> None:
        """Stop what create_server started besides the gRPC server (the verifier's batcher)."""

    async def register(self, server: grpc.aio.Server, config: Any) -> None:
        """Join the registry at config.redis_url (none: a static cluster) and keep the entry alive; a wrong
        URL fails here, at start, with everything started so far stopped again."""
        if not config.redis_url:
            return
        registry = RedisServiceRegistry.from_url(config.redis_url, config.redis_namespace)
        heartbeat = Heartbeat(registry, self.service_info, config.heartbeat_s, config.registration_ttl_s)
        try:
            await heartbeat.start()
        except Exception:
            await self.close(server, 0)
            raise
        self.heartbeat = heartbeat

    async def drain(self) -> None:
        """Leave the registry (new sessions go elsewhere); running ones finish during server.stop."""
        if self.heartbeat is not None:
            await self.heartbeat.close()
            self.heartbeat = None

    async def close(self, server: grpc.aio.Server, grace_s: float | None = None) -> None:
        """Stop everything create_server started."""
        await self.drain()
        await server.stop(grace_s)
        await self.stop_parts()
        self.metrics.close()


def default_service_id(role: str, host: str, port: int) -> str:
    """'<role>-<host>-<port>' in the registry's id alphabet; a wildcard host becomes the hostname."""
    name = host if host not in ("", "0.0.0.0", "::", "[::]") else socket.gethostname()
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{role}-{name}-{port}")[:128]

"""Who runs drafters and verifiers (ServiceDirectory: the static lists of the config, else the registry) and
the channels to them (Channels). The engine talks to a drafter through DrafterClient, the two calls it needs,
which the gRPC DrafterStub satisfies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig, parse_services
from gateway.errors import Overloaded
from gateway.store.session import SessionStore
from rsd_service import security
from rsd_service.registry import ServiceInfo
from rsd_wire import drafter_pb2, drafter_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger("rsd.gateway")


class RunCall(Protocol):
    """A Drafter.Run in progress: its events, and cancel() to close the stream (which stops the run)."""

    def __aiter__(self) -> AsyncIterator[drafter_pb2.RunEvent]: ...

    def cancel(self) -> bool: ...


class DrafterClient(Protocol):
    """Start a run / cancel a run: what the engine needs of a drafter (drafter_pb2_grpc.DrafterStub is one)."""

    def Run(self, request: drafter_pb2.RunRequest) -> RunCall: ...

    def Cancel(
        self, request: drafter_pb2.CancelRunRequest, *, timeout: float | None = None
    ) -> Awaitable[drafter_pb2.CancelRunResponse]: ...


class ServiceDirectory:
    """Live drafters and verifiers: the static lists of the config, else the Redis registry; minus
    the ones that failed lately. Picks the least loaded (registry load plus this gateway's runs)."""

    def __init__(self, store: SessionStore, config: GatewayConfig):
        self.store, self.down_s = store, config.service_down_s
        self.static = {"drafter": parse_services(config.drafters), "verifier": parse_services(config.verifiers)}
        self.assigned: dict[tuple[str, str], int] = {}  # (role, id) -> runs of this gateway on it
        self._down_until: dict[tuple[str, str], float] = {}

    async def live(self, role: str) -> list[ServiceInfo]:
        if self.static["drafter"] or self.static["verifier"]:
            services = [ServiceInfo(role, sid, address) for sid, address in self.static[role].items()]
        else:
            services = await asyncio.to_thread(self.store.list_services, role)
        now = time.monotonic()
        return [s for s in services if self._down_until.get((role, s.service_id), 0.0) <= now]

    def mark_down(self, role: str, service_id: str) -> None:
        log.warning("%s %s marked down for %.0f s", role, service_id, self.down_s)
        self._down_until[(role, service_id)] = time.monotonic() + self.down_s

    async def pick(self, role: str, prefer: str = "", spare_only: bool = False) -> ServiceInfo:
        """The preferred service while it is live (and, spare_only, below its capacity where it says one), else
        the least loaded."""
        services = await self.live(role)
        if not services:
            raise Overloaded(f"no live {role}")

        def load(s: ServiceInfo) -> float:
            return (s.load + self.assigned.get((role, s.service_id), 0)) / max(s.capacity, 1)

        for s in services:
            if s.service_id == prefer and not (spare_only and s.capacity and load(s) >= 1):
                return s
        return min(services, key=lambda s: (load(s), s.service_id))

    async def pick_pair(
        self, prefer_verifier: str = "", prefer_drafter: str = "", spare_only: bool = False
    ) -> tuple[ServiceInfo, ServiceInfo]:
        """-> (drafter, verifier), each the preferred one while it is live (see pick), else the least loaded."""
        drafter = await self.pick("drafter", prefer_drafter, spare_only)
        return drafter, await self.pick("verifier", prefer_verifier, spare_only)

    def hold(self, services: Sequence[ServiceInfo], n: int) -> None:
        """Count (+1) or uncount (-1) this gateway's runs on services. A pick is held at once, before any
        await: concurrent new sessions then see each other and spread instead of all taking one verifier."""
        for s in services:
            key = (s.role, s.service_id)
            self.assigned[key] = self.assigned.get(key, 0) + n

    async def address(self, role: str, service_id: str) -> str | None:
        for s in await self.live(role):
            if s.service_id == service_id:
                return s.address
        return self.static[role].get(service_id)


class Channels:
    """One grpc.aio channel per address, opened on first use, with the gateway's peer TLS and internal token."""

    def __init__(self, peer: security.ClientSecurity | None = None) -> None:
        self.peer = peer
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = security.channel(address, self.peer)
        return self._channels[address]

    def drafter(self, address: str) -> DrafterClient:
        return drafter_pb2_grpc.DrafterStub(self.get(address))

    def verifier(self, address: str) -> verifier_pb2_grpc.VerifierStub:
        return verifier_pb2_grpc.VerifierStub(self.get(address))

    async def healthy(self, address: str, timeout_s: float) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(self.get(address)).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

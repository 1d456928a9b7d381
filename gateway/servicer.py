"""GatewayServicer: the rsd.v1.Gateway gRPC adapter over GatewayEngine.

Errors (gateway.proto): bad request -> INVALID_ARGUMENT; unknown session -> NOT_FOUND; the session is
already generating -> FAILED_PRECONDITION; no capacity -> RESOURCE_EXHAUSTED; a run that failed for
good -> the services' status (UNAVAILABLE, ...); anything else -> INTERNAL, logged once with the
request id.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from gateway.engine import GatewayEngine
from rsd_service.status import abort
from rsd_wire import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("rsd.gateway")


async def _abort(context: grpc.aio.ServicerContext, error: Exception, request_id: str) -> None:
    await abort(context, error, log, f"request {request_id or '-'}")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, engine: GatewayEngine):
        self.engine = engine

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        try:
            async for event in self.engine.generate(request):
                yield event
        except Exception as e:
            await _abort(context, e, request.request_id)

    async def Cancel(self, request: gateway_pb2.CancelRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.engine.cancel(request.session_id)
        except Exception as e:
            await _abort(context, e, "")

    async def GetSession(self, request: gateway_pb2.GetSessionRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.engine.get_session(request.session_id, request.include_token_ids)
        except Exception as e:
            await _abort(context, e, "")

    async def drain(self) -> None:
        await self.engine.drain()

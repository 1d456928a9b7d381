"""The one table from exceptions to gRPC status codes, shared by every servicer.

Engines raise plain exceptions of these kinds (no grpc calls inside an engine); a servicer ends the call with
`abort`, which picks the code here. An error outside the table is a bug: the client sees INTERNAL with the
call's id, the log gets the traceback.

    RpcError(code, details)    a status decided where it happened (e.g. a peer's status passed on)
    NotFound                   NOT_FOUND            (unknown session)
    Conflict                   FAILED_PRECONDITION  (busy session, stale epoch, re-attached run)
    Exhausted                  RESOURCE_EXHAUSTED   (pool full, overloaded)
    ValueError                 INVALID_ARGUMENT     (a malformed request, named field)
"""

from __future__ import annotations

import logging

import grpc


class RpcError(Exception):
    """End the call with `code` and `details`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class NotFound(LookupError):
    """NOT_FOUND."""


class Conflict(RuntimeError):
    """FAILED_PRECONDITION."""


class Exhausted(RuntimeError):
    """RESOURCE_EXHAUSTED."""


_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (Exhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """(code, details) for an error of a known kind, None for an unexpected one."""
    if isinstance(error, RpcError):
        return error.code, error.details
    for kind, code in _TABLE:
        if isinstance(error, kind):
            return code, str(error)
    return None


async def abort(context: grpc.aio.ServicerContext, error: BaseException, log: logging.Logger, call: str) -> None:
    """End the call with the error's status; an unexpected error is logged with its traceback and
    reported as INTERNAL naming `call` (a request or session id), not the exception's text."""
    mapped = status_of(error)
    if mapped is None:
        log.error("%s: internal error", call or "-", exc_info=error)
        mapped = (grpc.StatusCode.INTERNAL, f"internal error ({call or '-'}): {type(error).__name__}")
    await context.abort(*mapped)

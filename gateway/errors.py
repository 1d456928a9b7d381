"""The gateway's errors; each derives from an rsd_service.status kind, so the servicer and the HTTP API map it to
its status code with the one table there."""

from __future__ import annotations

import grpc

from rsd_service.status import Conflict, Exhausted, RpcError


class RequestError(ValueError):
    """A request the gateway refuses as it is (INVALID_ARGUMENT). `field`: the GenerateRequest field the message
    begins with ("params.max_new_tokens"), so the HTTP API can name its own parameter instead ("max_tokens")."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class ContextLengthExceeded(RequestError):
    """A turn longer than a limit on the sequence (INVALID_ARGUMENT; OpenAI's code context_length_exceeded): its
    input over max_prompt_tokens, the session over max_session_tokens, or input + new tokens + a draft tree
    over a picked service's max_len."""


class SessionBusy(Conflict):
    """The session already has a running turn (FAILED_PRECONDITION)."""


class Overloaded(Exhausted):
    """No capacity: too many running turns, or no live drafter / verifier (RESOURCE_EXHAUSTED)."""


class TurnFailed(RpcError):
    """A run failed for good (the services' status is kept in `code`)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL):
        super().__init__(code, message)


class StoreUnavailable(TurnFailed):
    """The session store stayed unreachable for store_retry_s (UNAVAILABLE: retry, nothing committed is lost)."""

    def __init__(self, error: Exception):
        super().__init__(f"session store unavailable: {error}", grpc.StatusCode.UNAVAILABLE)

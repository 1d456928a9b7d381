"""The gateway's OpenAI-compatible HTTP API: FastAPI on uvicorn, inside the gateway's event loop.

    http = await start_http_api(config, engine, metrics)   # config.http_port: -1 off, 0 a free port
    http.base_url                                          # http://127.0.0.1:PORT/v1
    await http.stop(grace_s)

    GET  /v1/models, /v1/models/{id}  the one model (served_model_name, else the tokenizer folder's name)
    POST /v1/completions          prompt -> text             } stream: server-sent events, one chunk per
    POST /v1/chat/completions     messages -> chat template  } committed step, then `data: [DONE]`
    POST /tokenize, /detokenize   vLLM's: text or messages -> token ids, as the two above make them; ids -> text
    GET  /metrics                 the gateway's Prometheus metrics (the same registry as metrics_port's)
    GET  /openapi.json            the API's schema
    GET  /health, /version        200 while serving (503 draining); {"version": rsd's version} (no token needed)

Each request becomes a GenerateRequest (n of them for n choices: n sessions) for the GatewayEngine the gRPC
servicer serves (no hop through the gRPC port), so both APIs share sessions, params validation, the auth token
(`Authorization: Bearer`, on every route but /health and /version), limits (max_running_turns,
max_concurrent_rpcs: calls at once, max_message_bytes: body size), metrics (rsd_gateway_requests_total{method=
"/v1/..."} and the Generate stream metrics) and request ids (X-Request-Id, else a new one; echoed back, in the
reply id and in the logs). Bodies and what is supported: gateway.openai.schema.

A body over max_message_bytes is refused from its Content-Length, else as soon as what arrived passes the limit,
never buffered whole; the input is tokenised in a worker thread (GatewayEngine), so a long prompt holds up no
other call.

Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}} on every route, the unknown ones too,
and name the parameter the client sent (max_tokens, not the engine's params.max_new_tokens): 400 bad input
(code context_length_exceeded for a turn over max_prompt_tokens, max_session_tokens or the services' max_len:
refused before a stream begins, `stream: true` included), 401 no or bad token, 404 unknown model, session or
route, 405 a route's wrong method, 409 the session is already generating, 413 body too large, 429 no capacity,
503/504 the services are away / the turn ran out of time, 500 anything else (logged once with the request id).
An error after a stream began comes as one `data: {"error": ...}` event before [DONE].

A client that disconnects cancels its turn (a stream: Starlette cancels the response, _EventStream's
on_close cancels the turn; a waiting request: a task watches for the disconnect). What the turn
committed stays in the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import anyio
import grpc
import pydantic
import pydantic_core
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from gateway.config import GatewayConfig
from gateway.engine import GatewayEngine
from gateway.errors import ContextLengthExceeded, RequestError
from gateway.openai.schema import (
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Logprobs,
    Reply,
    SpecDecodeMetrics,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    model_card,
    param_of,
    usage,
)
from gateway.requests import chat_message
from rsd_service.metrics import GatewayMetrics
from rsd_service.security import TokenInterceptor, read_secret
from rsd_service.serving import log_context
from rsd_service.status import status_of
from rsd_wire import gateway_pb2

log = logging.getLogger("rsd.gateway")

_HTTP_STATUS = {  # gRPC status -> (HTTP status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_INTERNAL = (500, "internal_error")
_GENERATE = "/rsd.v1.Gateway/Generate"  # the gRPC method whose stream metrics the HTTP calls feed too
_MAX_REQUEST_ID = 128
_VERSION = metadata.version("rsd")


class ApiError(Exception):
    """An answer other than 200: a gRPC status (mapped by _HTTP_STATUS) or an explicit HTTP status."""

    def __init__(self, code: grpc.StatusCode, message: str, *, http_status: int = 0, param: str | None = None):
        super().__init__(message)
        self.code, self.http_status, self.param = code, http_status, param
        self.error_code: str | None = None

    def body(self) -> dict[str, Any]:
        kind = _HTTP_STATUS.get(self.code, _INTERNAL)[1]
        return error_body(str(self), kind, self.error_code, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.http_status or _HTTP_STATUS.get(self.code, _INTERNAL)[0])


# The GenerateRequest fields a RequestError names -> the parameter an HTTP client sent.
_PUBLIC = {
    "text": "prompt",
    "token_ids.ids": "prompt",
    "messages": "messages",
    "params.max_new_tokens": "max_tokens",
    "params.method": "method",
    "params.stop_sequences": "stop",
    "params.verification": "verification",
    "params.adaptive_shape": "adaptive_shape",
    "params.logprobs_mode": "logprobs_mode",
    "session_id": "session_id",
}


def _public_param(error: RequestError, body: Any) -> str | None:
    """The parameter to name for `error`: where the engine's field is the client's parameter under another name."""
    chat = isinstance(body, ChatCompletionRequest)
    if isinstance(error, ContextLengthExceeded):
        return "messages" if chat else "prompt"  # as OpenAI names it
    if error.field == "params.sampling":  # SamplingParams names the one it refuses first
        reason = str(error)[len(error.field) + 2 :]
        names = ("temperature", "top_k", "top_p", "logit_bias", "presence_penalty", "frequency_penalty")
        return next((p for p in (*names, "repetition_penalty") if reason.startswith(p)), None)
    if error.field == "params.top_logprobs":
        return "top_logprobs" if chat else "logprobs"
    if error.field == "params.constraint":
        return "structured_outputs" if getattr(body, "structured_outputs", None) is not None else "response_format"
    if error.field == "params.max_new_tokens" and chat and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return _PUBLIC.get(error.field)


def api_error(error: BaseException, request_id: str, body: Any = None) -> ApiError:
    """The ApiError for an engine (or our own) error, naming the client's parameter (`body`: its request, once
    parsed); an unexpected error is logged once and becomes 500."""
    if isinstance(error, ApiError):
        return error
    mapped = status_of(error)
    if mapped is None:
        log.error("request %s failed", request_id, exc_info=error)
        return ApiError(grpc.StatusCode.INTERNAL, f"internal error (request {request_id})")
    code, message = mapped
    param = _public_param(error, body) if isinstance(error, RequestError) else None
    if param and isinstance(error, RequestError) and error.field and message.startswith(error.field):
        message = param + message[len(error.field) :]  # "params.max_new_tokens: must be ..." -> "max_tokens: ..."
    api = ApiError(code, message, param=param)
    if isinstance(error, ContextLengthExceeded):
        api.error_code = "context_length_exceeded"  # as OpenAI and vLLM name it
    return api


@dataclass
class _Call:
    """One HTTP call in flight: counted against max_concurrent_rpcs, in the metrics and the log context."""

    api: HttpApi
    path: str
    request_id: str
    t0: float
    token: Any
    code: str = "OK"
    done: bool = False

    def finish(self, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.done = True
        if error is not None:
            self.code = error.code.name if isinstance(error, ApiError) else "CANCELLED"
        self.api.in_flight -= 1
        self.api.metrics.requests.labels(self.path, self.code).inc()
        self.api.metrics.request_seconds.labels(self.path).observe(time.perf_counter() - self.t0)
        with contextlib.suppress(ValueError):  # reset from another context (a stream's task): nothing to undo
            log_context.reset(self.token)


class HttpApi:
    """The endpoints over one GatewayEngine."""

    def __init__(self, config: GatewayConfig, engine: GatewayEngine, metrics: GatewayMetrics):
        self.config, self.engine, self.metrics = config, engine, metrics
        self.model_name = config.served_model_name or Path(config.tokenizer).name or "rsd"
        token = read_secret(config.auth_token, config.auth_token_file, "auth_token")
        self._token = TokenInterceptor(token) if token else None
        self.in_flight = 0
        self.draining = False  # set by GatewayHandle.drain: /health answers 503 from then on
        self.created = int(time.time())
        # openapi_url=None: /openapi.json is a route of ours, behind the token like the others.
        self.app = FastAPI(title="rsd gateway (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.add_exception_handler(HTTPException, _route_error)  # unknown route 404, wrong method 405
        self.app.add_exception_handler(Exception, _unexpected)
        route = self.app.add_api_route
        route("/v1/models", self.models, methods=["GET"])
        route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        route("/v1/completions", self.completions, methods=["POST"], openapi_extra=_body_schema(CompletionRequest))
        chat = _body_schema(ChatCompletionRequest)
        route("/v1/chat/completions", self.chat_completions, methods=["POST"], openapi_extra=chat)
        tokenize = _body_schema(TokenizeCompletionRequest, TokenizeChatRequest)
        route("/tokenize", self.tokenize, methods=["POST"], openapi_extra=tokenize)
        route("/detokenize", self.detokenize, methods=["POST"], openapi_extra=_body_schema(DetokenizeRequest))
        route("/metrics", self.prometheus, methods=["GET"])
        route("/openapi.json", self.openapi, methods=["GET"], include_in_schema=False)
        route("/health", self.health, methods=["GET"])
        route("/version", self.version, methods=["GET"])

    # -- admission -----------------------------------------------------------------------------

    def _begin(self, request: Request, path: str) -> _Call:
        request_id = request.headers.get("x-request-id", "")
        if not request_id or len(request_id) > _MAX_REQUEST_ID or not request_id.isprintable():
            request_id = uuid.uuid4().hex
        token = log_context.set((("method", path), ("request_id", request_id)))
        self.in_flight += 1
        return _Call(self, path, request_id, time.perf_counter(), token)

    def _admit(self, request: Request, call: _Call) -> None:
        if self._token is not None:
            reason = self._token.check([("authorization", request.headers.get("authorization", ""))])
            if reason:
                log.warning("refused %s: %s", call.path, reason)
                error = ApiError(grpc.StatusCode.UNAUTHENTICATED, reason.replace("metadata", "header"))
                error.error_code = "invalid_api_key"
                raise error
        limit = self.config.max_concurrent_rpcs
        if limit and self.in_flight > limit:
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than max_concurrent_rpcs={limit} calls at once")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) from its Content-Length or once what arrived passes max_message_bytes."""
        limit = self.config.max_message_bytes
        too_large = ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"body over max_message_bytes {limit}", http_status=413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _body(self, request: Request, *models: type[pydantic.BaseModel]) -> Any:
        """The body as the first of `models` whose fields it names (the last one otherwise), validated; its
        model checked against the one served (where it names one)."""
        raw = await self._read_body(request)
        try:
            data = pydantic_core.from_json(raw)
        except ValueError as e:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "the body must be a JSON object")
        model = next((m for m in models[:-1] if set(m.model_fields) >= set(data)), models[-1])
        try:
            body = model.model_validate(data)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            param = param_of(first)
            message = first["msg"].removeprefix("Value error, ")
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{param}: {message}" if param else message, param=param
            ) from None
        if getattr(body, "model", None) not in (None, self.model_name):
            error = ApiError(
                grpc.StatusCode.NOT_FOUND, f"model {body.model!r} is not served here (this is {self.model_name!r})"
            )
            error.error_code, error.param = "model_not_found", "model"
            raise error
        return body

    async def _answer(self, request: Request, path: str, answer: Callable[[], Awaitable[Response]]) -> Response:
        """A call that is not a turn: admitted (token, calls at once), counted and logged as the turns are."""
        call = self._begin(request, path)
        try:
            self._admit(request, call)
            response = await answer()
        except Exception as e:
            error = api_error(e, call.request_id)
            call.finish(error)
            return _with_id(error.response(), call)
        call.finish()
        return _with_id(response, call)

    # -- endpoints -----------------------------------------------------------------------------

    async def _card(self) -> dict[str, Any]:
        return model_card(self.model_name, self.created, await self.engine.max_model_len())

    async def models(self, request: Request) -> Response:
        async def answer() -> Response:
            return JSONResponse({"object": "list", "data": [await self._card()]})

        return await self._answer(request, "/v1/models", answer)

    async def model(self, request: Request, model_id: str) -> Response:
        async def answer() -> Response:
            if model_id != self.model_name:
                error = ApiError(grpc.StatusCode.NOT_FOUND, f"the model {model_id!r} does not exist")
                error.error_code, error.param = "model_not_found", "model"
                raise error
            return JSONResponse(await self._card())

        return await self._answer(request, "/v1/models/{model}", answer)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the ids /v1/completions or /v1/chat/completions would start from."""

        async def answer() -> Response:
            body = await self._body(request, TokenizeCompletionRequest, TokenizeChatRequest)
            tokenizer = self.engine.tokenizer
            if isinstance(body, TokenizeChatRequest):
                messages = [chat_message(m.to_proto()) for m in body.messages]
                encode = partial(self.engine.chat.encode, messages, False, body.add_generation_prompt)
            else:
                encode = partial(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
            try:
                ids = list(await asyncio.to_thread(encode))  # a long text: off the event loop
            except ValueError as e:
                raise RequestError(f"messages: {e}", "messages") from None
            strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
            max_model_len = await self.engine.max_model_len()
            return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs})

        return await self._answer(request, "/tokenize", answer)

    async def detokenize(self, request: Request) -> Response:
        async def answer() -> Response:
            body = await self._body(request, DetokenizeRequest)
            vocab_size = self.engine.vocab_size
            bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab_size), None)
            if bad is not None:
                message = f"tokens[{bad}]: token id {body.tokens[bad]} is outside [0, {vocab_size})"
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=f"tokens[{bad}]")
            text = await asyncio.to_thread(self.engine.tokenizer.decode, body.tokens)
            return JSONResponse({"prompt": text})

        return await self._answer(request, "/detokenize", answer)

    async def prometheus(self, request: Request) -> Response:
        async def answer() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return await self._answer(request, "/metrics", answer)

    async def openapi(self, request: Request) -> Response:
        async def answer() -> Response:
            return JSONResponse(self.app.openapi())

        return await self._answer(request, "/openapi.json", answer)

    async def health(self) -> Response:
        """200 while the gateway serves (what vLLM's /health answers), 503 once it drains; open, like gRPC health."""
        if self.draining:
            return JSONResponse(error_body("the gateway is draining", "service_unavailable_error"), status_code=503)
        return Response(status_code=200)

    async def version(self) -> Response:
        return JSONResponse({"version": _VERSION})

    async def completions(self, request: Request):
        return await self._generate(request, "/v1/completions", CompletionRequest)

    async def chat_completions(self, request: Request):
        return await self._generate(request, "/v1/chat/completions", ChatCompletionRequest)

    async def _generate(self, request: Request, path: str, model: type[pydantic.BaseModel]):
        call = self._begin(request, path)
        choices: list[_Choice] = []
        body = None
        try:
            self._admit(request, call)
            body = await self._body(request, model)
            chat = model is ChatCompletionRequest
            for i, generate in enumerate(body.to_generate_requests(call.request_id)):  # n turns, one a choice
                # the Generate stream metrics, as for a gRPC call
                beside = choices[0].session_id if choices else ""  # one verifier computes the prompt once
                choice = _Choice(i, self.engine.generate(generate, beside), self.metrics.observer(_GENERATE))
                choices.append(choice)
                first = await anext(choice.events)  # the turn started (or the request was refused: raised here)
                choice.observe(first)
                choice.started, choice.session_id = first.started, first.session_id
                if body.num_top_logprobs is not None:
                    choice.logprobs = Logprobs(chat, self.engine.tokenizer.decode)
            spec = SpecDecodeMetrics.of(choices[0].started.params)
            reply = Reply(chat, call.request_id, self.model_name, choices[0].session_id, spec)
            reply.include_usage, reply.session_ids = body.include_usage, [c.session_id for c in choices]
            if body.stream:
                return _with_id(self._stream_response(call, choices, reply), call)
            response = await self._whole(request, choices, reply)
        except Exception as e:
            error = api_error(e, call.request_id, body)
            call.finish(error)
            for choice in choices:
                await choice.close()
                if choice.started is not None and not choice.done:  # another choice failed: stop this one
                    await self._cancel_turn(choice.session_id)
            return _with_id(error.response(), call)
        call.finish()
        return _with_id(response, call)

    async def _whole(self, request, choices: list[_Choice], reply: Reply) -> JSONResponse:
        """Wait for every choice's turn to end, or for the client to leave (then cancel the turns)."""
        collect = asyncio.gather(*(_collect(choice, reply) for choice in choices))
        gone = asyncio.create_task(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                for choice in choices:
                    await self._cancel_turn(choice.session_id)
        if not collect.done() or collect.cancelled():
            raise ApiError(grpc.StatusCode.CANCELLED, "the client disconnected")  # nobody reads this answer
        outcomes = collect.result()  # [(text, finished, entries)] per choice
        token_usage = usage(choices[0].started, [finished for _, finished, _ in outcomes])
        ends = [
            (text, FINISH_REASONS[finished.reason], choice.logprobs.body(entries) if choice.logprobs else None)
            for choice, (text, finished, entries) in zip(choices, outcomes, strict=True)
        ]
        return JSONResponse(reply.whole(ends, token_usage))

    async def _stream(self, call, choices: list[_Choice], reply: Reply) -> AsyncIterator[str]:
        """The SSE body: a first chunk per choice, one per delta with text (or logprobs), each choice's finish,
        [usage], [DONE]. The choices' chunks interleave as their steps commit."""
        finished: list[gateway_pb2.GenerationFinished] = []
        try:
            for choice in choices:
                yield _sse(reply.chunk("", first=True, index=choice.index))
            async for choice, event in _merged(choices):
                choice.observe(event)
                kind = event.WhichOneof("event")
                if kind == "delta" and event.delta.HasField("stats"):
                    reply.spec.observe(event.delta.stats)
                entries = choice.logprobs.entries(event.delta) if kind == "delta" and choice.logprobs else None
                if kind == "delta" and (event.delta.text or entries):
                    logprobs = choice.logprobs.body(entries) if entries else None
                    yield _sse(reply.chunk(event.delta.text, logprobs=logprobs, index=choice.index))
                elif kind == "finished":
                    choice.done = True
                    finished.append(event.finished)
                    if len(finished) == len(choices):
                        call.finish()  # every turn is over: a client leaving now cancels nothing
                    last = len(finished) == len(choices) and not reply.include_usage  # else the usage chunk is
                    reason = FINISH_REASONS[event.finished.reason]
                    yield _sse(reply.chunk("", reason, last=last, index=choice.index))
            if len(finished) < len(choices):
                raise ApiError(grpc.StatusCode.INTERNAL, "a turn ended without a finish event")
            if reply.include_usage:
                yield _sse(reply.usage_chunk(usage(choices[0].started, finished)))
            yield "data: [DONE]\n\n"
        except Exception as e:
            error = api_error(e, call.request_id)
            call.finish(error)
            yield _sse(error.body())
            yield "data: [DONE]\n\n"

    def _stream_response(self, call, choices: list[_Choice], reply: Reply) -> StreamingResponse:
        async def on_close() -> None:
            if not call.done:  # the client left before the turns ended
                for choice in choices:
                    if not choice.done:
                        await self._cancel_turn(choice.session_id)
                call.finish(asyncio.CancelledError())
            for choice in choices:
                await choice.close()

        return _EventStream(self._stream(call, choices, reply), on_close)

    async def _cancel_turn(self, session_id: str) -> None:
        try:
            await self.engine.cancel(session_id)
            log.info("session %s: the HTTP client left; its turn is cancelled", session_id)
        except Exception as e:
            log.warning("session %s: cancel after a disconnect failed: %s", session_id, e)


@dataclass
class _Choice:
    """One of a request's n choices: its own turn (a session), its Generate events and their metrics observer."""

    index: int
    events: AsyncIterator[gateway_pb2.GenerateEvent]
    observe: Any
    started: gateway_pb2.GenerationStarted | None = None
    session_id: str = ""
    logprobs: Logprobs | None = None  # its own: text offsets run per choice
    done: bool = False  # its turn finished

    async def close(self) -> None:
        await self.events.aclose()
        self.observe.end()


async def _collect(choice: _Choice, reply: Reply) -> tuple[str, gateway_pb2.GenerationFinished, list]:
    """-> the choice's text, its finish and its tokens' logprobs entries (Logprobs.entries; [] when not asked)."""
    texts, entries = [], []
    try:
        async for event in choice.events:
            choice.observe(event)
            kind = event.WhichOneof("event")
            if kind == "delta":
                texts.append(event.delta.text)
                if event.delta.HasField("stats"):
                    reply.spec.observe(event.delta.stats)
                if choice.logprobs is not None:
                    entries += choice.logprobs.entries(event.delta)
            elif kind == "finished":
                choice.done = True
                return "".join(texts), event.finished, entries
        raise ApiError(grpc.StatusCode.INTERNAL, "the turn ended without a finish event")
    finally:
        choice.observe.end()


async def _merged(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, gateway_pb2.GenerateEvent]]:
    """The choices' events as they come, each with its choice; an error in one ends the whole."""
    if len(choices) == 1:  # the common case: no tasks
        async for event in choices[0].events:
            yield choices[0], event
        return
    pending = {asyncio.ensure_future(anext(c.events)): c for c in choices}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                choice = pending.pop(task)
                try:
                    event = task.result()
                except StopAsyncIteration:
                    continue
                yield choice, event
                pending[asyncio.ensure_future(anext(choice.events))] = choice
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # so the streams can be closed next


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events that run `on_close` however the response ends: streamed whole, or cancelled when
    the client disconnects (Starlette cancels it), even before its body started or while it was sending."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Any]):
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.on_close()


def _body_schema(*models: type[pydantic.BaseModel]) -> dict[str, Any]:
    """The routes read their bodies themselves (HttpApi._body); this tells /openapi.json what they take."""
    schemas = [m.model_json_schema() for m in models]
    schema = schemas[0] if len(schemas) == 1 else {"oneOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _route_error(request: Request, error: HTTPException) -> JSONResponse:
    """An unknown route (404) or a route's wrong method (405), in OpenAI's shape (as OpenAI words it)."""
    message = f"{error.detail} ({request.method} {request.url.path})"
    body = error_body(message, "invalid_request_error" if error.status_code < 500 else "internal_error")
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return JSONResponse(error_body("internal error", "internal_error"), status_code=500)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _with_id(response, call: _Call):
    response.headers["x-request-id"] = call.request_id
    return response


# ---------------------------------------------------------------------------------------------
# The server


class _Server(uvicorn.Server):
    """uvicorn inside the gateway's loop: the gateway handles SIGTERM (serve_until_signal), not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class HttpApiServer:
    api: HttpApi
    server: _Server
    task: asyncio.Task
    host: str
    port: int

    @property
    def base_url(self) -> str:
        scheme = "https" if self.server.config.ssl_certfile else "http"
        return f"{scheme}://{self.host}:{self.port}/v1"

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop accepting, let open requests finish for grace_s, then close them."""
        self.server.config.timeout_graceful_shutdown = max(int(grace_s), 1)
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def start_http_api(config: GatewayConfig, engine: GatewayEngine, metrics: GatewayMetrics) -> HttpApiServer:
    """Serve the HTTP API on config.host:config.http_port (0: a free port) with the config's TLS / mTLS."""
    api = HttpApi(config, engine, metrics)
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.create_server((config.host, config.http_port), family=family)
    tls = {}
    if config.tls_cert:
        tls = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
        if config.tls_ca:
            tls.update(ssl_ca_certs=config.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    uv_config = uvicorn.Config(
        api.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1, **tls
    )
    server = _Server(uv_config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-api")
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise OSError(f"the HTTP API did not start on {config.host}:{config.http_port}")
        await asyncio.sleep(0.01)
    host = config.host if family == socket.AF_INET else f"[{config.host}]"
    return HttpApiServer(api, server, task, host, sock.getsockname()[1])

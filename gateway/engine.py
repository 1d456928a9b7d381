"""The gateway's session logic, without the gRPC server around it.

One Generate call ("a turn"):
    1. validate the request (RequestError names the field), tokenize its input
    2. create the session (new) or claim it (continue): choose a drafter and a verifier, begin a new
       epoch in the store (compare-and-set: a second concurrent turn gets SessionBusy), append the
       turn's input at the committed length
    3. a background task (the turn outlives its client stream: a lost client resumes later) calls
       Drafter.Run and commits each RunEvent's tokens with append_tokens(position, epoch), then
       turns them into text (Detokenizer), cuts at stop sequences (StopFilter) and queues a
       TokenDelta; the stream of the call reads that queue
    4. a drafter or verifier UNAVAILABLE mid-run: the failed service is dropped, a live pair is
       chosen, a new epoch begun, and Run called again from the committed tokens in the store. Only
       tokens the store accepted were streamed, so the client sees no gap and no repeat.
A resume (session_id without input) replays the committed tokens and follows the running turn by
polling the store, so it works on any gateway; it ends with the finish reason the store kept.

Leases: a running turn renews its session's lease (updated_unix_ms, stamped by the store's clock) every
turn_lease_s / 3. A RUNNING session whose lease is older than turn_lease_s on the store's clock lost its
gateway: a resume takes it over, and so does every gateway's orphan sweep (every orphan_sweep_s), so an
orphaned turn finishes (or fails, when no drafter / verifier is live) even if no client comes back.

The continued session sticks to the verifier in its KV location while that verifier is alive, so
the verifier keeps (and crops to) the cache it already holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig, parse_services
from gateway.store import (
    ServiceInfo,
    SessionConflict,
    SessionNotFound,
    SessionRecord,
    SessionStatus,
    SessionStore,
)
from rsd.methods import DEFAULT_SHAPES
from rsd.sampling import SamplingParams
from rsd_service import security
from rsd_service.registry import check_id
from rsd_service.status import Conflict, Exhausted, RpcError
from rsd_wire import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    verifier_pb2,
    verifier_pb2_grpc,
)
from rsd_wire.convert import parse_method

log = logging.getLogger("rsd.gateway")

_CONTEXT_TOKENS = 6  # committed tokens decoded in front of new ones, so spacing and merges come out right
_MAX_REQUEST_ID = 128
_MAX_STOP_CHARS = 256

_STATUS_TO_PROTO = {
    SessionStatus.PENDING: gateway_pb2.SESSION_STATUS_PENDING,
    SessionStatus.RUNNING: gateway_pb2.SESSION_STATUS_RUNNING,
    SessionStatus.FINISHED: gateway_pb2.SESSION_STATUS_FINISHED,
    SessionStatus.CANCELLED: gateway_pb2.SESSION_STATUS_CANCELLED,
    SessionStatus.FAILED: gateway_pb2.SESSION_STATUS_FAILED,
}


def _lease_expired(record: SessionRecord, lease_s: float, now_ms: int) -> bool:
    """No gateway has refreshed the session's running turn for lease_s (GatewayConfig.turn_lease_s), by the
    store's clock: now_ms is store.now_ms(), the clock that stamped updated_unix_ms."""
    return now_ms - record.updated_unix_ms > lease_s * 1000


def finish_reason_name(reason: int) -> str:
    """FINISH_REASON_EOS -> "eos": how the store keeps it (the store knows no protos)."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def finish_reason_value(name: str) -> int:
    """ "eos" -> FINISH_REASON_EOS; "" (not finished, or failed) -> FINISH_REASON_UNSPECIFIED."""
    return common_pb2.FinishReason.Value(f"FINISH_REASON_{name.upper()}") if name else 0


class RequestError(ValueError):
    """A request the gateway refuses as it is (INVALID_ARGUMENT)."""


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


# ---------------------------------------------------------------------------------------------
# Text


class Detokenizer:
    """Token ids -> text deltas whose concatenation is the decoded text after `context_ids`.

    Decodes a short window [prefix_offset:] and emits what it adds to [prefix_offset:read_offset];
    while the window ends in U+FFFD (a character split across tokens) nothing is emitted, so the
    character comes with the token that completes it. Decoding after context tokens keeps the
    spaces a tokenizer inserts between tokens (word-level) or strips at the start (SentencePiece).
    """

    def __init__(self, tokenizer: Any, context_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids = list(context_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        return self._advance(force=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end), as it decodes."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if not force and (new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text)):
            return ""
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else new_text
        # Keep a few tokens as the next window's context; drop older ones.
        self.prefix_offset = max(self.read_offset, len(self.ids) - _CONTEXT_TOKENS)
        self.prefix_offset = min(self.prefix_offset, len(self.ids))
        self.read_offset = len(self.ids)
        if self.prefix_offset > self.read_offset:  # pragma: no cover - defensive
            self.prefix_offset = self.read_offset
        return delta


class StopFilter:
    """Passes text through until the first stop sequence; holds back any tail that could start one."""

    def __init__(self, stop_sequences: Sequence[str]):
        self.stops = [s for s in stop_sequences if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = 0 if final else self._partial_stop_len()
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:k]):
                    best = k
                    break
        return best


# ---------------------------------------------------------------------------------------------
# Params: stored in the session as a JSON dict, on the wire as GenerationParams


def default_params(config: GatewayConfig) -> dict[str, Any]:
    return {
        "temperature": config.default_temperature,
        "top_k": 0,
        "top_p": 1.0,
        "method": config.default_method,
        "shape": config.default_shape,
        "max_new_tokens": config.default_max_new_tokens,
        "stop_sequences": [],
        "seed": None,
    }


def merge_params(base: Mapping[str, Any], msg: common_pb2.GenerationParams | None) -> dict[str, Any]:
    """`base` with the fields present in `msg` replacing it (a new session's base is the defaults)."""
    params = dict(base)
    if msg is None:
        return params
    if msg.HasField("sampling"):
        s = msg.sampling
        if s.HasField("temperature"):
            params["temperature"] = s.temperature
        params["top_k"] = s.top_k
        if s.HasField("top_p"):
            params["top_p"] = s.top_p
    if msg.HasField("method"):
        name = msg.method.name or params["method"]
        same = params["shape"] if name == params["method"] else DEFAULT_SHAPES.get(name, "")
        shape = msg.method.shape or same
        params["method"], params["shape"] = name, shape
    if msg.max_new_tokens:
        params["max_new_tokens"] = msg.max_new_tokens
    if msg.stop_sequences:
        params["stop_sequences"] = list(msg.stop_sequences)
    if msg.HasField("seed"):
        params["seed"] = msg.seed
    return params


def validate_params(params: Mapping[str, Any], config: GatewayConfig) -> None:
    try:
        SamplingParams(float(params["temperature"]), int(params["top_k"]), float(params["top_p"]))
    except ValueError as e:
        raise RequestError(f"params.sampling: {e}") from None
    try:
        parse_method(params["method"], params["shape"])
    except ValueError as e:
        raise RequestError(f"params.method: {e}") from None
    if not 1 <= params["max_new_tokens"] <= config.max_new_tokens_limit:
        raise RequestError(
            f"params.max_new_tokens must be in [1, {config.max_new_tokens_limit}], got {params['max_new_tokens']}"
        )
    stops = params["stop_sequences"]
    if len(stops) > config.max_stop_sequences:
        raise RequestError(f"params.stop_sequences: at most {config.max_stop_sequences}, got {len(stops)}")
    if any(not s or len(s) > _MAX_STOP_CHARS for s in stops):
        raise RequestError(f"params.stop_sequences: each must have 1..{_MAX_STOP_CHARS} characters")


def params_to_proto(params: Mapping[str, Any]) -> common_pb2.GenerationParams:
    msg = common_pb2.GenerationParams(
        sampling=common_pb2.SamplingParams(
            temperature=float(params["temperature"]), top_k=int(params["top_k"]), top_p=float(params["top_p"])
        ),
        method=common_pb2.Method(name=params["method"], shape=params["shape"]),
        max_new_tokens=int(params["max_new_tokens"]),
        stop_sequences=list(params["stop_sequences"]),
    )
    if params.get("seed") is not None:
        msg.seed = int(params["seed"])
    return msg


def session_to_proto(record: SessionRecord, include_token_ids: bool) -> gateway_pb2.Session:
    msg = gateway_pb2.Session(
        session_id=record.session_id,
        status=_STATUS_TO_PROTO[record.status],
        prompt_length_tokens=len(record.prompt_ids),
        committed_length_tokens=record.committed_length,
        drafter_id=record.drafter_id,
        verifier_id=record.verifier_id,
        kv_location=common_pb2.KvLocation(
            verifier_id=record.kv.verifier_id, length_tokens=record.kv.length, epoch=record.kv.epoch
        ),
        created_unix_ms=record.created_unix_ms,
        updated_unix_ms=record.updated_unix_ms,
        last_finish_reason=finish_reason_value(record.finish_reason),
    )
    if record.params:
        msg.params.CopyFrom(params_to_proto(record.params))
    if include_token_ids:
        msg.prompt_token_ids.extend(record.prompt_ids)
        msg.committed_token_ids.extend(record.committed_ids)
    return msg


# ---------------------------------------------------------------------------------------------
# Services: who runs drafters and verifiers, and channels to them


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

    async def pick(self, role: str, prefer: str = "") -> ServiceInfo:
        services = await self.live(role)
        if not services:
            raise Overloaded(f"no live {role}")
        for s in services:
            if s.service_id == prefer:
                return s

        def load(s: ServiceInfo) -> float:
            return (s.load + self.assigned.get((role, s.service_id), 0)) / max(s.capacity, 1)

        return min(services, key=lambda s: (load(s), s.service_id))

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

    def drafter(self, address: str) -> drafter_pb2_grpc.DrafterStub:
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


# ---------------------------------------------------------------------------------------------
# Turns


@dataclass
class _Turn:
    session_id: str
    params: dict[str, Any]
    turn_start: int  # committed length when generation of the turn began
    epoch: int
    drafter: ServiceInfo
    verifier: ServiceInfo
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # GenerateEvent | BaseException
    cancelled: bool = False
    task: asyncio.Task | None = None


@dataclass
class _Progress:
    """What a turn has committed and streamed so far, across its runs."""

    position: int  # the committed length
    detok: Detokenizer
    stops: StopFilter
    num_steps: int = 0


class GatewayEngine:
    """Generate / Cancel / GetSession over a SessionStore and the drafter / verifier services."""

    def __init__(self, config: GatewayConfig, store: SessionStore, tokenizer: Any):
        self.config, self.store, self.tokenizer = config, store, tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = [i for i in [tokenizer.eos_token_id] if i is not None]
        self.chat = ChatTemplate(tokenizer)
        self.services = ServiceDirectory(store, config)
        self.channels = Channels(security.peer_security(config))
        self._turns: dict[str, _Turn] = {}
        self._sweeper: asyncio.Task | None = None

    async def _store(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A store call in a thread, retried while Redis is unreachable (e.g. restarting) for store_retry_s.
        Every store write is a compare-and-set, so a retry of one that did land is refused, never doubled."""
        deadline, delay = time.monotonic() + self.config.store_retry_s, 0.05
        while True:
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as e:
                if time.monotonic() > deadline:
                    raise StoreUnavailable(e) from None
                log.warning("session store unreachable (%s); retrying", e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # -- requests ------------------------------------------------------------------------------

    def _input_ids(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        if which == "text":
            if not request.text:
                raise RequestError("text: must not be empty")
            ids = list(self.tokenizer.encode(request.text, add_special_tokens=False))
            if not ids:
                raise RequestError("text: encodes to no tokens")
        elif which == "messages":
            messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            try:
                ids = self.chat.encode(messages, continuation=bool(request.session_id))
            except ValueError as e:
                raise RequestError(f"messages: {e}") from None
        else:
            ids = list(request.token_ids.ids)
            if not ids:
                raise RequestError("token_ids.ids: must not be empty")
            bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"token_ids.ids: token id {bad} is outside [0, {self.vocab_size})")
        if len(ids) > self.config.max_prompt_tokens:
            limit = self.config.max_prompt_tokens
            raise RequestError(f"input has {len(ids)} tokens, more than max_prompt_tokens {limit}")
        return ids

    def _check_request(self, request: gateway_pb2.GenerateRequest) -> None:
        if len(request.request_id) > _MAX_REQUEST_ID:
            raise RequestError(f"request_id: at most {_MAX_REQUEST_ID} characters")
        has_input = request.WhichOneof("input") is not None
        if request.session_id:
            try:
                self.store_check_id(request.session_id)
            except ValueError as e:
                raise RequestError(f"session_id: {e}") from None
        elif not has_input:
            raise RequestError("a new session needs an input (text, token_ids or messages)")
        if has_input and request.HasField("resume_from_position"):
            raise RequestError("resume_from_position: only on a resume (a session_id without input)")

    @staticmethod
    def store_check_id(session_id: str) -> None:
        check_id("session_id", session_id)

    # -- Generate ------------------------------------------------------------------------------

    async def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        self._check_request(request)
        if request.session_id and request.WhichOneof("input") is None:
            async for event in self._resume(request):
                yield event
            return
        turn, started = await self._start_turn(request)
        yield started
        while True:
            event = await turn.events.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if event.WhichOneof("event") == "finished":
                return

    async def _start_turn(self, request: gateway_pb2.GenerateRequest) -> tuple[_Turn, gateway_pb2.GenerateEvent]:
        if len(self._turns) >= self.config.max_running_turns:
            raise Overloaded(f"{len(self._turns)} turns are running on this gateway (max_running_turns)")
        input_ids = self._input_ids(request)
        msg_params = request.params if request.HasField("params") else None
        if request.session_id:
            record = await self._store(self.store.get_session, request.session_id)
            running = record.status == SessionStatus.RUNNING and not _lease_expired(
                record, self.config.turn_lease_s, await self._store(self.store.now_ms)
            )
            if running or request.session_id in self._turns:  # an expired lease: its gateway died, go on
                raise SessionBusy(f"session {request.session_id!r} is already generating")
            params = merge_params(record.params, msg_params)
        else:
            params = merge_params(default_params(self.config), msg_params)
            record = None
        validate_params(params, self.config)
        chat = request.WhichOneof("input") == "messages"  # a chat turn also ends at the template's end of turn
        params["eos_token_ids"] = self.chat.end_of_turn_ids if chat else self.eos_token_ids
        if params.get("seed") is None:
            params["seed"] = secrets.randbits(63)
        committed_before = 0 if record is None else record.committed_length
        params["turn_start"] = committed_before + len(input_ids)  # for a gateway that takes the turn over
        total = committed_before + len(input_ids) + params["max_new_tokens"]
        if total > self.config.max_session_tokens:
            raise RequestError(
                f"session would reach {total} tokens, more than max_session_tokens {self.config.max_session_tokens}"
            )
        drafter, verifier = await self._choose("" if record is None else record.kv.verifier_id)
        self.services.hold((drafter, verifier), +1)  # _drive releases it; so does a failure before _drive
        try:
            if record is None:
                record = await self._store(self.store.create_session, uuid.uuid4().hex, input_ids, params)
            epoch = await self._store(
                self.store.begin_epoch, record.session_id, record.epoch, drafter.service_id, verifier.service_id
            )
            if committed_before:  # a continuation: the turn's input, then its params
                await self._store(self.store.append_tokens, record.session_id, committed_before, input_ids, epoch)
                await self._store(self.store.update_session, record.session_id, params=params, epoch=epoch)
        except SessionConflict as e:
            self.services.hold((drafter, verifier), -1)
            raise SessionBusy(f"session {record.session_id!r} changed under this request: {e}") from None
        except BaseException:
            self.services.hold((drafter, verifier), -1)
            if record is not None:
                with contextlib.suppress(Exception):  # do not leave the session RUNNING with no turn behind it
                    await self._store(self.store.update_session, record.session_id, status=SessionStatus.FAILED)
            raise
        turn = _Turn(record.session_id, params, committed_before + len(input_ids), epoch, drafter, verifier)
        self._turns[turn.session_id] = turn
        turn.task = asyncio.create_task(self._drive(turn), name=f"turn-{turn.session_id}")
        started = gateway_pb2.GenerateEvent(
            session_id=turn.session_id,
            started=gateway_pb2.GenerationStarted(
                start_position=turn.turn_start,
                input_length_tokens=len(input_ids),
                params=params_to_proto(params),
            ),
        )
        log.info(
            "session %s turn at %d: drafter %s verifier %s epoch %d (request %s)",
            turn.session_id,
            turn.turn_start,
            drafter.service_id,
            verifier.service_id,
            epoch,
            request.request_id,
        )
        return turn, started

    async def _choose(self, prefer_verifier: str = "", prefer_drafter: str = "") -> tuple[ServiceInfo, ServiceInfo]:
        drafter = await self.services.pick("drafter", prefer_drafter)
        return drafter, await self.services.pick("verifier", prefer_verifier)

    async def _drive(self, turn: _Turn) -> None:
        """The turn, in the background: runs, failovers, the final status; events go to turn.events."""
        t0 = time.perf_counter()  # the caller holds turn.drafter and turn.verifier (ServiceDirectory.hold)
        status, reason = SessionStatus.FAILED, common_pb2.FINISH_REASON_UNSPECIFIED
        lease = asyncio.create_task(self._keep_lease(turn), name=f"lease-{turn.session_id}")
        try:
            reason, position, num_steps = await self._run_turn_in_time(turn)
            status = SessionStatus.CANCELLED if reason == common_pb2.FINISH_REASON_CANCELLED else SessionStatus.FINISHED
            await turn.events.put(
                gateway_pb2.GenerateEvent(
                    session_id=turn.session_id,
                    finished=gateway_pb2.GenerationFinished(
                        reason=reason,
                        num_new_tokens=position - turn.turn_start,
                        committed_length_tokens=position,
                        num_steps=num_steps,
                        elapsed_ms=(time.perf_counter() - t0) * 1000,
                    ),
                )
            )
        except BaseException as e:
            log.warning("session %s turn failed: %s", turn.session_id, e)
            if isinstance(e, SessionConflict):  # a newer epoch began elsewhere (a takeover)
                e = TurnFailed(f"session {turn.session_id!r} moved on without this turn: {e}", grpc.StatusCode.ABORTED)
            await turn.events.put(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            lease.cancel()
            self.services.hold((turn.drafter, turn.verifier), -1)
            self._turns.pop(turn.session_id, None)
            with contextlib.suppress(SessionConflict, SessionNotFound):
                await self._store(
                    self.store.update_session,
                    turn.session_id,
                    status=status,
                    finish_reason=finish_reason_name(reason) if reason else "",
                    epoch=turn.epoch,
                )
            if status == SessionStatus.CANCELLED:
                await self._release(turn.verifier, turn.session_id, turn.epoch)

    async def _keep_lease(self, turn: _Turn) -> None:
        """Touch the session (updated_unix_ms) while the turn runs: the lease other gateways check."""
        while True:
            await asyncio.sleep(self.config.turn_lease_s / 3)
            try:
                await asyncio.to_thread(self.store.update_session, turn.session_id, epoch=turn.epoch)
            except SessionConflict:
                return  # the epoch moved on: a failover of this turn renews with the new one, or we lost it
            except Exception as e:  # the store is away for a moment; the next beat retries
                log.warning("session %s: lease refresh failed: %s", turn.session_id, e)

    async def _take_over(self, record: SessionRecord) -> None:
        """Continue a RUNNING turn whose gateway stopped refreshing its lease: a new epoch (compare-and-set, so
        one gateway wins; the old run's late writes are refused) and a run from the committed tokens."""
        params = dict(record.params)
        drafter, verifier = await self._choose(record.kv.verifier_id, record.drafter_id)
        self.services.hold((drafter, verifier), +1)
        try:
            epoch = await self._store(
                self.store.begin_epoch, record.session_id, record.epoch, drafter.service_id, verifier.service_id
            )
        except BaseException as e:
            self.services.hold((drafter, verifier), -1)
            if isinstance(e, SessionConflict):
                return  # another gateway took it first; keep following the store
            raise
        turn_start = int(params.get("turn_start", record.committed_length))
        turn = _Turn(record.session_id, params, turn_start, epoch, drafter, verifier)
        self._turns[turn.session_id] = turn
        turn.task = asyncio.create_task(self._drive(turn), name=f"turn-{turn.session_id}")
        log.warning("session %s: took over a turn with a stale lease, epoch %d", turn.session_id, epoch)

    # -- orphaned turns ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the orphan sweep (every orphan_sweep_s; 0 = off). Call on the server's event loop."""
        if self.config.orphan_sweep_s and self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="orphan-sweep")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.orphan_sweep_s)
            try:
                await self.sweep_orphans()
            except Exception as e:  # the store is away for a moment: the next sweep retries
                log.warning("orphan sweep failed: %s", e)

    async def sweep_orphans(self) -> list[str]:
        """Take over every RUNNING turn of another gateway whose lease expired (on the store's clock), so it
        finishes without a client; fail it when no drafter or verifier is live. -> the sessions handled."""
        handled = []
        now_ms = await self._store(self.store.now_ms)
        for session_id in await self._store(self.store.running_sessions):
            if session_id in self._turns or len(self._turns) >= self.config.max_running_turns:
                continue
            try:
                record = await self._store(self.store.get_session, session_id)
            except SessionNotFound:
                continue
            if record.status != SessionStatus.RUNNING or not _lease_expired(record, self.config.turn_lease_s, now_ms):
                continue
            try:
                await self._take_over(record)
            except Overloaded as e:
                await self._fail_orphan(record, str(e))
            handled.append(session_id)
        return handled

    async def _fail_orphan(self, record: SessionRecord, why: str) -> None:
        """Claim the orphan with a new epoch (so a late write of its old run is refused), then mark it FAILED."""
        try:
            epoch = await self._store(
                self.store.begin_epoch, record.session_id, record.epoch, record.drafter_id, record.verifier_id
            )
            await self._store(self.store.update_session, record.session_id, status=SessionStatus.FAILED, epoch=epoch)
        except (SessionConflict, SessionNotFound):
            return  # another gateway took it first, or it expired
        log.warning("session %s: orphaned turn failed: %s", record.session_id, why)

    async def _run_turn_in_time(self, turn: _Turn) -> tuple[int, int, int]:
        """_run_turn within request_timeout_s; past it the run is cancelled (closing the Run stream stops the
        drafter) and the turn fails DEADLINE_EXCEEDED. What it committed stays in the session."""
        timeout_s = self.config.request_timeout_s
        try:
            return await asyncio.wait_for(self._run_turn(turn), timeout_s or None)
        except TimeoutError:
            raise TurnFailed(
                f"turn exceeded request_timeout_s={timeout_s:g}; its committed tokens are kept in the session",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None

    async def _run_turn(self, turn: _Turn) -> tuple[int, int, int]:
        """-> (finish reason, committed length, steps). Calls Run until the turn ends, failing over."""
        committed = await self._store(self.store.get_tokens, turn.session_id)
        state = _Progress(
            len(committed), Detokenizer(self.tokenizer, committed), StopFilter(turn.params["stop_sequences"])
        )
        if state.position > turn.turn_start and committed[-1] in self.eos_token_ids:
            return common_pb2.FINISH_REASON_EOS, state.position, state.num_steps  # a taken-over turn that had ended
        failovers = 0
        while True:
            remaining = int(turn.params["max_new_tokens"]) - (state.position - turn.turn_start)
            if remaining <= 0:
                return common_pb2.FINISH_REASON_LENGTH, state.position, state.num_steps
            try:
                reason = await self._run_once(turn, state, committed, remaining)
                return reason, state.position, state.num_steps
            except StoreUnavailable:
                raise  # not the services' fault: no failover
            except (grpc.aio.AioRpcError, TurnFailed) as e:
                code = e.code() if isinstance(e, grpc.aio.AioRpcError) else e.code
                if turn.cancelled:
                    return common_pb2.FINISH_REASON_CANCELLED, state.position, state.num_steps
                if code != grpc.StatusCode.UNAVAILABLE or failovers >= self.config.max_failovers:
                    details = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                    raise TurnFailed(f"run failed: {details}", code) from None
            failovers += 1
            await self._failover(turn, state.position)
            committed = await self._store(self.store.get_tokens, turn.session_id)
            if len(committed) != state.position:
                raise TurnFailed(f"store holds {len(committed)} tokens, this turn committed up to {state.position}")

    async def _run_once(self, turn: _Turn, state: _Progress, committed: list[int], remaining: int) -> int:
        """One Drafter.Run from the committed tokens; commits and queues its steps; -> finish reason."""
        run = drafter_pb2.RunRequest(
            session_id=turn.session_id,
            epoch=turn.epoch,
            committed_token_ids=committed,
            params=params_to_proto(turn.params),
            max_new_tokens=remaining,
            eos_token_ids=turn.params.get("eos_token_ids", self.eos_token_ids),
            verifier_address=turn.verifier.address,
            verifier_id=turn.verifier.service_id,
        )
        call = self.channels.drafter(turn.drafter.address).Run(run)
        try:
            async for event in call:
                if event.epoch != turn.epoch:
                    raise TurnFailed(f"drafter sent epoch {event.epoch} in a run of epoch {turn.epoch}")
                final = event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                await self._commit_step(turn, state, event, final)
                if state.stops.stopped:
                    await self._cancel_run(turn)
                    return common_pb2.FINISH_REASON_STOP_SEQUENCE
                if turn.cancelled:  # also when the drafter missed the Cancel (it came before the run started)
                    if not final:
                        await self._cancel_run(turn)
                    return common_pb2.FINISH_REASON_CANCELLED
                if final:
                    return event.finish_reason
            raise TurnFailed("drafter ended the run without a final event", grpc.StatusCode.UNAVAILABLE)
        finally:
            call.cancel()  # no-op once the call has ended

    async def _commit_step(self, turn: _Turn, state: _Progress, event: drafter_pb2.RunEvent, final: bool) -> None:
        """Append the step's tokens at their absolute position (compare-and-set), then queue the delta."""
        ids = list(event.token_ids)
        if ids:
            if event.start_position != state.position:
                raise TurnFailed(f"drafter sent tokens at {event.start_position}, expected {state.position}")
            try:
                state.position = await self._store(
                    self.store.append_tokens, turn.session_id, state.position, ids, turn.epoch
                )
            except SessionConflict as e:
                state.position = await self._landed(turn, state.position, ids, e)
            await self._store(self.store.set_kv_length, turn.session_id, turn.epoch, state.position - 1)
        text = state.detok.push(ids) if ids else ""
        if final:
            text += state.detok.flush()
        text = state.stops.push(text, final=final)
        if not ids and not text:
            return
        delta = gateway_pb2.TokenDelta(start_position=state.position - len(ids), token_ids=ids, text=text)
        if event.HasField("stats"):
            delta.stats.CopyFrom(event.stats)
            state.num_steps += 1
        await turn.events.put(gateway_pb2.GenerateEvent(session_id=turn.session_id, delta=delta))

    async def _landed(self, turn: _Turn, position: int, ids: list[int], conflict: SessionConflict) -> int:
        """An append refused: it may have landed before Redis went away (a retried call), else the turn lost
        the session to a newer epoch (another gateway took it over): ABORTED, the client resumes."""
        same_run = conflict.epoch == turn.epoch and conflict.committed_length == position + len(ids)
        if same_run and await self._store(self.store.get_tokens, turn.session_id, position) == ids:
            return position + len(ids)
        raise TurnFailed(f"session {turn.session_id!r} moved on without this turn: {conflict}", grpc.StatusCode.ABORTED)

    async def _failover(self, turn: _Turn, position: int) -> None:
        """Drop the failed service(s), choose a live pair, begin a new epoch."""
        timeout = self.config.health_timeout_s
        drafter_up = await self.channels.healthy(turn.drafter.address, timeout)
        verifier_up = await self.channels.healthy(turn.verifier.address, timeout)
        if not drafter_up:
            self.services.mark_down("drafter", turn.drafter.service_id)
        # A verifier that still answers its health check stays in (it may have refused this session for a
        # moment, e.g. a full KV pool): marking the only verifier down would refuse every request for
        # service_down_s (found by the load test: one eviction race cost 10 s of RESOURCE_EXHAUSTED).
        verifier_failed = not verifier_up
        if verifier_failed:
            self.services.mark_down("verifier", turn.verifier.service_id)
        old = (turn.drafter, turn.verifier)
        # A service that did not fail keeps its cache of the session (verifier: the target KV): stay on it.
        turn.drafter, turn.verifier = await self._choose(
            "" if verifier_failed else turn.verifier.service_id, turn.drafter.service_id if drafter_up else ""
        )
        self.services.hold(old, -1)
        self.services.hold((turn.drafter, turn.verifier), +1)
        turn.epoch = await self._store(
            self.store.begin_epoch, turn.session_id, turn.epoch, turn.drafter.service_id, turn.verifier.service_id
        )
        log.warning(
            "session %s fails over at %d to drafter %s verifier %s, epoch %d",
            turn.session_id,
            position,
            turn.drafter.service_id,
            turn.verifier.service_id,
            turn.epoch,
        )

    async def _cancel_run(self, turn: _Turn) -> bool:
        try:
            reply = await self.channels.drafter(turn.drafter.address).Cancel(
                drafter_pb2.CancelRunRequest(session_id=turn.session_id, epoch=turn.epoch), timeout=5.0
            )
        except grpc.aio.AioRpcError as e:
            log.warning("session %s: drafter Cancel failed: %s", turn.session_id, e.details())
            return False
        return reply.was_running

    async def _release(self, verifier: ServiceInfo, session_id: str, epoch: int) -> None:
        try:
            await self.channels.verifier(verifier.address).Release(
                verifier_pb2.ReleaseRequest(session_id=session_id, epoch=epoch), timeout=5.0
            )
        except grpc.aio.AioRpcError as e:
            log.warning("session %s: verifier Release failed: %s", session_id, e.details())

    # -- resume --------------------------------------------------------------------------------

    async def _resume(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        """Replay the committed tokens from resume_from_position, then follow a running turn."""
        record = await self._store(self.store.get_session, request.session_id)
        start = request.resume_from_position if request.HasField("resume_from_position") else record.committed_length
        if start > record.committed_length:
            raise RequestError(f"resume_from_position {start} is past the committed length {record.committed_length}")
        t0 = time.perf_counter()
        yield gateway_pb2.GenerateEvent(
            session_id=record.session_id,
            started=gateway_pb2.GenerationStarted(start_position=start, params=params_to_proto(record.params)),
        )
        detok = Detokenizer(self.tokenizer, record.committed_ids[:start])
        position = start
        while True:
            tokens = await self._store(self.store.get_tokens, record.session_id, position)
            if tokens:
                text = detok.push(tokens)
                yield gateway_pb2.GenerateEvent(
                    session_id=record.session_id,
                    delta=gateway_pb2.TokenDelta(start_position=position, token_ids=tokens, text=text),
                )
                position += len(tokens)
                continue
            record = await self._store(self.store.get_session, record.session_id)
            if record.status != SessionStatus.RUNNING and record.committed_length == position:
                break
            orphaned = record.status == SessionStatus.RUNNING and _lease_expired(
                record, self.config.turn_lease_s, await self._store(self.store.now_ms)
            )
            if orphaned and record.session_id not in self._turns:  # its gateway died: continue the turn here
                await self._take_over(record)
            await asyncio.sleep(self.config.resume_poll_s)
        tail = detok.flush()
        if tail:
            yield gateway_pb2.GenerateEvent(
                session_id=record.session_id, delta=gateway_pb2.TokenDelta(start_position=position, text=tail)
            )
        reason = finish_reason_value(record.finish_reason)  # UNSPECIFIED for a failed turn
        if record.status == SessionStatus.CANCELLED:
            reason = common_pb2.FINISH_REASON_CANCELLED  # also a record written before finish reasons were kept
        yield gateway_pb2.GenerateEvent(
            session_id=record.session_id,
            finished=gateway_pb2.GenerationFinished(
                reason=reason,
                num_new_tokens=position - start,
                committed_length_tokens=position,
                elapsed_ms=(time.perf_counter() - t0) * 1000,
            ),
        )

    # -- Cancel, GetSession, lifecycle ---------------------------------------------------------

    async def cancel(self, session_id: str) -> gateway_pb2.CancelResponse:
        try:
            self.store_check_id(session_id)
        except ValueError as e:
            raise RequestError(f"session_id: {e}") from None
        record = await self._store(self.store.get_session, session_id)
        turn = self._turns.get(session_id)
        was_running = record.status == SessionStatus.RUNNING
        if turn is not None:
            turn.cancelled = True
            await self._cancel_run(turn)
        elif was_running and record.drafter_id:  # the turn runs on another gateway: stop its drafter run
            address = await self.services.address("drafter", record.drafter_id)
            if address is not None:
                other = ServiceInfo("drafter", record.drafter_id, address)
                await self._cancel_run(_Turn(session_id, {}, 0, record.epoch, other, other))
        return gateway_pb2.CancelResponse(was_running=was_running, committed_length_tokens=record.committed_length)

    async def get_session(self, session_id: str, include_token_ids: bool) -> gateway_pb2.Session:
        try:
            self.store_check_id(session_id)
        except ValueError as e:
            raise RequestError(f"session_id: {e}") from None
        record = await self._store(self.store.get_session, session_id)
        return session_to_proto(record, include_token_ids)

    @property
    def num_running(self) -> int:
        return len(self._turns)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Let running turns finish (up to timeout_s, default drain_s), then cancel the rest."""
        tasks = [t.task for t in self._turns.values() if t.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.config.drain_s if timeout_s is None else timeout_s)
            for turn in list(self._turns.values()):
                turn.cancelled = True
                await self._cancel_run(turn)
            if pending:
                await asyncio.wait(pending, timeout=5.0)
            for task in pending:
                task.cancel()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self.drain(0.0)
        await self.channels.close()

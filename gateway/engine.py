"""The gateway's session logic, without the gRPC server around it: GatewayEngine runs turns over a SessionStore
(gateway.store) and the drafter / verifier services (gateway.directory). Its inputs are checked and read by
gateway.requests, its text streamed by gateway.text, its errors are gateway.errors.

One Generate call ("a turn"):
    1. validate the request (RequestError names the field), tokenize its input (in a worker thread, so a
       long text holds up no other call); refuse a turn longer than
       max_session_tokens or than the picked services' max_len (ContextLengthExceeded), before any event
    2. create the session (new) or claim it (continue): choose a drafter and a verifier, begin a new
       epoch in the store (compare-and-set: a second concurrent turn gets SessionBusy), append the
       turn's input at the committed length
    3. a background task (the turn outlives its client stream: a lost client resumes later) calls
       Drafter.Run and commits each RunEvent's tokens with append_tokens(position, epoch), then
       turns them into text (Detokenizer), cuts at stop sequences (StopFilter) and queues a
       TokenDelta; the stream of the call reads that queue (TurnRunner)
    4. a drafter or verifier UNAVAILABLE mid-run: the failed service is dropped, a live pair is
       chosen, a new epoch begun, and Run called again from the committed tokens in the store. Only
       tokens the store accepted were streamed, so the client sees no gap and no repeat.
A resume (session_id without input) replays the committed tokens and follows the running turn by
polling the store, so it works on any gateway; it ends with the finish reason the store kept.

Leases: a running turn renews its session's lease (updated_unix_ms, stamped by the store's clock) every
turn_lease_s / 3 (keep_lease). A RUNNING session whose lease is older than turn_lease_s on the store's clock lost
its gateway: a resume takes it over, and so does every gateway's OrphanSweeper (every orphan_sweep_s), so an
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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig
from gateway.directory import Channels, ServiceDirectory
from gateway.errors import ContextLengthExceeded, Overloaded, RequestError, SessionBusy, StoreUnavailable, TurnFailed
from gateway.requests import (
    InputReader,
    check_context_length,
    check_request,
    check_session_id,
    default_params,
    finish_reason_name,
    finish_reason_value,
    merge_params,
    params_to_proto,
    session_to_proto,
    validate_params,
)
from gateway.store.calls import StoreCalls
from gateway.store.session import SessionConflict, SessionNotFound, SessionRecord, SessionStatus, SessionStore
from gateway.text import Detokenizer, StopFilter
from rsd.constraint import Constraint
from rsd_runtime.constraint import AutomatonCache
from rsd_service import security
from rsd_service.registry import ServiceInfo
from rsd_wire import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2

log = logging.getLogger("rsd.gateway")


# ---------------------------------------------------------------------------------------------
# Turns: one turn's state, and its runs (Drafter.Run until the turn ends, commits, failovers)


@dataclass
class Turn:
    """A turn this gateway runs: its session, params, current run (epoch, drafter, verifier) and event queue."""

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
class Progress:
    """What a turn has committed and streamed so far, across its runs."""

    position: int  # the committed length
    detok: Detokenizer
    stops: StopFilter
    num_steps: int = 0


class TurnRunner:
    """Runs turns against the store and the services; the engine owns the turns, this their runs."""

    def __init__(
        self,
        config: GatewayConfig,
        store: SessionStore,
        store_calls: StoreCalls,
        services: ServiceDirectory,
        channels: Channels,
        tokenizer: Any,
        eos_token_ids: list[int],
    ):
        self.config, self.store, self._store = config, store, store_calls
        self.services, self.channels = services, channels
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids

    async def run_in_time(self, turn: Turn) -> tuple[int, int, int]:
        """The turn's runs within request_timeout_s; past it the run is cancelled (closing the Run stream stops the
        drafter) and the turn fails DEADLINE_EXCEEDED. What it committed stays in the session."""
        timeout_s = self.config.request_timeout_s
        try:
            return await asyncio.wait_for(self._run_turn(turn), timeout_s or None)
        except TimeoutError:
            raise TurnFailed(
                f"turn exceeded request_timeout_s={timeout_s:g}; its committed tokens are kept in the session",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None

    async def _run_turn(self, turn: Turn) -> tuple[int, int, int]:
        """-> (finish reason, committed length, steps). Calls Run until the turn ends, failing over."""
        committed = await self._store(self.store.get_tokens, turn.session_id)
        state = Progress(
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

    async def _run_once(self, turn: Turn, state: Progress, committed: list[int], remaining: int) -> int:
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
            output_start_position=turn.turn_start,  # the penalties count the turn's output from there
        )
        call = self.channels.drafter(turn.drafter.address).Run(run)
        try:
            async for event in call:
                if event.epoch != turn.epoch:
                    raise TurnFailed(f"drafter sent epoch {event.epoch} in a run of epoch {turn.epoch}")
                final = event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                await self._commit_step(turn, state, event, final)
                if state.stops.stopped:
                    await self.cancel_run(turn.drafter.address, turn.session_id, turn.epoch)
                    return common_pb2.FINISH_REASON_STOP_SEQUENCE
                if turn.cancelled:  # also when the drafter missed the Cancel (it came before the run started)
                    if not final:
                        await self.cancel_run(turn.drafter.address, turn.session_id, turn.epoch)
                    return common_pb2.FINISH_REASON_CANCELLED
                if final:
                    return event.finish_reason
            raise TurnFailed("drafter ended the run without a final event", grpc.StatusCode.UNAVAILABLE)
        finally:
            call.cancel()  # no-op once the call has ended

    async def _commit_step(self, turn: Turn, state: Progress, event: drafter_pb2.RunEvent, final: bool) -> None:
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
        if event.HasField("logprobs"):
            delta.logprobs.CopyFrom(event.logprobs)
        await turn.events.put(gateway_pb2.GenerateEvent(session_id=turn.session_id, delta=delta))

    async def _landed(self, turn: Turn, position: int, ids: list[int], conflict: SessionConflict) -> int:
        """An append refused: it may have landed before Redis went away (a retried call), else the turn lost
        the session to a newer epoch (another gateway took it over): ABORTED, the client resumes."""
        same_run = conflict.epoch == turn.epoch and conflict.committed_length == position + len(ids)
        if same_run and await self._store(self.store.get_tokens, turn.session_id, position) == ids:
            return position + len(ids)
        raise TurnFailed(f"session {turn.session_id!r} moved on without this turn: {conflict}", grpc.StatusCode.ABORTED)

    async def _failover(self, turn: Turn, position: int) -> None:
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
        turn.drafter, turn.verifier = await self.services.pick_pair(
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

    async def cancel_run(self, drafter_address: str, session_id: str, epoch: int) -> bool:
        """Ask the drafter to stop the session's run of `epoch`; -> whether it was running."""
        try:
            reply = await self.channels.drafter(drafter_address).Cancel(
                drafter_pb2.CancelRunRequest(session_id=session_id, epoch=epoch), timeout=5.0
            )
        except grpc.aio.AioRpcError as e:
            log.warning("session %s: drafter Cancel failed: %s", session_id, e.details())
            return False
        return reply.was_running

    async def release(self, verifier: ServiceInfo, session_id: str, epoch: int) -> None:
        try:
            await self.channels.verifier(verifier.address).Release(
                verifier_pb2.ReleaseRequest(session_id=session_id, epoch=epoch), timeout=5.0
            )
        except grpc.aio.AioRpcError as e:
            log.warning("session %s: verifier Release failed: %s", session_id, e.details())


# ---------------------------------------------------------------------------------------------
# Leases: a running turn keeps its session; a turn whose gateway died is taken over


def lease_expired(record: SessionRecord, lease_s: float, now_ms: int) -> bool:
    """No gateway has refreshed the session's running turn for lease_s (GatewayConfig.turn_lease_s), by the
    store's clock: now_ms is store.now_ms(), the clock that stamped updated_unix_ms."""
    return now_ms - record.updated_unix_ms > lease_s * 1000


async def keep_lease(store: SessionStore, turn: Turn, lease_s: float) -> None:
    """Touch the session (updated_unix_ms) while the turn runs: the lease other gateways check."""
    while True:
        await asyncio.sleep(lease_s / 3)
        try:
            await asyncio.to_thread(store.update_session, turn.session_id, epoch=turn.epoch)
        except SessionConflict:
            return  # the epoch moved on: a failover of this turn renews with the new one, or we lost it
        except Exception as e:  # the store is away for a moment; the next beat retries
            log.warning("session %s: lease refresh failed: %s", turn.session_id, e)


class OrphanSweeper:
    """Takes over (take_over) every RUNNING turn of another gateway whose lease expired, every orphan_sweep_s."""

    def __init__(
        self,
        config: GatewayConfig,
        store: SessionStore,
        store_calls: StoreCalls,
        running: Mapping[str, Turn],  # this gateway's running turns by session id
        take_over: Callable[[SessionRecord], Awaitable[None]],
    ):
        self.config, self.store, self._store = config, store, store_calls
        self.running, self.take_over = running, take_over
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start sweeping (every orphan_sweep_s; 0 = off). Call on the server's event loop."""
        if self.config.orphan_sweep_s and self._task is None:
            self._task = asyncio.create_task(self._sweep_forever(), name="orphan-sweep")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.orphan_sweep_s)
            try:
                await self.sweep()
            except Exception as e:  # the store is away for a moment: the next sweep retries
                log.warning("orphan sweep failed: %s", e)

    async def sweep(self) -> list[str]:
        """Take over every RUNNING turn of another gateway whose lease expired (on the store's clock), so it
        finishes without a client; fail it when no drafter or verifier is live. -> the sessions handled."""
        handled = []
        now_ms = await self._store(self.store.now_ms)
        for session_id in await self._store(self.store.running_sessions):
            if session_id in self.running or len(self.running) >= self.config.max_running_turns:
                continue
            try:
                record = await self._store(self.store.get_session, session_id)
            except SessionNotFound:
                continue
            if record.status != SessionStatus.RUNNING or not lease_expired(record, self.config.turn_lease_s, now_ms):
                continue
            try:
                await self.take_over(record)
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


# ---------------------------------------------------------------------------------------------
# The engine


class GatewayEngine:
    """Generate / Cancel / GetSession over a SessionStore and the drafter / verifier services."""

    def __init__(self, config: GatewayConfig, store: SessionStore, tokenizer: Any):
        self.config, self.store, self.tokenizer = config, store, tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = [i for i in [tokenizer.eos_token_id] if i is not None]
        self.chat = ChatTemplate(tokenizer)
        self.automata = AutomatonCache(lambda: tokenizer)  # structured output (params.constraint)
        self.inputs = InputReader(config, tokenizer, self.chat)
        self.services = ServiceDirectory(store, config)
        self.channels = Channels(security.peer_security(config))
        self._store = StoreCalls(config.store_retry_s)
        self.runner = TurnRunner(
            config, store, self._store, self.services, self.channels, tokenizer, self.eos_token_ids
        )
        self._turns: dict[str, Turn] = {}
        self.sweeper = OrphanSweeper(config, store, self._store, self._turns, self.take_over)

    # -- Generate ------------------------------------------------------------------------------

    async def generate(
        self, request: gateway_pb2.GenerateRequest, beside: str = ""
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        """The turn's events. beside: a running session of this gateway (n choices of one prompt) whose drafter and
        verifier a new session takes while they have room, so the verifier computes the prompt's K/V once for all
        (verifier_service.engine: shared prefixes); the tokens are the same on any verifier."""
        check_request(request)
        if request.session_id and request.WhichOneof("input") is None:
            async for event in self._resume(request):
                yield event
            return
        turn, started = await self._start_turn(request, beside)
        yield started
        while True:
            event = await turn.events.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if event.WhichOneof("event") == "finished":
                return

    async def _check_constraint(self, params: dict[str, Any]) -> None:
        """Compile the turn's constraint here (cached; seconds the first time: off the event loop), so a bad
        regex or schema is refused before anything is stored; the constrained text ends at the automaton's EOS."""
        try:
            await asyncio.to_thread(self.automata.get, Constraint(*params["constraint"]))
        except ValueError as e:
            raise RequestError(f"params.constraint: {e}", "params.constraint") from None
        if self.tokenizer.eos_token_id not in params["eos_token_ids"]:
            params["eos_token_ids"] = [*params["eos_token_ids"], self.tokenizer.eos_token_id]

    async def _start_turn(
        self, request: gateway_pb2.GenerateRequest, beside: str = ""
    ) -> tuple[Turn, gateway_pb2.GenerateEvent]:
        if len(self._turns) >= self.config.max_running_turns:
            raise Overloaded(f"{len(self._turns)} turns are running on this gateway (max_running_turns)")
        input_ids = await asyncio.to_thread(self.inputs.token_ids, request)  # a long text: off the event loop
        msg_params = request.params if request.HasField("params") else None
        if request.session_id:
            record = await self._store(self.store.get_session, request.session_id)
            running = record.status == SessionStatus.RUNNING and not lease_expired(
                record, self.config.turn_lease_s, await self._store(self.store.now_ms)
            )
            if running or request.session_id in self._turns:  # an expired lease: its gateway died, go on
                raise SessionBusy(f"session {request.session_id!r} is already generating")
            params = merge_params(record.params, msg_params)
        else:
            params = merge_params(default_params(self.config), msg_params)
            record = None
        validate_params(params, self.config, self.inputs.vocab_size)
        chat = request.WhichOneof("input") == "messages"  # a chat turn also ends at the template's end of turn
        params["eos_token_ids"] = self.chat.end_of_turn_ids if chat else self.eos_token_ids
        if params.get("constraint"):
            await self._check_constraint(params)
        if params.get("seed") is None:
            params["seed"] = secrets.randbits(63)
        committed_before = 0 if record is None else record.committed_length
        params["turn_start"] = committed_before + len(input_ids)  # for a gateway that takes the turn over
        total = committed_before + len(input_ids) + params["max_new_tokens"]
        if total > self.config.max_session_tokens:
            raise ContextLengthExceeded(
                f"session would reach {total} tokens, more than max_session_tokens {self.config.max_session_tokens}"
            )
        if record is None and beside in self._turns:  # a choice of n: beside the first one, where it has room
            first = self._turns[beside]
            pair = (first.verifier.service_id, first.drafter.service_id)
            drafter, verifier = await self.services.pick_pair(*pair, spare_only=True)
        else:
            drafter, verifier = await self.services.pick_pair("" if record is None else record.kv.verifier_id)
        check_context_length(committed_before + len(input_ids), params, (drafter, verifier))  # nothing stored yet
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
        turn = Turn(record.session_id, params, committed_before + len(input_ids), epoch, drafter, verifier)
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

    async def _drive(self, turn: Turn) -> None:
        """The turn, in the background: runs, failovers, the final status; events go to turn.events. The final
        status is written before the last event goes out, so a client that has seen the end reads it too."""
        t0 = time.perf_counter()  # the caller holds turn.drafter and turn.verifier (ServiceDirectory.hold)
        status, reason = SessionStatus.FAILED, common_pb2.FINISH_REASON_UNSPECIFIED
        last: gateway_pb2.GenerateEvent | BaseException | None = None
        lease = asyncio.create_task(
            keep_lease(self.store, turn, self.config.turn_lease_s), name=f"lease-{turn.session_id}"
        )
        try:
            reason, position, num_steps = await self.runner.run_in_time(turn)
            status = SessionStatus.CANCELLED if reason == common_pb2.FINISH_REASON_CANCELLED else SessionStatus.FINISHED
            last = gateway_pb2.GenerateEvent(
                session_id=turn.session_id,
                finished=gateway_pb2.GenerationFinished(
                    reason=reason,
                    num_new_tokens=position - turn.turn_start,
                    committed_length_tokens=position,
                    num_steps=num_steps,
                    elapsed_ms=(time.perf_counter() - t0) * 1000,
                ),
            )
        except BaseException as e:
            log.warning("session %s turn failed: %s", turn.session_id, e)
            if isinstance(e, SessionConflict):  # a newer epoch began elsewhere (a takeover)
                e = TurnFailed(f"session {turn.session_id!r} moved on without this turn: {e}", grpc.StatusCode.ABORTED)
            last = e
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            lease.cancel()
            self.services.hold((turn.drafter, turn.verifier), -1)
            self._turns.pop(turn.session_id, None)
            try:
                with contextlib.suppress(SessionConflict, SessionNotFound):
                    await self._store(
                        self.store.update_session,
                        turn.session_id,
                        status=status,
                        finish_reason=finish_reason_name(reason) if reason else "",
                        epoch=turn.epoch,
                    )
            finally:  # the client hears the end even when the store is down
                if last is not None:
                    await turn.events.put(last)
            if status == SessionStatus.CANCELLED:
                await self.runner.release(turn.verifier, turn.session_id, turn.epoch)

    # -- orphaned turns ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the orphan sweep (every orphan_sweep_s; 0 = off). Call on the server's event loop."""
        self.sweeper.start()

    async def sweep_orphans(self) -> list[str]:
        """One sweep now (OrphanSweeper.sweep): -> the orphaned sessions taken over or failed."""
        return await self.sweeper.sweep()

    async def take_over(self, record: SessionRecord) -> None:
        """Continue a RUNNING turn whose gateway stopped refreshing its lease: a new epoch (compare-and-set, so
        one gateway wins; the old run's late writes are refused) and a run from the committed tokens."""
        params = dict(record.params)
        drafter, verifier = await self.services.pick_pair(record.kv.verifier_id, record.drafter_id)
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
        turn = Turn(record.session_id, params, turn_start, epoch, drafter, verifier)
        self._turns[turn.session_id] = turn
        turn.task = asyncio.create_task(self._drive(turn), name=f"turn-{turn.session_id}")
        log.warning("session %s: took over a turn with a stale lease, epoch %d", turn.session_id, epoch)

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
            orphaned = record.status == SessionStatus.RUNNING and lease_expired(
                record, self.config.turn_lease_s, await self._store(self.store.now_ms)
            )
            if orphaned and record.session_id not in self._turns:  # its gateway died: continue the turn here
                await self.take_over(record)
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
        check_session_id(session_id)
        record = await self._store(self.store.get_session, session_id)
        turn = self._turns.get(session_id)
        was_running = record.status == SessionStatus.RUNNING
        if turn is not None:
            turn.cancelled = True
            await self.runner.cancel_run(turn.drafter.address, turn.session_id, turn.epoch)
        elif was_running and record.drafter_id:  # the turn runs on another gateway: stop its drafter run
            address = await self.services.address("drafter", record.drafter_id)
            if address is not None:
                await self.runner.cancel_run(address, session_id, record.epoch)
        return gateway_pb2.CancelResponse(was_running=was_running, committed_length_tokens=record.committed_length)

    async def get_session(self, session_id: str, include_token_ids: bool) -> gateway_pb2.Session:
        check_session_id(session_id)
        record = await self._store(self.store.get_session, session_id)
        return session_to_proto(record, include_token_ids)

    async def max_model_len(self) -> int:
        """The longest sequence a turn may grow to: max_session_tokens, or the smallest max_len the live services
        advertise (a turn also needs room for one draft tree in it: check_context_length)."""
        lens = [s.max_len for role in ("drafter", "verifier") for s in await self.services.live(role) if s.max_len > 0]
        return min([self.config.max_session_tokens, *lens])

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
                await self.runner.cancel_run(turn.drafter.address, turn.session_id, turn.epoch)
            if pending:
                await asyncio.wait(pending, timeout=5.0)
            for task in pending:
                task.cancel()

    async def close(self) -> None:
        await self.sweeper.stop()
        await self.drain(0.0)
        await self.channels.close()

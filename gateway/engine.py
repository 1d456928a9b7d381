"""The gateway's session logic, without the gRPC server around it: GatewayEngine composes the parts.

    gateway.errors       the errors (each an rsd_service.status kind)
    gateway.requests     a request's checks and its input as token ids
    gateway.text         Detokenizer, StopFilter
    gateway.params       params (defaults, merge, validation, protos), finish reason names
    gateway.directory    ServiceDirectory (who runs drafters and verifiers), Channels, DrafterClient
    gateway.store_calls  StoreCalls: the synchronous SessionStore from asyncio, retried through outages
    gateway.turns        Turn, TurnRunner: one turn's runs, commits and failovers
    gateway.leases       lease_expired, keep_lease, OrphanSweeper

One Generate call ("a turn"):
    1. validate the request (RequestError names the field), tokenize its input; refuse a turn longer than
       max_session_tokens or than the picked services' max_len (ContextLengthExceeded), before any event
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

Leases (gateway.leases): a running turn renews its session's lease; a turn whose gateway died is taken over by a
resume or by any gateway's orphan sweep.

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
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig
from gateway.directory import Channels, ServiceDirectory
from gateway.errors import ContextLengthExceeded, Overloaded, RequestError, SessionBusy, TurnFailed
from gateway.leases import OrphanSweeper, keep_lease, lease_expired
from gateway.params import (
    check_context_length,
    default_params,
    finish_reason_name,
    finish_reason_value,
    merge_params,
    params_to_proto,
    session_to_proto,
    validate_params,
)
from gateway.requests import InputReader, check_request, check_session_id
from gateway.session import SessionConflict, SessionNotFound, SessionRecord, SessionStatus, SessionStore
from gateway.store_calls import StoreCalls
from gateway.text import Detokenizer
from gateway.turns import Turn, TurnRunner
from rsd_service import security
from rsd_wire import common_pb2, gateway_pb2

log = logging.getLogger("rsd.gateway")


class GatewayEngine:
    """Generate / Cancel / GetSession over a SessionStore and the drafter / verifier services."""

    def __init__(self, config: GatewayConfig, store: SessionStore, tokenizer: Any):
        self.config, self.store, self.tokenizer = config, store, tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = [i for i in [tokenizer.eos_token_id] if i is not None]
        self.chat = ChatTemplate(tokenizer)
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

    async def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        check_request(request)
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

    async def _start_turn(self, request: gateway_pb2.GenerateRequest) -> tuple[Turn, gateway_pb2.GenerateEvent]:
        if len(self._turns) >= self.config.max_running_turns:
            raise Overloaded(f"{len(self._turns)} turns are running on this gateway (max_running_turns)")
        input_ids = self.inputs.token_ids(request)
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
        validate_params(params, self.config)
        chat = request.WhichOneof("input") == "messages"  # a chat turn also ends at the template's end of turn
        params["eos_token_ids"] = self.chat.end_of_turn_ids if chat else self.eos_token_ids
        if params.get("seed") is None:
            params["seed"] = secrets.randbits(63)
        committed_before = 0 if record is None else record.committed_length
        params["turn_start"] = committed_before + len(input_ids)  # for a gateway that takes the turn over
        total = committed_before + len(input_ids) + params["max_new_tokens"]
        if total > self.config.max_session_tokens:
            raise ContextLengthExceeded(
                f"session would reach {total} tokens, more than max_session_tokens {self.config.max_session_tokens}"
            )
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
        """The turn, in the background: runs, failovers, the final status; events go to turn.events."""
        t0 = time.perf_counter()  # the caller holds turn.drafter and turn.verifier (ServiceDirectory.hold)
        status, reason = SessionStatus.FAILED, common_pb2.FINISH_REASON_UNSPECIFIED
        lease = asyncio.create_task(
            keep_lease(self.store, turn, self.config.turn_lease_s), name=f"lease-{turn.session_id}"
        )
        try:
            reason, position, num_steps = await self.runner.run_in_time(turn)
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
                await self.runner.release(turn.verifier, turn.session_id, turn.epoch)

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

    # -- orphaned turns ------------------------------------------------------------------------

    # -- orphaned turns ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the orphan sweep (every orphan_sweep_s; 0 = off). Call on the server's event loop."""
        self.sweeper.start()

    async def sweep_orphans(self) -> list[str]:
        """One sweep now (OrphanSweeper.sweep): -> the orphaned sessions taken over or failed."""
        return await self.sweeper.sweep()

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

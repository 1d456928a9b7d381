"""One turn's runs: Drafter.Run until the turn ends, each step committed to the store and streamed, failing over
to a live drafter / verifier pair when one of them goes away (see gateway.engine for the whole turn)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway.config import GatewayConfig
from gateway.directory import Channels, ServiceDirectory
from gateway.errors import StoreUnavailable, TurnFailed
from gateway.params import params_to_proto
from gateway.session import SessionConflict, SessionStore
from gateway.store_calls import StoreCalls
from gateway.text import Detokenizer, StopFilter
from rsd_service.registry import ServiceInfo
from rsd_wire import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2

log = logging.getLogger("rsd.gateway")


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

    # -- resume --------------------------------------------------------------------------------

"""Turn leases: a running turn renews its session's lease (updated_unix_ms, stamped by the store's clock) every
turn_lease_s / 3 (keep_lease). A RUNNING session whose lease is older than turn_lease_s on the store's clock lost
its gateway: a resume takes it over, and so does every gateway's OrphanSweeper (every orphan_sweep_s), so an
orphaned turn finishes (or fails, when no drafter / verifier is live) even if no client comes back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

from gateway.config import GatewayConfig
from gateway.errors import Overloaded
from gateway.session import SessionConflict, SessionNotFound, SessionRecord, SessionStatus, SessionStore
from gateway.store_calls import StoreCalls
from gateway.turns import Turn

log = logging.getLogger("rsd.gateway")


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

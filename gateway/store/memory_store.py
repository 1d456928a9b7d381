"""MemorySessionStore: the SessionStore (gateway.store.session) inside one process, with the same semantics as
RedisSessionStore (TTLs included): the embedded default of a single-process run (no redis_url), and tests. It is
a service registry too (rsd_service.registry), as the Redis store is."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.store.session import (
    KvLocation,
    SessionConflict,
    SessionExists,
    SessionNotFound,
    SessionRecord,
    SessionStatus,
    append_refused,
    check_count,
    check_finish_reason,
    check_tokens,
    encode_params,
    epoch_refused,
)
from rsd_service.registry import MemoryServiceRegistry, check_id


@dataclass
class _Session:
    record: SessionRecord
    params_json: str
    expires_at: float  # on the store's clock


class MemorySessionStore(MemoryServiceRegistry):
    """SessionStore in this process's memory, same semantics as RedisSessionStore (TTLs included).
    For a single-process run only: nothing is shared or survives the process."""

    def __init__(self, session_ttl_s: float = 24 * 3600.0, clock: Callable[[], float] = time.time):
        """clock: the store's one clock in unix seconds: stamps, now_ms and TTLs (tests pass a fake one)."""
        if session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be > 0, got {session_ttl_s}")
        super().__init__(clock)
        self.session_ttl_s = session_ttl_s
        self._sessions: dict[str, _Session] = {}

    def _live(self, session_id: str) -> _Session:
        """The live session (lock held), expired ones dropped."""
        check_id("session_id", session_id)
        entry = self._sessions.get(session_id)
        if entry is not None and entry.expires_at <= self.clock():
            del self._sessions[session_id]
            entry = None
        if entry is None:
            raise SessionNotFound(session_id)
        return entry

    def _write(self, entry: _Session, **changes: Any) -> None:
        entry.record = replace(entry.record, updated_unix_ms=self.now_ms(), **changes)
        entry.expires_at = self.clock() + self.session_ttl_s

    def _conflict(self, entry: _Session, reason: str) -> SessionConflict:
        record = entry.record
        return SessionConflict(record.session_id, reason, record.committed_length, record.epoch)

    def create_session(self, session_id: str, prompt_ids: Sequence[int], params: Mapping[str, Any]) -> SessionRecord:
        prompt = tuple(check_tokens(prompt_ids, "prompt_ids"))
        params_json = encode_params(params)
        with self._lock:
            try:
                self._live(session_id)
            except SessionNotFound:
                pass
            else:
                raise SessionExists(session_id)
            now = self.now_ms()
            record = SessionRecord(
                session_id,
                prompt,
                prompt,
                json.loads(params_json),
                SessionStatus.PENDING,
                "",
                "",
                KvLocation(),
                now,
                now,
            )
            self._sessions[session_id] = _Session(record, params_json, self.clock() + self.session_ttl_s)
            return record

    def get_session(self, session_id: str) -> SessionRecord:
        with self._lock:
            entry = self._live(session_id)
            return replace(entry.record, params=json.loads(entry.params_json))  # a copy the caller may mutate

    def get_tokens(self, session_id: str, start: int = 0) -> list[int]:
        start = check_count("start", start)
        with self._lock:
            return list(self._live(session_id).record.committed_ids[start:])

    def append_tokens(self, session_id: str, position: int, tokens: Sequence[int], epoch: int) -> int:
        tokens = check_tokens(tokens, "tokens")
        position, epoch = check_count("position", position), check_count("epoch", epoch)
        with self._lock:
            entry = self._live(session_id)
            record = entry.record
            if record.epoch != epoch or record.committed_length != position:
                raise self._conflict(entry, append_refused(position, epoch))
            self._write(entry, committed_ids=record.committed_ids + tuple(tokens))
            return entry.record.committed_length

    def begin_epoch(self, session_id: str, expected_epoch: int, drafter_id: str, verifier_id: str) -> int:
        check_id("drafter_id", drafter_id)
        check_id("verifier_id", verifier_id)
        expected_epoch = check_count("expected_epoch", expected_epoch)
        with self._lock:
            entry = self._live(session_id)
            kv = entry.record.kv
            if kv.epoch != expected_epoch:
                raise self._conflict(entry, epoch_refused(expected_epoch))
            length = kv.length if kv.verifier_id == verifier_id else 0
            self._write(
                entry,
                status=SessionStatus.RUNNING,
                drafter_id=drafter_id,
                verifier_id=verifier_id,
                kv=KvLocation(verifier_id, length, kv.epoch + 1),
                finish_reason="",
            )
            return kv.epoch + 1

    def set_kv_length(self, session_id: str, epoch: int, length: int) -> None:
        epoch, length = check_count("epoch", epoch), check_count("length", length)
        with self._lock:
            entry = self._live(session_id)
            if entry.record.epoch != epoch:
                raise self._conflict(entry, epoch_refused(epoch))
            self._write(entry, kv=replace(entry.record.kv, length=length))

    def update_session(
        self,
        session_id: str,
        *,
        status: SessionStatus | None = None,
        params: Mapping[str, Any] | None = None,
        epoch: int | None = None,
        finish_reason: str | None = None,
    ) -> None:
        changes: dict[str, Any] = {}
        if status is not None:
            changes["status"] = SessionStatus(status)
        if finish_reason is not None:
            changes["finish_reason"] = check_finish_reason(finish_reason)
        params_json = None if params is None else encode_params(params)
        if epoch is not None:
            epoch = check_count("epoch", epoch)
        with self._lock:
            entry = self._live(session_id)
            if epoch is not None and entry.record.epoch != epoch:
                raise self._conflict(entry, epoch_refused(epoch))
            if params_json is not None:
                entry.params_json = params_json
                changes["params"] = json.loads(params_json)
            self._write(entry, **changes)

    def delete_session(self, session_id: str) -> bool:
        with self._lock:
            try:
                self._live(session_id)
            except SessionNotFound:
                return False
            del self._sessions[session_id]
            return True

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def running_sessions(self) -> list[str]:
        now = self.clock()
        with self._lock:
            return sorted(
                sid
                for sid, entry in self._sessions.items()
                if entry.expires_at > now and entry.record.status == SessionStatus.RUNNING
            )

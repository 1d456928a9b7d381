"""Session state as the gateway sees it: the record types, the `SessionStore` protocol both backends
satisfy (gateway.redis_store, gateway.memory_store) and the errors they raise. See gateway.store for the
semantics (epochs, compare-and-set appends, the store's clock)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from rsd_service.registry import ServiceRegistry
from rsd_service.status import NotFound


class SessionStatus(StrEnum):
    PENDING = "pending"  # created, no run yet
    RUNNING = "running"  # a turn is generating
    FINISHED = "finished"  # the last turn ended
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class KvLocation:
    verifier_id: str = ""
    length: int = 0  # tokens of the committed sequence whose K/V the verifier holds, as last reported
    epoch: int = 0


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    prompt_ids: tuple[int, ...]
    committed_ids: tuple[int, ...]  # the whole sequence, prompt included
    params: Mapping[str, Any]
    status: SessionStatus
    drafter_id: str
    verifier_id: str
    kv: KvLocation
    created_unix_ms: int  # the store's clock
    updated_unix_ms: int  # the store's clock; a running turn's lease (every write renews it)
    finish_reason: str = ""  # why the last turn ended ("length", "eos", ...; the gateway's names); "" = not yet

    @property
    def epoch(self) -> int:
        return self.kv.epoch

    @property
    def committed_length(self) -> int:
        return len(self.committed_ids)


class StoreError(Exception):
    pass


class SessionNotFound(StoreError, NotFound):
    def __init__(self, session_id: str):
        super().__init__(f"session {session_id!r} not found (never created, deleted or expired)")
        self.session_id = session_id


class SessionExists(StoreError):
    def __init__(self, session_id: str):
        super().__init__(f"session {session_id!r} already exists")
        self.session_id = session_id


class SessionConflict(StoreError):
    """A write expected a committed length or epoch the session no longer has."""

    def __init__(self, session_id: str, reason: str, committed_length: int, epoch: int):
        super().__init__(f"session {session_id!r}: {reason} (committed length {committed_length}, epoch {epoch})")
        self.session_id, self.committed_length, self.epoch = session_id, committed_length, epoch


class SessionStore(ServiceRegistry, Protocol):
    def create_session(self, session_id: str, prompt_ids: Sequence[int], params: Mapping[str, Any]) -> SessionRecord:
        """A new PENDING session at epoch 0 whose committed sequence is the prompt. SessionExists if taken."""
        ...

    def get_session(self, session_id: str) -> SessionRecord: ...

    def get_tokens(self, session_id: str, start: int = 0) -> list[int]:
        """committed_ids[start:]."""
        ...

    def append_tokens(self, session_id: str, position: int, tokens: Sequence[int], epoch: int) -> int:
        """Commit `tokens` at absolute positions position, position + 1, ... iff the committed length
        is `position` and the epoch is `epoch`; else SessionConflict. Returns the new length."""
        ...

    def begin_epoch(self, session_id: str, expected_epoch: int, drafter_id: str, verifier_id: str) -> int:
        """Start a new run iff the epoch is `expected_epoch` (else SessionConflict): epoch + 1, status
        RUNNING, no finish reason, the run's drafter and verifier, KV location on that verifier (length kept if it is
        the same verifier, else 0). Returns the new epoch."""
        ...

    def set_kv_length(self, session_id: str, epoch: int, length: int) -> None:
        """Record the KV length the verifier reported, iff the epoch is current."""
        ...

    def update_session(
        self,
        session_id: str,
        *,
        status: SessionStatus | None = None,
        params: Mapping[str, Any] | None = None,
        epoch: int | None = None,
        finish_reason: str | None = None,
    ) -> None:
        """Set the given fields; with `epoch`, only if it is current (else SessionConflict). Any write renews
        updated_unix_ms."""
        ...

    def delete_session(self, session_id: str) -> bool: ...

    def now_ms(self) -> int:
        """The store's clock (unix ms): the one updated_unix_ms is stamped with."""
        ...

    def running_sessions(self) -> list[str]:
        """Ids of the sessions whose status is RUNNING, sorted."""
        ...

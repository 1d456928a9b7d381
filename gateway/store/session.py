"""A session as the gateway keeps it: the record types, the `SessionStore` protocol both backends satisfy
(gateway.store.redis_store, gateway.store.memory_store), the errors they raise, and the checks and encoding they
share, so both refuse the same inputs with the same messages and give back the same (JSON) params.

A session (SessionRecord) is its first prompt, the committed sequence (prompt, later turns and
generated tokens: the token at absolute position t is committed_ids[t]), the generation params
(an opaque JSON object to the store), a status, why its last turn finished, the drafter and verifier
of its current run, and the KV location {verifier_id, length, epoch}.

The epoch names the current run. begin_epoch() starts a new run (a new drafter/verifier pair,
e.g. after a failure) by compare-and-set on the epoch; every later write of the old run is
refused. append_tokens(position, epoch) commits only when `position` is the committed length
and `epoch` is current, atomically, so a retried or late step can neither duplicate tokens nor
leave a gap: the caller gets SessionConflict with the stored length and epoch instead.

Clock: updated_unix_ms (the turn lease gateways compare) and created_unix_ms are stamped by the
store's own clock, and now_ms() reads that clock: Redis `TIME` (inside the scripts too), so the
gateways' wall clocks never meet; the in-memory store its `clock`, which a test can inject.

Every session expires session_ttl_s after its last write. A store is synchronous: from asyncio code call it
through gateway.store.calls.StoreCalls (a thread per call, retried through a Redis outage).
"""

from __future__ import annotations

import json
import re
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


# ---------------------------------------------------------------------------------------------
# Checks and encoding both stores share

MAX_TOKEN_ID = 2**32 - 1


def check_tokens(tokens: Sequence[int], what: str) -> list[int]:
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError(f"{what} must not be empty")
    bad = next((t for t in tokens if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise ValueError(f"{what}: token id {bad} is outside [0, 2**32)")
    return tokens


def check_count(name: str, value: int) -> int:
    if int(value) != value or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def encode_params(params: Mapping[str, Any]) -> str:
    """Both stores keep params as JSON text, so both give back the same (JSON) values."""
    return json.dumps(dict(params), sort_keys=True, separators=(",", ":"))


def append_refused(position: int, epoch: int) -> str:
    return f"append at position {position} in epoch {epoch} refused"


def epoch_refused(epoch: int | None) -> str:
    return f"write expecting epoch {epoch} refused"


def check_finish_reason(reason: str) -> str:
    if not isinstance(reason, str) or (reason and not re.fullmatch(r"[a-z_]{1,32}", reason)):
        raise ValueError(f"finish_reason must be 1-32 characters of [a-z_] or empty, got {reason!r}")
    return reason

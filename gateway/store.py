"""Session state: the `SessionStore` protocol and two implementations (each also a service registry,
rsd_service.registry, on the same Redis and namespace).

    RedisSessionStore   shared by every gateway; what it holds survives the death of any service
    MemorySessionStore  the same semantics inside one process (a single-process run, tests)

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

Redis layout, under a namespace (default "rsd"); ids are [A-Za-z0-9._-], so keys cannot collide:
    {ns}:session:{id}          hash: prompt_ids, params, status, finish_reason, drafter_id, verifier_id,
                               kv_verifier_id, kv_length, epoch, created_unix_ms, updated_unix_ms
    {ns}:session:{id}:tokens   string: the committed ids packed as little-endian uint32, so the
                               committed length is STRLEN / 4 and an append is one APPEND
    {ns}:service:{role}:{id}, {ns}:services:{role}: the registry's (rsd_service.registry)
    {ns}:running               set: hash keys of the RUNNING sessions (the gateways' orphan sweep reads
                               it), kept by the session scripts, pruned when listed
Every key has a TTL: a session's two keys get session_ttl_s again on every write (the running set
too, while it gains members); a service key its heartbeat's ttl_s. Each multi-step operation is one
Lua script, so it is atomic.

The store is synchronous (redis-py): from asyncio code call it through asyncio.to_thread.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol

import redis
from redis.commands.core import Script

from rsd_service.registry import MemoryServiceRegistry, RedisServiceRegistry, ServiceInfo, ServiceRegistry, check_id
from rsd_service.status import NotFound

__all__ = ["MemorySessionStore", "RedisSessionStore", "ServiceInfo", "SessionStore"]  # ServiceInfo: re-exported


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
# Validation and encoding shared by both stores

_MAX_TOKEN_ID = 2**32 - 1


def _check_tokens(tokens: Sequence[int], what: str) -> list[int]:
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError(f"{what} must not be empty")
    bad = next((t for t in tokens if not 0 <= t <= _MAX_TOKEN_ID), None)
    if bad is not None:
        raise ValueError(f"{what}: token id {bad} is outside [0, 2**32)")
    return tokens


def _check_count(name: str, value: int) -> int:
    if int(value) != value or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def _params_json(params: Mapping[str, Any]) -> str:
    """Both stores keep params as JSON text, so both give back the same (JSON) values."""
    return json.dumps(dict(params), sort_keys=True, separators=(",", ":"))


def _pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _unpack(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 4}I", data)


def _append_refused(position: int, epoch: int) -> str:
    return f"append at position {position} in epoch {epoch} refused"


def _epoch_refused(epoch: int | None) -> str:
    return f"write expecting epoch {epoch} refused"


def _check_finish_reason(reason: str) -> str:
    if not isinstance(reason, str) or (reason and not re.fullmatch(r"[a-z_]{1,32}", reason)):
        raise ValueError(f"finish_reason must be 1-32 characters of [a-z_] or empty, got {reason!r}")
    return reason


# ---------------------------------------------------------------------------------------------
# Redis

# The store's clock, in unix ms: Redis TIME (allowed before writes: Redis 7 replicates a script's effects).
_NOW_MS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# Every session script: KEYS = [hash, tokens, running set]; returns {code, committed_length, epoch}
# with code 1 = done, 0 = conflict, -1 = no such session. touch() renews the lease (updated_unix_ms)
# and the TTLs, and keeps the session's membership of the running set.
_SESSION_STATE = (
    _NOW_MS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0, 0} end
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch'))
local length = math.floor(redis.call('STRLEN', KEYS[2]) / 4)
local function touch(ttl_ms)
  redis.call('HSET', KEYS[1], 'updated_unix_ms', now_ms())
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
  redis.call('PEXPIRE', KEYS[2], ttl_ms)
  if redis.call('HGET', KEYS[1], 'status') == 'running' then
    redis.call('SADD', KEYS[3], KEYS[1])
    if redis.call('PTTL', KEYS[3]) < tonumber(ttl_ms) then redis.call('PEXPIRE', KEYS[3], ttl_ms) end
  else
    redis.call('SREM', KEYS[3], KEYS[1])
  end
end
"""
)

# ARGV: prompt (packed), params, status, ttl_ms
_CREATE = (
    _NOW_MS
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local now = now_ms()
redis.call('HSET', KEYS[1], 'prompt_ids', ARGV[1], 'params', ARGV[2], 'status', ARGV[3], 'finish_reason', '',
  'drafter_id', '', 'verifier_id', '', 'kv_verifier_id', '', 'kv_length', 0, 'epoch', 0,
  'created_unix_ms', now, 'updated_unix_ms', now)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4])
return 1
"""
)

# ARGV: position, epoch, tokens (packed), ttl_ms
_APPEND = (
    _SESSION_STATE
    + """
if epoch ~= tonumber(ARGV[2]) or length ~= tonumber(ARGV[1]) then return {0, length, epoch} end
redis.call('APPEND', KEYS[2], ARGV[3])
touch(ARGV[4])
return {1, length + math.floor(#ARGV[3] / 4), epoch}
"""
)

# ARGV: expected_epoch, drafter_id, verifier_id, running status, ttl_ms
_BEGIN_EPOCH = (
    _SESSION_STATE
    + """
if epoch ~= tonumber(ARGV[1]) then return {0, length, epoch} end
local kv_length = 0
if redis.call('HGET', KEYS[1], 'kv_verifier_id') == ARGV[3] then
  kv_length = redis.call('HGET', KEYS[1], 'kv_length')
end
redis.call('HSET', KEYS[1], 'epoch', epoch + 1, 'drafter_id', ARGV[2], 'verifier_id', ARGV[3],
  'kv_verifier_id', ARGV[3], 'kv_length', kv_length, 'status', ARGV[4], 'finish_reason', '')
touch(ARGV[5])
return {1, length, epoch + 1}
"""
)

# ARGV: epoch or '' (any), ttl_ms, then field, value pairs
_UPDATE = (
    _SESSION_STATE
    + """
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= epoch then return {0, length, epoch} end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
touch(ARGV[2])
return {1, length, epoch}
"""
)

# KEYS: [running set]. Its members (session hash keys) still RUNNING; drops the others (finished, expired).
_LIST_RUNNING = """
local out = {}
for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('HGET', key, 'status') == 'running' then
    table.insert(out, key)
  else
    redis.call('SREM', KEYS[1], key)
  end
end
return out
"""


class RedisSessionStore(RedisServiceRegistry):
    """SessionStore on one Redis server (standalone or a primary; scripts touch keys of one session,
    and the registry scripts a role's keys, so Redis Cluster is not supported)."""

    def __init__(self, client: redis.Redis, namespace: str = "rsd", session_ttl_s: float = 24 * 3600.0):
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("RedisSessionStore needs a client with decode_responses=False (tokens are binary)")
        if session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be > 0, got {session_ttl_s}")
        super().__init__(client, namespace)
        self.session_ttl_ms = max(1, round(session_ttl_s * 1000))
        self._create = client.register_script(_CREATE)
        self._append = client.register_script(_APPEND)
        self._begin_epoch = client.register_script(_BEGIN_EPOCH)
        self._update = client.register_script(_UPDATE)
        self._list_running = client.register_script(_LIST_RUNNING)
        self._running_key = f"{namespace}:running"

    @classmethod
    def from_url(cls, url: str, namespace: str = "rsd", session_ttl_s: float = 24 * 3600.0) -> RedisSessionStore:
        return cls(redis.Redis.from_url(url), namespace, session_ttl_s)

    def session_keys(self, session_id: str) -> list[str]:
        """[hash key, tokens key] of a session."""
        check_id("session_id", session_id)
        key = f"{self.namespace}:session:{session_id}"
        return [key, f"{key}:tokens"]

    def _run(self, script: Script, session_id: str, args: list[Any], refused: str) -> tuple[int, int]:
        """Run a session script; raise on a missing session or a conflict; return (length, epoch)."""
        code, length, epoch = script(keys=[*self.session_keys(session_id), self._running_key], args=args)
        if code == -1:
            raise SessionNotFound(session_id)
        if code == 0:
            raise SessionConflict(session_id, refused, length, epoch)
        return length, epoch

    def create_session(self, session_id: str, prompt_ids: Sequence[int], params: Mapping[str, Any]) -> SessionRecord:
        prompt = _check_tokens(prompt_ids, "prompt_ids")
        args = [_pack(prompt), _params_json(params), SessionStatus.PENDING.value, self.session_ttl_ms]
        if not self._create(keys=self.session_keys(session_id), args=args):
            raise SessionExists(session_id)
        return self.get_session(session_id)

    def get_session(self, session_id: str) -> SessionRecord:
        hash_key, tokens_key = self.session_keys(session_id)
        pipe = self.client.pipeline(transaction=True)
        fields, tokens = pipe.hgetall(hash_key).get(tokens_key).execute()
        if not fields:
            raise SessionNotFound(session_id)
        f = {k.decode(): v for k, v in fields.items()}
        return SessionRecord(
            session_id=session_id,
            prompt_ids=_unpack(f["prompt_ids"]),
            committed_ids=_unpack(tokens or b""),
            params=json.loads(f["params"]),
            status=SessionStatus(f["status"].decode()),
            drafter_id=f["drafter_id"].decode(),
            verifier_id=f["verifier_id"].decode(),
            kv=KvLocation(f["kv_verifier_id"].decode(), int(f["kv_length"]), int(f["epoch"])),
            created_unix_ms=int(f["created_unix_ms"]),
            updated_unix_ms=int(f["updated_unix_ms"]),
            finish_reason=f.get("finish_reason", b"").decode(),
        )

    def get_tokens(self, session_id: str, start: int = 0) -> list[int]:
        start = _check_count("start", start)
        hash_key, tokens_key = self.session_keys(session_id)
        pipe = self.client.pipeline(transaction=True)
        exists, data = pipe.exists(hash_key).getrange(tokens_key, 4 * start, -1).execute()
        if not exists:
            raise SessionNotFound(session_id)
        return list(_unpack(data))

    def append_tokens(self, session_id: str, position: int, tokens: Sequence[int], epoch: int) -> int:
        tokens = _check_tokens(tokens, "tokens")
        args = [_check_count("position", position), _check_count("epoch", epoch), _pack(tokens)]
        refused = _append_refused(position, epoch)
        return self._run(self._append, session_id, [*args, self.session_ttl_ms], refused)[0]

    def begin_epoch(self, session_id: str, expected_epoch: int, drafter_id: str, verifier_id: str) -> int:
        check_id("drafter_id", drafter_id)
        check_id("verifier_id", verifier_id)
        args = [_check_count("expected_epoch", expected_epoch), drafter_id, verifier_id, SessionStatus.RUNNING.value]
        refused = _epoch_refused(expected_epoch)
        return self._run(self._begin_epoch, session_id, [*args, self.session_ttl_ms], refused)[1]

    def set_kv_length(self, session_id: str, epoch: int, length: int) -> None:
        args = [_check_count("epoch", epoch), self.session_ttl_ms]
        self._run(self._update, session_id, [*args, "kv_length", _check_count("length", length)], _epoch_refused(epoch))

    def update_session(
        self,
        session_id: str,
        *,
        status: SessionStatus | None = None,
        params: Mapping[str, Any] | None = None,
        epoch: int | None = None,
        finish_reason: str | None = None,
    ) -> None:
        pairs: list[Any] = []
        if status is not None:
            pairs += ["status", SessionStatus(status).value]
        if params is not None:
            pairs += ["params", _params_json(params)]
        if finish_reason is not None:
            pairs += ["finish_reason", _check_finish_reason(finish_reason)]
        check = "" if epoch is None else _check_count("epoch", epoch)
        self._run(self._update, session_id, [check, self.session_ttl_ms, *pairs], _epoch_refused(epoch))

    def delete_session(self, session_id: str) -> bool:
        hash_key, tokens_key = self.session_keys(session_id)
        pipe = self.client.pipeline(transaction=True)
        deleted, _ = pipe.delete(hash_key, tokens_key).srem(self._running_key, hash_key).execute()
        return deleted > 0

    def now_ms(self) -> int:
        seconds, micros = self.client.time()
        return seconds * 1000 + micros // 1000

    def running_sessions(self) -> list[str]:
        prefix = f"{self.namespace}:session:"
        return sorted(key.decode().removeprefix(prefix) for key in self._list_running(keys=[self._running_key]))


# ---------------------------------------------------------------------------------------------
# In memory


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
        prompt = tuple(_check_tokens(prompt_ids, "prompt_ids"))
        params_json = _params_json(params)
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
        start = _check_count("start", start)
        with self._lock:
            return list(self._live(session_id).record.committed_ids[start:])

    def append_tokens(self, session_id: str, position: int, tokens: Sequence[int], epoch: int) -> int:
        tokens = _check_tokens(tokens, "tokens")
        position, epoch = _check_count("position", position), _check_count("epoch", epoch)
        with self._lock:
            entry = self._live(session_id)
            record = entry.record
            if record.epoch != epoch or record.committed_length != position:
                raise self._conflict(entry, _append_refused(position, epoch))
            self._write(entry, committed_ids=record.committed_ids + tuple(tokens))
            return entry.record.committed_length

    def begin_epoch(self, session_id: str, expected_epoch: int, drafter_id: str, verifier_id: str) -> int:
        check_id("drafter_id", drafter_id)
        check_id("verifier_id", verifier_id)
        expected_epoch = _check_count("expected_epoch", expected_epoch)
        with self._lock:
            entry = self._live(session_id)
            kv = entry.record.kv
            if kv.epoch != expected_epoch:
                raise self._conflict(entry, _epoch_refused(expected_epoch))
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
        epoch, length = _check_count("epoch", epoch), _check_count("length", length)
        with self._lock:
            entry = self._live(session_id)
            if entry.record.epoch != epoch:
                raise self._conflict(entry, _epoch_refused(epoch))
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
            changes["finish_reason"] = _check_finish_reason(finish_reason)
        params_json = None if params is None else _params_json(params)
        if epoch is not None:
            epoch = _check_count("epoch", epoch)
        with self._lock:
            entry = self._live(session_id)
            if epoch is not None and entry.record.epoch != epoch:
                raise self._conflict(entry, _epoch_refused(epoch))
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

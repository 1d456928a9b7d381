"""RedisSessionStore: the SessionStore (gateway.store.session) on one Redis server, shared by every gateway; what
it holds survives the death of any service. It is a service registry too (rsd_service.registry, on the same Redis
and namespace), so one connection serves both jobs. Each multi-step operation is one Lua script, so it is atomic.

Layout, under a namespace (default "rsd"); ids are [A-Za-z0-9._-], so keys cannot collide:
    {ns}:session:{id}          hash: prompt_ids, params, status, finish_reason, drafter_id, verifier_id,
                               kv_verifier_id, kv_length, epoch, created_unix_ms, updated_unix_ms
    {ns}:session:{id}:tokens   string: the committed ids packed as little-endian uint32, so the
                               committed length is STRLEN / 4 and an append is one APPEND
    {ns}:service:{role}:{id}, {ns}:services:{role}: the registry's (rsd_service.registry)
    {ns}:running               set: hash keys of the RUNNING sessions (the gateways' orphan sweep reads
                               it), kept by the session scripts, pruned when listed
Every key has a TTL: a session's two keys get session_ttl_s again on every write (the running set
too, while it gains members); a service key its heartbeat's ttl_s.

The store is synchronous (redis-py): from asyncio code call it through gateway.store.calls.StoreCalls.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from redis.commands.core import Script

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
from rsd_service.registry import RedisServiceRegistry, check_id


def _pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _unpack(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 4}I", data)


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
        prompt = check_tokens(prompt_ids, "prompt_ids")
        args = [_pack(prompt), encode_params(params), SessionStatus.PENDING.value, self.session_ttl_ms]
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
        start = check_count("start", start)
        hash_key, tokens_key = self.session_keys(session_id)
        pipe = self.client.pipeline(transaction=True)
        exists, data = pipe.exists(hash_key).getrange(tokens_key, 4 * start, -1).execute()
        if not exists:
            raise SessionNotFound(session_id)
        return list(_unpack(data))

    def append_tokens(self, session_id: str, position: int, tokens: Sequence[int], epoch: int) -> int:
        tokens = check_tokens(tokens, "tokens")
        args = [check_count("position", position), check_count("epoch", epoch), _pack(tokens)]
        refused = append_refused(position, epoch)
        return self._run(self._append, session_id, [*args, self.session_ttl_ms], refused)[0]

    def begin_epoch(self, session_id: str, expected_epoch: int, drafter_id: str, verifier_id: str) -> int:
        check_id("drafter_id", drafter_id)
        check_id("verifier_id", verifier_id)
        args = [check_count("expected_epoch", expected_epoch), drafter_id, verifier_id, SessionStatus.RUNNING.value]
        refused = epoch_refused(expected_epoch)
        return self._run(self._begin_epoch, session_id, [*args, self.session_ttl_ms], refused)[1]

    def set_kv_length(self, session_id: str, epoch: int, length: int) -> None:
        args = [check_count("epoch", epoch), self.session_ttl_ms]
        self._run(self._update, session_id, [*args, "kv_length", check_count("length", length)], epoch_refused(epoch))

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
            pairs += ["params", encode_params(params)]
        if finish_reason is not None:
            pairs += ["finish_reason", check_finish_reason(finish_reason)]
        check = "" if epoch is None else check_count("epoch", epoch)
        self._run(self._update, session_id, [check, self.session_ttl_ms, *pairs], epoch_refused(epoch))

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

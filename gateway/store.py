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

Modules: gateway.session (types, protocol, errors), gateway.session_checks (validation and encoding both
stores share), gateway.redis_store, gateway.memory_store. This module gathers their public names.
"""

from gateway.memory_store import MemorySessionStore
from gateway.redis_store import RedisSessionStore
from gateway.session import (
    KvLocation,
    SessionConflict,
    SessionExists,
    SessionNotFound,
    SessionRecord,
    SessionStatus,
    SessionStore,
    StoreError,
)
from rsd_service.registry import ServiceInfo

__all__ = [
    "KvLocation",
    "MemorySessionStore",
    "RedisSessionStore",
    "ServiceInfo",
    "SessionConflict",
    "SessionExists",
    "SessionNotFound",
    "SessionRecord",
    "SessionStatus",
    "SessionStore",
    "StoreError",
]

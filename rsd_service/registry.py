"""The service registry: which drafters and verifiers are alive, where, and how loaded.

Each service heartbeats a `ServiceInfo` (rsd_service.serving.Heartbeat) into the registry with a TTL, so a
crashed service disappears by itself; gateways list a role's live services to place new sessions. The
registry shares Redis (and the namespace) with the gateway's session store; the session stores
(gateway.store) are registries too, by inheritance, so one connection serves both jobs.

Redis layout, under a namespace (default "rsd"); ids are [A-Za-z0-9._-] (`check_id`), so keys cannot collide:
    {ns}:service:{role}:{id}   string: a ServiceInfo as JSON; expires unless heartbeated (fields it does not
                               know, from a newer service, are ignored: add fields, never rename)
    {ns}:services:{role}       set: ids of the role's registered services, pruned when listed
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Protocol

import redis

# The id alphabet of sessions, services and roles (they become parts of Redis keys).
ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_id(kind: str, value: str) -> str:
    """`value` if it is 1-128 characters of [A-Za-z0-9._-], else ValueError naming `kind`."""
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ValueError(f"{kind} must be 1-128 characters of [A-Za-z0-9._-], got {value!r}")
    return value


@dataclass(frozen=True)
class ServiceInfo:
    role: str  # "verifier" or "drafter"
    service_id: str
    address: str  # host:port of its gRPC server
    capacity: int = 0  # sessions it can hold
    load: int = 0  # sessions it holds now
    max_len: int = 0  # tokens a session's cache holds (its config's max_len: committed + a tree); 0 = not said

    @classmethod
    def from_json(cls, raw: str | bytes) -> ServiceInfo:
        """The registry's JSON entry; fields this version does not know are dropped."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


class ServiceRegistry(Protocol):
    def register_service(self, info: ServiceInfo, ttl_s: float) -> None:
        """Register or heartbeat: the entry lives ttl_s seconds after the latest call."""
        ...

    def list_services(self, role: str) -> list[ServiceInfo]:
        """Live services of a role, by service_id."""
        ...

    def unregister_service(self, role: str, service_id: str) -> None: ...


def _check_entry(info: ServiceInfo, ttl_s: float) -> None:
    check_id("role", info.role)
    check_id("service_id", info.service_id)
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")


# KEYS: [index set, service key]; ARGV: service_id, info json, ttl_ms
_REGISTER = """
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[1], ARGV[1])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
"""

# KEYS: [index set]; ARGV: service key prefix. Drops the ids whose key expired.
_LIST = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local info = redis.call('GET', ARGV[1] .. id)
  if info then table.insert(out, info) else redis.call('SREM', KEYS[1], id) end
end
return out
"""


class RedisServiceRegistry:
    """ServiceRegistry on one Redis server; each operation is one Lua script or transaction (atomic)."""

    def __init__(self, client: redis.Redis, namespace: str = "rsd"):
        if not namespace or any(c.isspace() for c in namespace):
            raise ValueError(f"namespace must be non-empty without spaces, got {namespace!r}")
        self.client, self.namespace = client, namespace
        self._register = client.register_script(_REGISTER)
        self._list = client.register_script(_LIST)

    @classmethod
    def from_url(cls, url: str, namespace: str = "rsd") -> RedisServiceRegistry:
        return cls(redis.Redis.from_url(url), namespace)

    def _index_key(self, role: str) -> str:
        return f"{self.namespace}:services:{role}"

    def _service_key_prefix(self, role: str) -> str:
        return f"{self.namespace}:service:{role}:"

    def register_service(self, info: ServiceInfo, ttl_s: float) -> None:
        _check_entry(info, ttl_s)
        key = self._service_key_prefix(info.role) + info.service_id
        ttl_ms = max(1, round(ttl_s * 1000))
        self._register(keys=[self._index_key(info.role), key], args=[info.service_id, json.dumps(asdict(info)), ttl_ms])

    def list_services(self, role: str) -> list[ServiceInfo]:
        check_id("role", role)
        found = self._list(keys=[self._index_key(role)], args=[self._service_key_prefix(role)])
        return sorted((ServiceInfo.from_json(raw) for raw in found), key=lambda s: s.service_id)

    def unregister_service(self, role: str, service_id: str) -> None:
        check_id("role", role)
        check_id("service_id", service_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self._service_key_prefix(role) + service_id).srem(self._index_key(role), service_id)
        pipe.execute()


class MemoryServiceRegistry:
    """ServiceRegistry in this process's memory (a single-process run, tests); TTLs on `clock` (unix s)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._services: dict[str, dict[str, tuple[ServiceInfo, float]]] = {}  # role -> id -> (info, expires_at)
        self._lock = threading.Lock()

    def register_service(self, info: ServiceInfo, ttl_s: float) -> None:
        _check_entry(info, ttl_s)
        with self._lock:
            self._services.setdefault(info.role, {})[info.service_id] = (info, self.clock() + ttl_s)

    def list_services(self, role: str) -> list[ServiceInfo]:
        check_id("role", role)
        now = self.clock()
        with self._lock:
            live = {sid: entry for sid, entry in self._services.get(role, {}).items() if entry[1] > now}
            self._services[role] = live
            return [live[sid][0] for sid in sorted(live)]

    def unregister_service(self, role: str, service_id: str) -> None:
        check_id("role", role)
        check_id("service_id", service_id)
        with self._lock:
            self._services.get(role, {}).pop(service_id, None)

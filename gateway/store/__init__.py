"""Session state: what a session is, where it is kept, and how asyncio code reaches it.

    gateway.store.session       SessionRecord, the SessionStore protocol and its semantics (epochs, compare-and-set
                                appends, the store's clock), the errors, the checks both stores share
    gateway.store.redis_store   RedisSessionStore: shared by every gateway; what it holds survives any service
    gateway.store.memory_store  MemorySessionStore: the same semantics inside one process (the embedded default)
    gateway.store.calls         StoreCalls: the synchronous store from asyncio, retried through a Redis outage

Each store is also a service registry (rsd_service.registry) on the same Redis and namespace.
"""

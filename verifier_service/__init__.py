"""Verifier service (issue 3): holds the target model, a per-session KV pool and the batcher that
packs many sessions' trees into one target forward. engine.BatchedVerifier is the engine; the
gRPC shell is not built yet."""

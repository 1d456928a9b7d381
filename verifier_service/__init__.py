"""Verifier service (issue 3): holds the target model, a per-session KV pool and the batcher that
packs many sessions' trees into one target forward. Its single-session engine is
rsd_runtime.generator.Verifier; the batched engine and the gRPC shell are not built yet."""

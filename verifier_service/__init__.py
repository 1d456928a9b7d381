"""Verifier service: holds the target model, a per-session KV pool and the batcher that packs many
sessions' trees into one target forward.

    config     VerifierConfig: every setting and its default (RSD_VERIFIER_* env, --flags)
    engine     VerifierPool: attach / release / verify_batch over a slot KV pool (no I/O)
    batcher    gathers the waiting trees of all sessions into one verify_batch call
    servicer   rsd.v1.Verifier: validation, per-session epoch / committed tokens / RNG, status codes
    server     create_server() -> (server, port, handle); main(): python -m verifier_service
"""

"""Drafter service: holds the draft model and runs each session's decode loop, streaming draft trees
to a verifier and the committed tokens back to the gateway.

    config     DrafterConfig: every setting and its default (RSD_DRAFTER_* env, --flags)
    engine     DrafterPool: the session loop over rsd_runtime.engines.Drafter (asyncio + torch)
    verifier_client  the Verify stream to a verifier (resends), verdict checks, the verifier's errors
    servicer   rsd.v1.Drafter: RunRequest validation, RunEvents, status codes
    server     create_server() -> (server, port, handle); main(): python -m drafter_service
"""

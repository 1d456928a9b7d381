"""Drafter service (issue 3): holds the draft model and runs each session's decode loop, streaming
RSD trees to a verifier. Its engine is rsd_runtime.generator.Drafter; the gRPC shell is not built yet."""

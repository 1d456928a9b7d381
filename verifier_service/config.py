"""Every setting of the verifier service, with its default, in one frozen dataclass.

Read with rsd_runtime.serving.load_config(VerifierConfig, "verifier", argv): defaults, then
RSD_VERIFIER_<FIELD> environment variables, then --field flags (e.g. --max-batch-nodes 256).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class VerifierConfig:
    """rsd verifier: holds the target model and batches the draft trees of many sessions."""

    # Network. port 0 picks a free port; advertise_address is what the registry publishes
    # ("" = host:port as bound).
    host: str = "127.0.0.1"
    port: int = 0
    advertise_address: str = ""
    # Name in the registry and in AttachResponse.verifier_id ("" = "verifier-<host>-<port>").
    verifier_id: str = ""
    # The target model: a local folder (rsd_runtime.models.load_model), its device and dtype.
    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    # KV pool: sessions held at once, and tokens per session (committed prefix + one tree).
    num_slots: int = 8
    max_len: int = 2048
    # Largest tree (nodes, root included) one DraftTree may carry; reported on Attach.
    max_tree_nodes: int = 64
    # Batching: after the first tree arrives, wait at most batch_wait_ms for trees of other sessions,
    # and pack at most max_batch_nodes tokens (tree nodes + prefill chains) into one forward (a single
    # larger request still runs, alone). batching=False verifies one tree per forward (benchmarks).
    batching: bool = True
    batch_wait_ms: float = 2.0
    max_batch_nodes: int = 512
    # Registry: "" = do not register; else a redis:// URL. The entry is refreshed every heartbeat_s
    # and expires registration_ttl_s after the last refresh (a crashed verifier disappears).
    redis_url: str = ""
    redis_namespace: str = "rsd"
    heartbeat_s: float = 2.0
    registration_ttl_s: float = 6.0
    # Graceful stop: seconds in-flight streams get to finish after SIGTERM.
    drain_s: float = 10.0
    # torch intra-op threads (0 = torch's default).
    threads: int = 0
    # Security (rsd_runtime.security). TLS: tls_cert + tls_key (PEM files); with tls_ca as well,
    # clients must present a certificate that CA signed (mTLS). internal_token: the shared secret of
    # the internal hops (`authorization: Bearer <token>`), as a value (env RSD_VERIFIER_INTERNAL_TOKEN)
    # or a file; "" = no check. gRPC health and reflection need no token.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    internal_token: str = field(default="", repr=False)
    internal_token_file: str = ""
    # Limits: largest gRPC message either way, and calls served at once (more: RESOURCE_EXHAUSTED
    # from gRPC itself; 0 = no limit).
    max_message_bytes: int = 64 * 1024 * 1024
    max_concurrent_rpcs: int = 1024
    # Operations: Prometheus exporter on metrics_port (0 = off; plain HTTP on host); logs as
    # "text" or "json" (one object per line, with the call's session and request ids).
    metrics_port: int = 0
    log_format: str = "text"

    def __post_init__(self) -> None:
        checks = {
            "num_slots": self.num_slots >= 1,
            "max_len": self.max_len >= 2,
            "max_tree_nodes": 1 <= self.max_tree_nodes < self.max_len,
            "batch_wait_ms": self.batch_wait_ms >= 0,
            "max_batch_nodes": self.max_batch_nodes >= 1,
            "heartbeat_s": self.heartbeat_s > 0,
            "registration_ttl_s": self.registration_ttl_s > self.heartbeat_s,
            "drain_s": self.drain_s >= 0,
            "threads": self.threads >= 0,
            "port": 0 <= self.port < 65536,
            "max_message_bytes": self.max_message_bytes >= 1024,
            "max_concurrent_rpcs": self.max_concurrent_rpcs >= 0,
            "metrics_port": 0 <= self.metrics_port < 65536,
            "log_format": self.log_format in ("text", "json"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid verifier config: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")

"""Every setting of the drafter service, with its default, in one frozen dataclass.

Read with rsd_runtime.serving.load_config(DrafterConfig, "drafter", argv): defaults, then
RSD_DRAFTER_<FIELD> environment variables, then --field flags (e.g. --proposal-top-k 64).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DrafterConfig:
    """rsd drafter: holds the draft model and runs each session's speculative loop against a verifier."""

    # Network. port 0 picks a free port; advertise_address is what the registry publishes.
    host: str = "127.0.0.1"
    port: int = 0
    advertise_address: str = ""
    drafter_id: str = ""  # "" = "drafter-<host>-<port>"
    # The draft model: a local folder (rsd_runtime.models.load_model), its device and dtype.
    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    # Draft KV capacity per session (committed prefix + one tree) and sessions held at once: a
    # session's runner (and its draft cache) is kept after its run for the session's next turn
    # and evicted least-recently-used when a new session needs one.
    max_len: int = 2048
    max_sessions: int = 8
    # Drafter-side truncation of the proposal law: children are sampled from the draft's top-k
    # (0 = off) / top-p (1.0 = off) tokens, renormalised, and exactly that law travels. Exactness
    # holds for any law the drafter really sampled from (the verifier uses the law on the wire);
    # truncation only trades acceptance for wire size. Default 256: for Qwen2.5 (V = 151,936) a
    # dense law is 600 KB per internal node, a top-256 law 2 KB (sparse int32 ids + float32
    # probs), and the draft's mass beyond its top 256 is small. For V <= 256 it changes nothing.
    proposal_top_k: int = 256
    proposal_top_p: float = 1.0
    # Largest tree (nodes, root included) a run may draft; the verifier's own limit (from Attach)
    # applies too.
    max_tree_nodes: int = 64
    # Verifier calls: deadline of Attach (which may queue behind a forward) in seconds.
    attach_timeout_s: float = 30.0
    # Registry: "" = do not register; else a redis:// URL (role "drafter").
    redis_url: str = ""
    redis_namespace: str = "rsd"
    heartbeat_s: float = 2.0
    registration_ttl_s: float = 6.0
    # Graceful stop: seconds running sessions get to finish after SIGTERM.
    drain_s: float = 10.0
    # torch intra-op threads (0 = torch's default).
    threads: int = 0
    # Security (rsd_runtime.security). TLS: tls_cert + tls_key (PEM files); with tls_ca as well,
    # clients must present a certificate that CA signed (mTLS). internal_token: the shared secret of
    # the internal hops (`authorization: Bearer <token>`), as a value (env RSD_DRAFTER_INTERNAL_TOKEN)
    # or a file; "" = no check. gRPC health and reflection need no token.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    internal_token: str = field(default="", repr=False)
    internal_token_file: str = ""
    # Dialing the verifier: TLS when peer_tls_ca is set (the CA of their certificates), a client
    # certificate for mTLS (peer_tls_cert + peer_tls_key); internal_token is sent on every call.
    peer_tls_ca: str = ""
    peer_tls_cert: str = ""
    peer_tls_key: str = ""
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
            "max_len": self.max_len >= 2,
            "max_sessions": self.max_sessions >= 1,
            "proposal_top_k": self.proposal_top_k >= 0,
            "proposal_top_p": 0 < self.proposal_top_p <= 1,
            "max_tree_nodes": 2 <= self.max_tree_nodes < self.max_len,
            "attach_timeout_s": self.attach_timeout_s > 0,
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
            raise ValueError(f"invalid drafter config: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")

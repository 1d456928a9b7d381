"""The gateway's configuration: one frozen dataclass, every default here.

    config = load_config(GatewayConfig, "gateway", argv)   # RSD_GATEWAY_PORT=7000 or --port 7000

Services are named in `drafters` / `verifiers` as comma lists of `id=host:port` (the id must be the
one the service itself reports, e.g. its --verifier-id). When both lists are empty the gateway reads
the live services from the registry in Redis (gateway.store: register_service / list_services).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rsd.methods import Method

_SERVICE = re.compile(r"([A-Za-z0-9._-]{1,128})=([^=,\s]+:\d+)")


@dataclass(frozen=True)
class GatewayConfig:
    """rsd gateway: the public Generate / Cancel / GetSession API."""

    host: str = "127.0.0.1"
    port: int = 7000  # 0 picks a free port
    gateway_id: str = "gateway-0"  # in logs only
    tokenizer: str = ""  # model folder whose tokenizer encodes text input and decodes deltas (required)
    redis_url: str = ""  # "" = the embedded in-process store (one gateway only, nothing survives it)
    redis_namespace: str = "rsd"  # Redis key prefix (the same as the services' --redis-namespace)
    session_ttl_s: float = 24 * 3600.0
    drafters: str = ""  # "id=host:port,..."; "" = the Redis registry
    verifiers: str = ""  # "id=host:port,..."; "" = the Redis registry
    max_prompt_tokens: int = 8192  # longest input of one request (prompt or turn)
    max_session_tokens: int = 32768  # longest committed sequence a turn may grow to
    max_new_tokens_limit: int = 2048  # largest max_new_tokens a request may ask for
    default_max_new_tokens: int = 64
    default_method: str = "rsd_s"
    default_shape: str = "3x4"
    default_temperature: float = 1.0  # the proto's documented default for an absent temperature
    max_stop_sequences: int = 8
    max_running_turns: int = 256  # turns generating through this gateway at once; more -> RESOURCE_EXHAUSTED
    max_failovers: int = 3  # new runs of one turn after a drafter/verifier failure
    service_down_s: float = 10.0  # a static-list service that failed is skipped this long
    health_timeout_s: float = 1.0  # probe after a failure: is the drafter / verifier still up?
    resume_poll_s: float = 0.05  # a resumed stream following another gateway's turn polls the store
    drain_s: float = 10.0  # grace for running turns on SIGTERM
    # A turn generating longer than this ends with DEADLINE_EXCEEDED; the tokens it committed stay in
    # the session (continue or resume it). 0 = no limit.
    request_timeout_s: float = 600.0
    # Security (rsd_runtime.security). The public API: TLS with tls_cert + tls_key (PEM files), client
    # certificates signed by tls_ca required when it is set (mTLS), and a bearer token (auth_token as a
    # value, e.g. env RSD_GATEWAY_AUTH_TOKEN, or auth_token_file; "" = none) that every call but gRPC
    # health and reflection must carry as `authorization: Bearer <token>`.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    auth_token: str = field(default="", repr=False)
    auth_token_file: str = ""
    # Dialing drafters and verifiers: TLS when peer_tls_ca is set (the CA of their certificates), a client
    # certificate for mTLS (peer_tls_cert + peer_tls_key), and the internal shared secret on every call.
    peer_tls_ca: str = ""
    peer_tls_cert: str = ""
    peer_tls_key: str = ""
    internal_token: str = field(default="", repr=False)
    internal_token_file: str = ""
    # Limits of the public port: largest message (requests are text or token ids, replies small deltas)
    # and calls at once, resumes included (more: RESOURCE_EXHAUSTED from gRPC; 0 = no limit).
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_rpcs: int = 1024
    # Operations: Prometheus exporter on metrics_port (0 = off; plain HTTP on host); logs "text" or "json".
    metrics_port: int = 0
    log_format: str = "text"

    def __post_init__(self) -> None:
        Method.parse(self.default_method, self.default_shape)  # ValueError names the problem
        for name in ("max_prompt_tokens", "max_session_tokens", "max_new_tokens_limit", "default_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError("default_max_new_tokens must not exceed max_new_tokens_limit")
        if self.max_running_turns < 1 or self.max_failovers < 0:
            raise ValueError("max_running_turns must be >= 1 and max_failovers >= 0")
        if self.request_timeout_s < 0 or self.max_message_bytes < 1024 or self.max_concurrent_rpcs < 0:
            raise ValueError("request_timeout_s and max_concurrent_rpcs must be >= 0, max_message_bytes >= 1024")
        if not 0 <= self.metrics_port < 65536 or self.log_format not in ("text", "json"):
            raise ValueError(
                f"metrics_port must be a port (0 = off) and log_format text or json, got {self.log_format!r}"
            )
        parse_services(self.drafters, "drafters")
        parse_services(self.verifiers, "verifiers")


def parse_services(text: str, name: str = "services") -> dict[str, str]:
    """ "d0=127.0.0.1:7002,d1=host:7003" -> {"d0": "127.0.0.1:7002", "d1": "host:7003"}."""
    services: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _SERVICE.fullmatch(item)
        if match is None:
            raise ValueError(f"{name}: expected id=host:port items, got {item!r}")
        if match.group(1) in services:
            raise ValueError(f"{name}: id {match.group(1)!r} appears twice")
        services[match.group(1)] = match.group(2)
    return services

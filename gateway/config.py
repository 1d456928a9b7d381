"""The gateway's configuration: one frozen dataclass, every default here.

    config = load_config(GatewayConfig, "gateway", argv)   # RSD_GATEWAY_PORT=7000 or --port 7000

Services are named in `drafters` / `verifiers` as comma lists of `id=host:port` (the id must be the
one the service itself reports, e.g. its --verifier-id). When both lists are empty the gateway reads
the live services from the registry in Redis (rsd_service.registry: register_service / list_services).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rsd.logprobs import LOGPROBS_MODES, RAW_LOGPROBS
from rsd.methods import VERIFICATIONS, Method
from rsd_service.config import PeerTLSConfig, ServiceConfig

_SERVICE = re.compile(r"([A-Za-z0-9._-]{1,128})=([^=,\s]+:\d+)")


@dataclass(frozen=True)
class GatewayConfig(PeerTLSConfig, ServiceConfig):
    """rsd gateway: the public Generate / Cancel / GetSession API."""

    # Network, security (TLS of the public port; internal_token and peer_tls_* for dialing drafters
    # and verifiers), limits, operations and placement (cores, pinned in main): rsd_service.config.
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
    # A running turn refreshes its session every turn_lease_s / 3 (the store's updated_unix_ms); a RUNNING
    # session not refreshed for turn_lease_s lost its gateway, and a resume on any gateway takes the turn
    # over with a new epoch, and so does the orphan sweep. Lease times are compared by the store's clock
    # (Redis TIME), never the gateways' wall clocks.
    turn_lease_s: float = 5.0
    # Every orphan_sweep_s the gateway takes over the RUNNING turns whose lease expired (their gateway died
    # and no client resumed them), so they finish; one that cannot start (no live service) is FAILED. 0 = off.
    orphan_sweep_s: float = 2.0
    # How long a store call is retried while Redis is unreachable (a restart) before the turn fails UNAVAILABLE.
    store_retry_s: float = 15.0
    # A turn generating longer than this ends with DEADLINE_EXCEEDED; the tokens it committed stay in
    # the session (continue or resume it). 0 = no limit.
    request_timeout_s: float = 600.0
    # The public API's bearer token (auth_token as a value, e.g. env RSD_GATEWAY_AUTH_TOKEN, or
    # auth_token_file; "" = none): every call but gRPC health and reflection must carry it as
    # `authorization: Bearer <token>`. TLS of the public API: tls_cert + tls_key, and client certificates
    # signed by tls_ca required when it is set (mTLS).
    auth_token: str = field(default="", repr=False)
    auth_token_file: str = ""
    # Limits of the public port: the largest message (requests are text or token ids, replies small
    # deltas); max_concurrent_rpcs counts resumes too.
    max_message_bytes: int = 4 * 1024 * 1024
    # The OpenAI-compatible HTTP API (gateway.openai) on host:http_port: -1 = off, 0 = a free port. It
    # serves the same engine with the same auth token, TLS, limits and metrics as the gRPC API.
    http_port: int = -1
    served_model_name: str = ""  # the model id it answers to ("" = the tokenizer folder's name)
    # Which figures logprobs are when a request does not say (params.logprobs_mode; vLLM's engine argument
    # --logprobs-mode, whose default this is): raw_logprobs, raw_logits, processed_logprobs or processed_logits.
    logprobs_mode: str = RAW_LOGPROBS
    # The exact rule that verifies a request's trees when it does not say (params.verification, rsd.methods):
    # token, traversal, block (chain shapes only) or coupled (sd, rsd_c, rsd_s). A request it does not suit is
    # refused with INVALID_ARGUMENT / 400 naming params.verification, as if it had asked for it.
    verification: str = "token"

    def checks(self) -> dict[str, bool]:
        return {
            **super().checks(),
            "max_prompt_tokens": self.max_prompt_tokens >= 1,
            "max_session_tokens": self.max_session_tokens >= 1,
            "max_new_tokens_limit": self.max_new_tokens_limit >= 1,
            "default_max_new_tokens": 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit,
            "max_running_turns": self.max_running_turns >= 1,
            "max_failovers": self.max_failovers >= 0,
            "turn_lease_s": self.turn_lease_s > 0,
            "orphan_sweep_s": self.orphan_sweep_s >= 0,
            "store_retry_s": self.store_retry_s > 0,
            "request_timeout_s": self.request_timeout_s >= 0,
            "http_port": -1 <= self.http_port < 65536,
            "logprobs_mode": self.logprobs_mode in LOGPROBS_MODES,
            "verification": self.verification in VERIFICATIONS,
        }

    def __post_init__(self) -> None:
        super().__post_init__()
        Method.parse(self.default_method, self.default_shape)  # ValueError names the problem
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

"""The settings every rsd service shares, as frozen dataclasses that each service's config extends.

    ServiceConfig          every gRPC service: network, security, limits, operations
    PeerTLSConfig          a service that dials others (gateway, drafter): TLS towards its peers
    ModelServiceConfig     a service that holds a model (drafter, verifier): model, KV capacity, torch
                           threads, and its entry in the Redis registry

Every service places its process on `cores`; ModelServiceConfig adds torch's `threads`
(rsd_service.placement).

A base field reads like the service's own: RSD_<SERVICE>_<FIELD> env and a --field flag
(load_config, below, walks dataclasses.fields, inherited ones included). A service
changes a default by declaring the field again (the gateway's port 7000); it keeps its place.
Base fields come first; every field has a default, so the order is always valid.

Checks: checks() maps each constrained field to whether its value is valid; a service adds its own
({**super().checks(), "num_slots": self.num_slots >= 1}) and __post_init__ raises one ValueError
naming every invalid field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rsd_service.placement import parse_cores

T = TypeVar("T")


@dataclass(frozen=True)
class ServiceConfig:
    """Network, security, limits and operations of an rsd gRPC service."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    # Graceful stop: seconds running work gets to finish after SIGTERM.
    drain_s: float = 10.0
    # Security (rsd_service.security). TLS: tls_cert + tls_key (PEM files); with tls_ca as well,
    # clients must present a certificate that CA signed (mTLS). internal_token: the shared secret of
    # the internal hops (`authorization: Bearer <token>`), as a value (env RSD_<SERVICE>_INTERNAL_TOKEN)
    # or a file; "" = none. Drafter and verifier require it of every caller (gRPC health and reflection
    # need none); gateway and drafter send it on every call to their peers.
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
    # Placement (rsd_service.placement): the CPU cores this process may use, a Linux CPU list such as
    # "0" or "0-1,3" ("" = any), applied to all its threads at start (a model service: before the model
    # loads). The gateway takes one too: unpinned, its work lands on whichever core is free, often the
    # verifier's, whose forward is the critical path.
    cores: str = ""

    def checks(self) -> dict[str, bool]:
        """Field name -> whether its value is valid. Subclasses add theirs: {**super().checks(), ...}."""
        return {
            "port": 0 <= self.port < 65536,
            "drain_s": self.drain_s >= 0,
            "max_message_bytes": self.max_message_bytes >= 1024,
            "max_concurrent_rpcs": self.max_concurrent_rpcs >= 0,
            "metrics_port": 0 <= self.metrics_port < 65536,
            "log_format": self.log_format in ("text", "json"),
        }

    def __post_init__(self) -> None:
        try:
            parse_cores(self.cores)  # the reason in the message: which part of the list does not parse
        except ValueError as e:
            raise ValueError(f"invalid {type(self).__name__}: {e}") from None
        bad = [name for name, ok in self.checks().items() if not ok]
        if bad:
            raise ValueError(f"invalid {type(self).__name__}: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")


@dataclass(frozen=True)
class PeerTLSConfig:
    """Dialing other services (rsd_service.security.peer_security): TLS when peer_tls_ca is set (the CA
    of their certificates), a client certificate for mTLS (peer_tls_cert + peer_tls_key)."""

    peer_tls_ca: str = ""
    peer_tls_cert: str = ""
    peer_tls_key: str = ""


@dataclass(frozen=True)
class ModelServiceConfig(ServiceConfig):
    """A service that holds a model (drafter, verifier) and registers in Redis."""

    # advertise_address is what the registry publishes ("" = host:port as bound).
    advertise_address: str = ""
    # The model: a local folder (rsd_runtime.models.load_model), its device and dtype, and its attention
    # backend ("auto": sdpa where the architecture has it, else eager; tree forwards need one of the two).
    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    attn_implementation: str = "auto"
    # The folder whose tokenizer structured output's automata read ("" = the model folder); loaded at the
    # first request with params.constraint (rsd_runtime.constraint).
    tokenizer: str = ""
    # Numeric mode of a GGUF model's quantised layers: "exact" (float32 weights and sums) or the opt-in
    # "q8_activations" (int8 activations as llama.cpp computes: rsd_runtime.quant_q8; CPU float32 only).
    numeric: str = "exact"
    # KV capacity per session, in tokens: committed prefix + one tree.
    max_len: int = 2048
    # Registry: "" = do not register; else a redis:// URL. The entry is refreshed every heartbeat_s
    # and expires registration_ttl_s after the last refresh (a crashed service disappears).
    redis_url: str = ""
    redis_namespace: str = "rsd"
    heartbeat_s: float = 2.0
    registration_ttl_s: float = 6.0
    # Torch intra-op threads (0 = one per given core, else torch's default); the cores: ServiceConfig.
    threads: int = 0

    def checks(self) -> dict[str, bool]:
        return {
            **super().checks(),
            "max_len": self.max_len >= 2,
            "attn_implementation": self.attn_implementation in ("auto", "sdpa", "eager"),
            "numeric": self.numeric.replace("-", "_") in ("exact", "q8_activations"),  # rsd_runtime.NUMERICS
            "heartbeat_s": self.heartbeat_s > 0,
            "registration_ttl_s": self.registration_ttl_s > self.heartbeat_s,
            "threads": self.threads >= 0,
        }


# ---------------------------------------------------------------------------------------------
# Reading a config: defaults < env < flags


def _field_type(cls: type, f: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:  # X | None -> X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _parse(kind: type, text: str, name: str) -> Any:
    try:
        if kind is bool:
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("1", "true", "yes")
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: cannot read {text!r} as {kind.__name__}") from None


def load_config(cls: type[T], service: str, argv: Sequence[str] | None = None, env=os.environ) -> T:
    """An instance of the frozen dataclass `cls`: defaults < RSD_<SERVICE>_<FIELD> env < --field flags."""
    values: dict[str, Any] = {}
    parser = argparse.ArgumentParser(prog=f"rsd-{service}", description=(cls.__doc__ or "").split("\n")[0])
    for f in dataclasses.fields(cls):
        kind, env_name = _field_type(cls, f), f"RSD_{service.upper()}_{f.name.upper()}"
        if env_name in env:
            values[f.name] = _parse(kind, env[env_name], env_name)
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, dest=f.name, default=None, help=f"env {env_name}")
    args = parser.parse_args(list(argv) if argv is not None else [])
    for f in dataclasses.fields(cls):
        text = getattr(args, f.name)
        if text is not None:
            values[f.name] = _parse(_field_type(cls, f), text, "--" + f.name.replace("_", "-"))
    return cls(**values)

"""rsd_wire: the wire layer between the algorithm package `rsd` and the gRPC services.

    rsd_wire.convert   algorithm types <-> protos (tensors, draft trees, verdicts, params, methods)
    GRPC_OPTIONS       channel/server options every server and channel of the project uses
    *_pb2, *_pb2_grpc  the generated modules of protos/rsd_proto/v1 (package rsd.v1), re-exported

The generated code lives in `rsd_proto/` and is written by scripts/gen_protos.py, never by hand.
"""

from __future__ import annotations

try:
    from rsd_proto.v1 import (
        common_pb2,
        drafter_pb2,
        drafter_pb2_grpc,
        gateway_pb2,
        gateway_pb2_grpc,
        verifier_pb2,
        verifier_pb2_grpc,
    )
except ModuleNotFoundError as err:  # pragma: no cover - depends on the checkout
    if not (err.name or "").startswith("rsd_proto"):
        raise
    raise ImportError("generated gRPC code is missing: run `python scripts/gen_protos.py`") from err

# gRPC's default receive limit is 4 MiB, and one draft tree with full-vocabulary laws can pass it
# (151,936 x 4 B ~ 600 KB per internal node for Qwen2.5). Both ends set the limits explicitly.
# A larger message is refused by gRPC itself with RESOURCE_EXHAUSTED. The gateway's public port
# takes a smaller limit of its own (gateway max_message_bytes).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[tuple[str, int], ...]:
    return (
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    )


GRPC_OPTIONS = grpc_options()

__all__ = [
    "GRPC_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "common_pb2",
    "drafter_pb2",
    "drafter_pb2_grpc",
    "gateway_pb2",
    "gateway_pb2_grpc",
    "grpc_options",
    "verifier_pb2",
    "verifier_pb2_grpc",
]

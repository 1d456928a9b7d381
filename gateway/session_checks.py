"""Validation and encoding shared by both session stores (gateway.redis_store, gateway.memory_store), so
both refuse the same inputs with the same messages and give back the same (JSON) params."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

MAX_TOKEN_ID = 2**32 - 1


def check_tokens(tokens: Sequence[int], what: str) -> list[int]:
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError(f"{what} must not be empty")
    bad = next((t for t in tokens if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise ValueError(f"{what}: token id {bad} is outside [0, 2**32)")
    return tokens


def check_count(name: str, value: int) -> int:
    if int(value) != value or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def encode_params(params: Mapping[str, Any]) -> str:
    """Both stores keep params as JSON text, so both give back the same (JSON) values."""
    return json.dumps(dict(params), sort_keys=True, separators=(",", ":"))


def append_refused(position: int, epoch: int) -> str:
    return f"append at position {position} in epoch {epoch} refused"


def epoch_refused(epoch: int | None) -> str:
    return f"write expecting epoch {epoch} refused"


def check_finish_reason(reason: str) -> str:
    if not isinstance(reason, str) or (reason and not re.fullmatch(r"[a-z_]{1,32}", reason)):
        raise ValueError(f"finish_reason must be 1-32 characters of [a-z_] or empty, got {reason!r}")
    return reason

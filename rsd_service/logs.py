"""Service logs: text or JSON lines, each record carrying the ids of the call being served.

setup_logging("json")        # once per process, from the service config's log_format
token = log_context.set((("method", "Generate"), ("request_id", "r1")))   # per call (metrics.CallInterceptor)
"""

from __future__ import annotations

import contextvars
import json
import logging
from typing import Any

# The ids of the call being served (method, session_id, request_id): set per RPC by
# rsd_service.metrics.CallInterceptor, copied into tasks the call starts, added to every log record.
log_context: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("rsd_log_context", default=())
LOG_FORMATS = ("text", "json")


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in log_context.get():
            if not hasattr(record, key):  # an explicit extra={...} wins
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the call's ids, and any extra fields."""

    _STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in self._STANDARD and not k.startswith("_")})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Root logging for a service process: "text" (human) or "json" (one object per line), both
    with the call's ids (session_id, request_id, method) where a call is being served."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)

"""The OpenAI-compatible HTTP API's bodies, in one place: requests (pydantic, validated) and replies.

Requests turn into the gateway's own GenerateRequest (`to_generate_request`); replies are built from
its events by `Reply`. What is supported of OpenAI's API:
    both      model, max_tokens, temperature, top_p, seed, stop (a string or a list), stream,
              stream_options.include_usage, n (1 only), user (ignored), presence_penalty and
              frequency_penalty (0 only)
    completions       prompt (a string or token ids; one prompt), echo (false), logprobs (null),
                      suffix (null), best_of (1), logit_bias (empty)
    chat.completions  messages (role + content: a string or text parts), max_completion_tokens,
                      logprobs (false)
    rsd's own (extra body fields): method, shape, top_k, session_id (continue that session: its
    committed tokens, then this request's prompt or messages)
Anything else is refused (400), never silently ignored: a field that changes sampling must not be dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rsd_service.client import build_params
from rsd_wire import common_pb2, gateway_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    common_pb2.FINISH_REASON_EOS: "stop",  # eos, or the chat template's end of turn
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",  # not OpenAI's: the turn was cancelled (rsd Cancel)
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


def _only(value: Any, allowed: Any, name: str) -> Any:
    if value != allowed:
        raise ValueError(f"{name} is not supported (only {allowed!r})")
    return value


class _GenerateBody(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # rsd's own
    method: str | None = None
    shape: str | None = None
    top_k: int | None = Field(None, ge=0)
    session_id: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        return _only(n, 1, "n")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        return _only(value, 0.0, "a penalty")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def new_tokens(self) -> int:
        return self.max_tokens or 0  # 0: the session's or the gateway's default

    def set_input(self, request: gateway_pb2.GenerateRequest) -> None:
        raise NotImplementedError

    def to_generate_request(self, request_id: str) -> gateway_pb2.GenerateRequest:
        request = gateway_pb2.GenerateRequest(session_id=self.session_id or "", request_id=request_id)
        self.set_input(request)
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        params = build_params(
            self.method, self.shape, self.temperature, self.top_k, self.top_p, self.new_tokens, stops, self.seed
        )
        if params is not None:
            request.params.CopyFrom(params)
        return request


class CompletionRequest(_GenerateBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request, got {len(prompt)}")
            return prompt[0]
        return prompt

    @field_validator("echo", "logprobs", "suffix", "best_of", "logit_bias")
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        allowed = {"echo": False, "best_of": 1, "logit_bias": {}}.get(info.field_name)
        return value if value is None else _only(value, allowed, info.field_name)

    def set_input(self, request: gateway_pb2.GenerateRequest) -> None:
        if isinstance(self.prompt, str):
            request.text = self.prompt
        else:
            request.token_ids.ids.extend(self.prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerateBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool) -> bool:
        return _only(value, False, "logprobs")

    @property
    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 0

    def set_input(self, request: gateway_pb2.GenerateRequest) -> None:
        request.messages.messages.extend(gateway_pb2.ChatMessage(role=m.role, content=m.text()) for m in self.messages)


# ---------------------------------------------------------------------------------------------
# Replies


def usage(started: gateway_pb2.GenerationStarted, finished: gateway_pb2.GenerationFinished) -> dict[str, int]:
    """prompt_tokens: what this request's input appended (the prompt, or a continuation's new turn)."""
    prompt, completion = started.input_length_tokens, finished.num_new_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_list(name: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "rsd"}]}


@dataclass
class Reply:
    """The reply objects of one request: a whole completion, or its stream's chunks. Each carries the
    session id (`session_id`, not OpenAI's): send it back as an extra field to continue the session."""

    chat: bool
    request_id: str
    model: str
    session_id: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, kind: str) -> dict[str, Any]:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.request_id}", "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, token_usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [choice], "usage": token_usage, "session_id": self.session_id}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason)
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return {**body, "session_id": self.session_id}

    def usage_chunk(self, token_usage: dict[str, int]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": token_usage, "session_id": self.session_id}

"""The OpenAI-compatible HTTP API's bodies, in one place: requests (pydantic, validated) and replies.

Requests turn into the gateway's own GenerateRequest (`to_generate_request`); replies are built from
its events by `Reply`. What is supported of OpenAI's API:
    both      model, max_tokens, temperature, top_p, seed, stop (a string or a list), stream,
              stream_options.include_usage, n (1..16: n sessions, seeds seed, seed + 1, ...), user (ignored),
              presence_penalty and frequency_penalty (in [-2, 2]), logit_bias (token id -> bias in [-100, 100])
    completions       prompt (a string or token ids; one prompt), echo (false), logprobs (0..20),
                      suffix (null), best_of (1)
    chat.completions  messages (role: system, developer, user, assistant or tool (with tool_call_id);
                      content: a string or text parts, required; name: passed to the chat template),
                      max_completion_tokens, logprobs, top_logprobs (0..20, with logprobs)
    structured output  response_format (OpenAI's: text, json_object, json_schema with json_schema.schema) or
              structured_outputs (vLLM's extra field: regex, json, choice), one of the two (rsd.constraint)
    rsd's own (extra body fields): method, shape, top_k, repetition_penalty (> 0, 1 = off; vLLM's), session_id
    (continue that session: its committed tokens, then this request's prompt or messages), verification ("token",
    "traversal", "block", "coupled": the exact rule that verifies the trees, rsd.methods), adaptive_shape (true: the
    drafter picks each step's shape up to `shape`, rsd.shape_control; sd, spectr and rsd_s only), logprobs_mode (vLLM's
    engine argument, per request here: raw_logprobs, raw_logits, processed_logprobs, processed_logits; rsd.logprobs;
    absent = the gateway's --logprobs-mode)
    /tokenize, /detokenize  vLLM's bodies (TokenizeCompletionRequest / TokenizeChatRequest, DetokenizeRequest)
A null is the field's default, as OpenAI and vLLM read it. Anything else is refused (400), never silently ignored:
a field that changes sampling must not be dropped.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rsd.constraint import Constraint
from rsd.logprobs import MAX_TOP_LOGPROBS
from rsd.sampling import MAX_LOGIT_BIAS, MAX_PENALTY
from rsd_service.client import build_params
from rsd_wire import common_pb2, gateway_pb2
from rsd_wire.convert import constraint_to_proto, parse_method, token_logprobs_from_proto

MAX_CHOICES = 16  # n: each choice is a session of its own (a turn against max_running_turns)

FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    common_pb2.FINISH_REASON_EOS: "stop",  # eos, or the chat template's end of turn
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",  # not OpenAI's: the turn was cancelled (rsd Cancel)
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`"n": null` reads as an absent n (OpenAI and vLLM accept nulls; some clients send them)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Body):
    include_usage: bool = False


def _only(value: Any, allowed: Any, name: str) -> Any:
    if value != allowed:
        raise ValueError(f"{name} is not supported (only {allowed!r})")
    return value


class JsonSchemaFormat(_Body):
    """response_format.json_schema: OpenAI's; `strict` is accepted (the output follows the schema either way)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only there")
        return self


class StructuredOutputs(_Body):
    """vLLM's structured_outputs extra field (regex, json, choice; one of them). Its grammar and structural_tag
    are not served: refused as unknown fields."""

    regex: str | None = None
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    choice: list[str] | None = Field(None, min_length=1)

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        if sum(v is not None for v in (self.regex, self.json_, self.choice)) != 1:
            raise ValueError("give exactly one of regex, json, choice")
        return self

    def constraint(self) -> Constraint:
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.choice is not None:  # one of the strings, literally
            return Constraint("regex", "|".join(_regex_literal(c) for c in self.choice))
        schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
        return Constraint("json_schema", schema)


def _regex_literal(text: str) -> str:
    """text as a regex matching itself (outlines-core's syntax escapes as Python's re does)."""
    return "(" + re.escape(text) + ")"


class _GenerateBody(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)  # rsd.penalties
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # rsd's own
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extra parameter
    method: str | None = None
    shape: str | None = None
    top_k: int | None = Field(None, ge=0)
    session_id: str | None = None
    verification: str | None = None  # "token", "traversal", "block", "coupled"; checked (params.verification)
    logprobs_mode: str | None = None  # vLLM's (its engine argument): which figures logprobs are (rsd.logprobs)
    adaptive_shape: bool = False  # the drafter picks each step's shape up to `shape` (rsd.shape_control)
    logit_bias: dict[str, float] | None = None  # OpenAI's
    response_format: ResponseFormat | None = None  # OpenAI's
    structured_outputs: StructuredOutputs | None = None  # vLLM's

    @model_validator(mode="after")
    def _one_constraint(self) -> _GenerateBody:
        fmt = self.response_format
        if self.structured_outputs is not None and fmt is not None and fmt.type != "text":
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def constraint(self) -> Constraint | None:
        """The structured output asked for, if any."""
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint("json_object")
        return Constraint("json_schema", json.dumps(fmt.json_schema.json_schema))

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float]) -> dict[str, float]:
        """Keys are token ids (decimal strings, as JSON keys are), values in [-100, 100]; ids past the vocabulary
        are refused by the gateway, which knows it."""
        for key, value in bias.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {value}")
        return bias

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int, info: ValidationInfo) -> int:
        seed = info.data.get("seed")
        if seed is not None and seed + n > 2**64:
            raise ValueError(f"the choices' seeds seed .. seed + n - 1 must be below 2^64 (seed {seed})")
        return n

    @field_validator("session_id")
    @classmethod
    def _one_session(cls, session_id: str | None, info: ValidationInfo) -> str | None:
        if session_id and info.data.get("n", 1) > 1:
            raise ValueError("n > 1 starts n new sessions: it cannot continue one")
        return session_id

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def new_tokens(self) -> int:
        return self.max_tokens or 0  # 0: the session's or the gateway's default

    @property
    def num_top_logprobs(self) -> int | None:
        """None: no logprobs; else the top tokens to list at each position."""
        raise NotImplementedError

    def set_input(self, request: gateway_pb2.GenerateRequest) -> None:
        raise NotImplementedError

    def to_generate_requests(self, request_id: str) -> list[gateway_pb2.GenerateRequest]:
        """One GenerateRequest per choice: n independent sessions, choice i with seed + i (each its own random
        seed when none is given), so each choice alone is what n = 1 with that seed gives."""
        first = self.to_generate_request(request_id)
        requests = [first]
        for i in range(1, self.n):
            request = gateway_pb2.GenerateRequest()
            request.CopyFrom(first)
            request.request_id = f"{request_id}-{i}"
            if self.seed is not None:
                request.params.seed = self.seed + i
            requests.append(request)
        return requests

    def to_generate_request(self, request_id: str) -> gateway_pb2.GenerateRequest:
        request = gateway_pb2.GenerateRequest(session_id=self.session_id or "", request_id=request_id)
        self.set_input(request)
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        bias = {int(t): b for t, b in (self.logit_bias or {}).items()}
        params = build_params(
            self.method,
            self.shape,
            self.temperature,
            self.top_k,
            self.top_p,
            self.new_tokens,
            stops,
            self.seed,
            bias,
            self.num_top_logprobs,
            verification=self.verification,
            adaptive_shape=self.adaptive_shape,
            penalties=(self.presence_penalty, self.frequency_penalty, self.repetition_penalty),
            logprobs_mode=self.logprobs_mode,
        )
        if params is not None:
            request.params.CopyFrom(params)
        constraint = self.constraint()
        if constraint is not None:  # the gateway sets where the text begins
            request.params.constraint.CopyFrom(constraint_to_proto(constraint, 0))
        return request


class CompletionRequest(_GenerateBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request, got {len(prompt)}")
            return prompt[0]
        return prompt

    @field_validator("echo", "suffix", "best_of")
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        allowed = {"echo": False, "best_of": 1}.get(info.field_name)
        return value if value is None else _only(value, allowed, info.field_name)

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    def set_input(self, request: gateway_pb2.GenerateRequest) -> None:
        if isinstance(self.prompt, str):
            request.text = self.prompt
        else:
            request.token_ids.ids.extend(self.prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


ROLES = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(_Body):
    """OpenAI's message, as OpenAI checks it: a known role, content required (an assistant's may be absent
    only beside tool_calls, which are not supported), a tool message names its tool_call_id."""

    role: ROLES
    content: str | list[TextPart]
    name: str | None = None  # the participant's name: passed to the chat template (most ignore it)
    tool_call_id: str | None = Field(None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")  # absent: the role was refused already
        if role == "tool" and value is None:
            raise ValueError("required in a tool message")
        if role not in (None, "tool") and value is not None:
            raise ValueError("only in a tool message")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content

    def to_proto(self) -> gateway_pb2.ChatMessage:
        return gateway_pb2.ChatMessage(role=self.role, content=self.text(), name=self.name or "")


class ChatCompletionRequest(_GenerateBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 0

    def set_input(self, request: gateway_pb2.GenerateRequest) -> None:
        request.messages.messages.extend(m.to_proto() for m in self.messages)


class TokenizeCompletionRequest(_Body):
    """vLLM's /tokenize body for a prompt. add_special_tokens defaults to false: the ids /v1/completions uses."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """vLLM's /tokenize body for messages: their chat template rendering, as /v1/chat/completions makes it."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes its own, as for /v1/chat/completions
    return_token_strs: bool = False

    @field_validator("add_special_tokens")
    @classmethod
    def _template_only(cls, value: bool) -> bool:
        return _only(value, False, "add_special_tokens")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------
# Replies


def usage(started: gateway_pb2.GenerationStarted, finished: list[gateway_pb2.GenerationFinished]) -> dict[str, int]:
    """prompt_tokens: what this request's input appended (the prompt, or a continuation's new turn), counted once
    (as OpenAI counts it for n choices); completion_tokens: every choice's."""
    prompt, completion = started.input_length_tokens, sum(f.num_new_tokens for f in finished)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_card(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's max_model_len (GatewayEngine.max_model_len)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "rsd", "max_model_len": max_model_len}


_BODIES = (StreamOptions, CompletionRequest, TextPart, ChatMessage, ChatCompletionRequest)
_BODIES += (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)
_FIELDS = frozenset(name for body in _BODIES for name in body.model_fields)


def param_of(error: Mapping[str, Any]) -> str | None:
    """A pydantic error's location as the parameter a client sent: ("messages", 0, "role") -> "messages[0].role";
    the union members pydantic names after it ("prompt", "list[int]", 3) are left out, an unknown field is named."""
    param, loc = "", error["loc"]
    for i, part in enumerate(loc):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _FIELDS or (error["type"] == "extra_forbidden" and i == len(loc) - 1):
            param += f".{part}" if param else part
        else:
            break
    return param or None


@dataclass
class SpecDecodeMetrics:
    """vLLM's per-request `metrics.speculative_decoding` (its --per-request-spec-decode-metrics summary), from the
    StepStats of one turn. A step verifies one draft tree, so where vLLM drafts a chain of num_spec_tokens:
        num_spec_steps             target calls (steps) of the turn
        num_draft_tokens           drafted tree nodes (a chain's k per step; a tree drafts more)
        num_accepted_draft_tokens  draft tokens the acceptance rule kept
        draft_acceptance_rate      accepted / drafted (0 without drafts)
        mean_acceptance_length     tokens per step: 1 (the correction or bonus token) + accepted / steps
        num_spec_tokens            the tree's depth L: the most draft tokens one step can accept
        acceptance_histogram       [L + 1]: [j] = the steps that accepted exactly j draft tokens
    Field names and meanings: vLLM PR 48915 (vllm-project/vllm), whose chains make num_draft_tokens = k * steps.
    rsd's own: verification (the turn's params.verification) and acceptance_rule (the rule that judged the
    trees, as the verifier's StepStats name it: e.g. "traversal_with_replacement", or "greedy" at T = 0)."""

    depth: int
    verification: str = ""
    rule: str = ""
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    histogram: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, params: common_pb2.GenerationParams) -> SpecDecodeMetrics:
        depth = parse_method(params.method.name, params.method.shape).depth if params.method.name else 0
        return cls(depth, params.verification or "token", histogram=[0] * (depth + 1))

    def observe(self, stats: common_pb2.StepStats) -> None:
        self.num_steps += 1
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        self.histogram.extend([0] * (stats.num_accepted_tokens + 1 - len(self.histogram)))
        self.histogram[stats.num_accepted_tokens] += 1
        self.rule = stats.verifier.rule or self.rule

    def body(self) -> dict[str, Any]:
        steps, drafted, accepted = self.num_steps, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "speculative_decoding": {
                "mean_acceptance_length": 1 + accepted / steps if steps else 0.0,
                "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
                "acceptance_histogram": list(self.histogram),
                "num_spec_steps": steps,
                "num_accepted_draft_tokens": accepted,
                "num_draft_tokens": drafted,
                "num_spec_tokens": self.depth,
                "verification": self.verification,
                "acceptance_rule": self.rule,
            }
        }


_MIN_LOGPROB = -9999.0  # JSON has no -inf (a token the model rules out): vLLM's floor too

# One token of a choice's logprobs: (its text, its logprob, the top tokens' (text, logprob) at its position).
Entry = tuple[str, float, list[tuple[str, float]]]


@dataclass
class Logprobs:
    """A choice's `logprobs` from its TokenDeltas' TokenLogprobs (the target's log-probabilities, or the figures
    of the request's logprobs_mode: rsd.logprobs), in OpenAI's shapes. A token's text is the tokenizer's decoding
    of that one id.
        chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
        completions  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}: text_offset is
                     where each token's text starts in the completion, counted over the chunks of a stream"""

    chat: bool
    decode: Callable[[list[int]], str]
    text_offset: int = 0

    def entries(self, delta: gateway_pb2.TokenDelta) -> list[Entry]:
        if not delta.HasField("logprobs"):
            return []
        lp = token_logprobs_from_proto(delta.logprobs, len(delta.token_ids))
        entries = []
        for row, (token, logprob) in enumerate(zip(delta.token_ids, lp.logprobs.tolist(), strict=True)):
            top = zip(lp.top_ids[row].tolist(), lp.top_logprobs[row].tolist(), strict=True)
            alternatives = [(self.decode([t]), max(v, _MIN_LOGPROB)) for t, v in top]
            entries.append((self.decode([token]), max(logprob, _MIN_LOGPROB), alternatives))
        return entries

    def body(self, entries: list[Entry]) -> dict[str, Any]:
        if self.chat:

            def item(token: str, logprob: float) -> dict[str, Any]:
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            content = [{**item(t, v), "top_logprobs": [item(s, x) for s, x in top]} for t, v, top in entries]
            return {"content": content}
        offsets = []
        for token, _, _ in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {
            "tokens": [t for t, _, _ in entries],
            "token_logprobs": [v for _, v, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries],
            "text_offset": offsets,
        }


@dataclass
class Reply:
    """The reply objects of one request: a whole completion, or its stream's chunks. Each carries the
    session id (`session_id`, not OpenAI's): send it back as an extra field to continue the session; with
    n > 1 choices, `session_ids` lists each choice's session."""

    chat: bool
    request_id: str
    model: str
    session_id: str  # choice 0's
    spec: SpecDecodeMetrics  # fed each step's stats; in the whole reply and the stream's last chunk
    include_usage: bool = False
    session_ids: list[str] = field(default_factory=list)  # every choice's, when n > 1 (`session_ids`, not OpenAI's)
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, kind: str) -> dict[str, Any]:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.request_id}", "object": kind, "created": self.created, "model": self.model}

    def _sessions(self) -> dict[str, Any]:
        many = {"session_ids": self.session_ids} if len(self.session_ids) > 1 else {}
        return {"session_id": self.session_id, **many}

    def whole(self, ends: list[tuple[str, str, dict[str, Any] | None]], token_usage: dict[str, int]) -> dict[str, Any]:
        """ends: each choice's (text, finish reason, logprobs object or None)."""
        choices = []
        for index, (text, finish_reason, logprobs) in enumerate(ends):
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": index, "text": text}
            choice.update(logprobs=logprobs, finish_reason=finish_reason)
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        body = {**self._head(kind), "choices": choices, "usage": token_usage, **self._sessions()}
        return {**body, "metrics": self.spec.body()}

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        first: bool = False,
        last: bool = False,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        """logprobs: the chunk's tokens' logprobs object (Logprobs.body), None when not asked or no tokens."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        body.update(self._sessions())
        return {**body, "metrics": self.spec.body()} if last else body

    def usage_chunk(self, token_usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk when the client asked for usage (stream_options.include_usage)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {**self._head(kind), "choices": [], "usage": token_usage, **self._sessions()}
        return {**body, "metrics": self.spec.body()}

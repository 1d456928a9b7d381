"""A Generate request before anything is stored: its checks (RequestError names the field), its input as token ids
(text, token ids or chat messages) and its params (defaults, merge, validation, the services' context length).
Params are stored in the session as a JSON dict and travel as GenerationParams; sessions and finish reasons are
converted for the wire here too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig
from gateway.errors import ContextLengthExceeded, RequestError
from gateway.store.session import SessionRecord, SessionStatus
from rsd.constraint import Constraint
from rsd.methods import DEFAULT_SHAPES
from rsd.sampling import SamplingParams
from rsd.shape_control import adaptive_family
from rsd_service.registry import ServiceInfo, check_id
from rsd_wire import common_pb2, gateway_pb2
from rsd_wire.convert import (
    constraint_from_proto,
    constraint_to_proto,
    logprobs_mode_from_proto,
    num_top_logprobs,
    parse_method,
    rule_from_proto,
)

MAX_REQUEST_ID = 128
MAX_STOP_CHARS = 256
PENALTY_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}  # off


# ---------------------------------------------------------------------------------------------
# The request and its input


def check_session_id(session_id: str) -> None:
    try:
        check_id("session_id", session_id)
    except ValueError as e:
        raise RequestError(f"session_id: {e}", "session_id") from None


def check_request(request: gateway_pb2.GenerateRequest) -> None:
    if len(request.request_id) > MAX_REQUEST_ID:
        raise RequestError(f"request_id: at most {MAX_REQUEST_ID} characters")
    has_input = request.WhichOneof("input") is not None
    if request.session_id:
        check_session_id(request.session_id)
    elif not has_input:
        raise RequestError("a new session needs an input (text, token_ids or messages)")
    if has_input and request.HasField("resume_from_position"):
        raise RequestError("resume_from_position: only on a resume (a session_id without input)")


class InputReader:
    """A request's input -> the turn's token ids, within max_prompt_tokens."""

    def __init__(self, config: GatewayConfig, tokenizer: Any, chat: ChatTemplate):
        self.config, self.tokenizer, self.chat = config, tokenizer, chat
        self.vocab_size = len(tokenizer)

    def token_ids(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        if which == "text":
            if not request.text:
                raise RequestError("text: must not be empty", "text")
            ids = list(self.tokenizer.encode(request.text, add_special_tokens=False))
            if not ids:
                raise RequestError("text: encodes to no tokens", "text")
        elif which == "messages":
            messages = [chat_message(m) for m in request.messages.messages]
            try:
                ids = self.chat.encode(messages, continuation=bool(request.session_id))
            except ValueError as e:
                raise RequestError(f"messages: {e}", "messages") from None
        else:
            ids = list(request.token_ids.ids)
            if not ids:
                raise RequestError("token_ids.ids: must not be empty", "token_ids.ids")
            bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"token_ids.ids: token id {bad} is outside [0, {self.vocab_size})", "token_ids.ids")
        if len(ids) > self.config.max_prompt_tokens:
            limit = self.config.max_prompt_tokens
            raise ContextLengthExceeded(f"input has {len(ids)} tokens, more than max_prompt_tokens {limit}", which)
        return ids


def chat_message(message: gateway_pb2.ChatMessage) -> dict[str, str]:
    """A ChatMessage as the chat template reads it: role and content, and name when there is one."""
    rendered = {"role": message.role, "content": message.content}
    if message.name:
        rendered["name"] = message.name
    return rendered


# ---------------------------------------------------------------------------------------------
# Params


def default_params(config: GatewayConfig) -> dict[str, Any]:
    return {
        "temperature": config.default_temperature,
        "top_k": 0,
        "top_p": 1.0,
        "method": config.default_method,
        "shape": config.default_shape,
        "max_new_tokens": config.default_max_new_tokens,
        "stop_sequences": [],
        "seed": None,
        "logit_bias": [],  # [[token id, bias], ...] in increasing id (JSON has no int keys)
        **PENALTY_DEFAULTS,
        "logprobs": False,
        "top_logprobs": 0,
        "logprobs_mode": config.logprobs_mode,  # kept by a continuation that does not set it
        "verification": config.verification,  # kept by a continuation that does not set it
        "adaptive_shape": False,
        "constraint": None,  # structured output: [kind, value] (rsd.constraint.Constraint), the turn's own
    }


def merge_params(base: Mapping[str, Any], msg: common_pb2.GenerationParams | None) -> dict[str, Any]:
    """`base` with the fields present in `msg` replacing it (a new session's base is the defaults). logprobs and
    top_logprobs are the turn's own: absent, they are off."""
    params = dict(base)
    params["logprobs"] = bool(msg is not None and msg.logprobs)
    params["top_logprobs"] = msg.top_logprobs if msg is not None else 0
    params["adaptive_shape"] = bool(msg is not None and msg.adaptive_shape)  # the turn's own too
    params["constraint"] = None
    if msg is None:
        return params
    try:
        constraint = constraint_from_proto(msg)
    except ValueError as e:
        raise RequestError(str(e), "params.constraint") from None
    if constraint is not None:
        params["constraint"] = [constraint[0].kind, constraint[0].value]
    if msg.HasField("sampling"):
        s = msg.sampling
        if s.HasField("temperature"):
            params["temperature"] = s.temperature
        params["top_k"] = s.top_k
        if s.HasField("top_p"):
            params["top_p"] = s.top_p
        params["logit_bias"] = [[t, b] for t, b in sorted(s.logit_bias.items())]
        params["presence_penalty"], params["frequency_penalty"] = s.presence_penalty, s.frequency_penalty
        if s.HasField("repetition_penalty"):
            params["repetition_penalty"] = s.repetition_penalty
    if msg.HasField("method"):
        name = msg.method.name or params["method"]
        same = params["shape"] if name == params["method"] else DEFAULT_SHAPES.get(name, "")
        shape = msg.method.shape or same
        params["method"], params["shape"] = name, shape
    if msg.max_new_tokens:
        params["max_new_tokens"] = msg.max_new_tokens
    if msg.stop_sequences:
        params["stop_sequences"] = list(msg.stop_sequences)
    if msg.HasField("seed"):
        params["seed"] = msg.seed
    if msg.verification:
        params["verification"] = msg.verification
    if msg.logprobs_mode:
        params["logprobs_mode"] = msg.logprobs_mode
    return params


def sampling_params(params: Mapping[str, Any]) -> SamplingParams:
    """The stored params' sampling transform (ValueError when a value is out of range)."""
    bias = tuple((int(t), float(b)) for t, b in params.get("logit_bias", []))
    penalties = {k: float(params.get(k, v)) for k, v in PENALTY_DEFAULTS.items()}  # sessions stored before them: off
    return SamplingParams(float(params["temperature"]), int(params["top_k"]), float(params["top_p"]), bias, **penalties)


def validate_params(params: Mapping[str, Any], config: GatewayConfig, vocab_size: int) -> None:
    try:
        sampling = sampling_params(params)
        sampling.check_vocab(vocab_size)
    except ValueError as e:
        raise RequestError(f"params.sampling: {e}", "params.sampling") from None
    try:  # the one check of logprobs' bounds, the services' own (rsd_wire.convert)
        num_top_logprobs(params_to_proto(params))
    except ValueError as e:
        raise RequestError(str(e), "params.top_logprobs") from None
    try:
        logprobs_mode_from_proto(params_to_proto(params))
    except ValueError as e:
        raise RequestError(str(e), "params.logprobs_mode") from None
    try:
        method = parse_method(params["method"], params["shape"])
    except ValueError as e:
        raise RequestError(f"params.method: {e}", "params.method") from None
    try:  # the services would refuse it at the run's start; refused here, before anything is stored
        rule_from_proto(params_to_proto(params), sampling, method)
    except ValueError as e:
        raise RequestError(str(e), "params.verification") from None
    if params.get("adaptive_shape"):
        try:
            adaptive_family(method)
        except ValueError as e:
            raise RequestError(f"params.adaptive_shape: {e}", "params.adaptive_shape") from None
    if not 1 <= params["max_new_tokens"] <= config.max_new_tokens_limit:
        raise RequestError(
            f"params.max_new_tokens: must be in [1, {config.max_new_tokens_limit}], got {params['max_new_tokens']}",
            "params.max_new_tokens",
        )
    stops = params["stop_sequences"]
    if len(stops) > config.max_stop_sequences:
        raise RequestError(
            f"params.stop_sequences: at most {config.max_stop_sequences}, got {len(stops)}", "params.stop_sequences"
        )
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        message = f"params.stop_sequences: each must have 1..{MAX_STOP_CHARS} characters"
        raise RequestError(message, "params.stop_sequences")


def check_context_length(num_context: int, params: Mapping[str, Any], services: Sequence[ServiceInfo]) -> None:
    """Refuse at the edge a turn the services would refuse mid-stream: its `num_context` tokens (committed
    + input) + max_new_tokens + one draft tree (the method's nodes, node 0 included) over the smallest
    max_len the services advertise (ServiceInfo.max_len; 0, not advertised, as in static lists: unchecked).
    That is the drafter's own bound; the verifier needs at most as much. params: validated already."""
    limits = [s for s in services if s.max_len > 0]
    if not limits:
        return
    nodes = parse_method(params["method"], params["shape"]).max_draft_tokens + 1
    max_new = int(params["max_new_tokens"])
    need = num_context + max_new + nodes
    smallest = min(limits, key=lambda s: (s.max_len, s.role))
    if need > smallest.max_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {smallest.max_len} tokens ({smallest.role} "
            f"{smallest.service_id} max_len), but the turn needs {need}: {num_context} input and session tokens, "
            f"{max_new} new tokens and {nodes} draft tree nodes ({params['method']} {params['shape']})"
        )


# ---------------------------------------------------------------------------------------------
# On the wire: params, sessions, finish reasons

STATUS_TO_PROTO = {
    SessionStatus.PENDING: gateway_pb2.SESSION_STATUS_PENDING,
    SessionStatus.RUNNING: gateway_pb2.SESSION_STATUS_RUNNING,
    SessionStatus.FINISHED: gateway_pb2.SESSION_STATUS_FINISHED,
    SessionStatus.CANCELLED: gateway_pb2.SESSION_STATUS_CANCELLED,
    SessionStatus.FAILED: gateway_pb2.SESSION_STATUS_FAILED,
}


def finish_reason_name(reason: int) -> str:
    """FINISH_REASON_EOS -> "eos": how the store keeps it (the store knows no protos)."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def finish_reason_value(name: str) -> int:
    """ "eos" -> FINISH_REASON_EOS; "" (not finished, or failed) -> FINISH_REASON_UNSPECIFIED."""
    return common_pb2.FinishReason.Value(f"FINISH_REASON_{name.upper()}") if name else 0


def params_to_proto(params: Mapping[str, Any]) -> common_pb2.GenerationParams:
    msg = common_pb2.GenerationParams(
        sampling=common_pb2.SamplingParams(
            temperature=float(params["temperature"]),
            top_k=int(params["top_k"]),
            top_p=float(params["top_p"]),
            logit_bias={int(t): float(b) for t, b in params.get("logit_bias", [])},
            **{k: float(params.get(k, v)) for k, v in PENALTY_DEFAULTS.items()},
        ),
        method=common_pb2.Method(name=params["method"], shape=params["shape"]),
        max_new_tokens=int(params["max_new_tokens"]),
        stop_sequences=list(params["stop_sequences"]),
        logprobs=bool(params.get("logprobs", False)),
        top_logprobs=int(params.get("top_logprobs", 0)),
        adaptive_shape=bool(params.get("adaptive_shape", False)),
    )
    if params.get("seed") is not None:
        msg.seed = int(params["seed"])
    msg.verification = params.get("verification", "token")  # sessions stored before the field: the default
    msg.logprobs_mode = params.get("logprobs_mode", "")  # sessions stored before the field: "" (raw_logprobs)
    if params.get("constraint"):  # the constrained text begins at the turn's first new token
        constraint = Constraint(*params["constraint"])
        msg.constraint.CopyFrom(constraint_to_proto(constraint, int(params.get("turn_start", 0))))
    return msg


def session_to_proto(record: SessionRecord, include_token_ids: bool) -> gateway_pb2.Session:
    msg = gateway_pb2.Session(
        session_id=record.session_id,
        status=STATUS_TO_PROTO[record.status],
        prompt_length_tokens=len(record.prompt_ids),
        committed_length_tokens=record.committed_length,
        drafter_id=record.drafter_id,
        verifier_id=record.verifier_id,
        kv_location=common_pb2.KvLocation(
            verifier_id=record.kv.verifier_id, length_tokens=record.kv.length, epoch=record.kv.epoch
        ),
        created_unix_ms=record.created_unix_ms,
        updated_unix_ms=record.updated_unix_ms,
        last_finish_reason=finish_reason_value(record.finish_reason),
    )
    if record.params:
        msg.params.CopyFrom(params_to_proto(record.params))
    if include_token_ids:
        msg.prompt_token_ids.extend(record.prompt_ids)
        msg.committed_token_ids.extend(record.committed_ids)
    return msg

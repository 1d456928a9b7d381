"""A Generate request before anything is stored: its checks (RequestError names the field) and its input as
token ids (text, token ids or chat messages)."""

from __future__ import annotations

from typing import Any

from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig
from gateway.errors import ContextLengthExceeded, RequestError
from rsd_service.registry import check_id
from rsd_wire import gateway_pb2

MAX_REQUEST_ID = 128


def check_session_id(session_id: str) -> None:
    try:
        check_id("session_id", session_id)
    except ValueError as e:
        raise RequestError(f"session_id: {e}") from None


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
                raise RequestError("text: must not be empty")
            ids = list(self.tokenizer.encode(request.text, add_special_tokens=False))
            if not ids:
                raise RequestError("text: encodes to no tokens")
        elif which == "messages":
            messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            try:
                ids = self.chat.encode(messages, continuation=bool(request.session_id))
            except ValueError as e:
                raise RequestError(f"messages: {e}") from None
        else:
            ids = list(request.token_ids.ids)
            if not ids:
                raise RequestError("token_ids.ids: must not be empty")
            bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"token_ids.ids: token id {bad} is outside [0, {self.vocab_size})")
        if len(ids) > self.config.max_prompt_tokens:
            limit = self.config.max_prompt_tokens
            raise ContextLengthExceeded(f"input has {len(ids)} tokens, more than max_prompt_tokens {limit}")
        return ids

"""A small synchronous client of the rsd gateway.

    with RsdClient("127.0.0.1:7000") as client:
        gen = client.generate("def fib(n):", method="rsd_s", shape="3x4", temperature=0.0, max_new_tokens=32)
        for delta in gen:                       # gateway_pb2.TokenDelta, as they are committed
            print(delta.text, end="", flush=True)
        print(gen.finished.reason, gen.session_id)
        more = client.generate(" # and now tests", session_id=gen.session_id)   # next turn, same session
        chat = client.generate(messages=[("user", "Write fib in Python")])       # the target's chat template
        client.get_session(gen.session_id).kv_location

Errors come as grpc.RpcError with the gateway's status code and reason. A gateway with TLS and a token:

    RsdClient("gw.example:7000", security=ClientSecurity(tls_ca="ca.pem", token=token))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import grpc

from rsd_service.security import ClientSecurity, sync_channel
from rsd_wire import common_pb2, gateway_pb2, gateway_pb2_grpc


class Generation:
    """The stream of one Generate call: iterate for TokenDelta; then `finished` holds the summary."""

    def __init__(self, call: grpc.Call):
        self._call = call
        self.session_id = ""
        self.started: gateway_pb2.GenerationStarted | None = None
        self.finished: gateway_pb2.GenerationFinished | None = None
        self.token_ids: list[int] = []
        self.text = ""
        self.steps: list[common_pb2.StepStats] = []

    def __iter__(self) -> Iterator[gateway_pb2.TokenDelta]:
        for event in self._call:
            self.session_id = event.session_id
            kind = event.WhichOneof("event")
            if kind == "started":
                self.started = event.started
            elif kind == "delta":
                self.token_ids.extend(event.delta.token_ids)
                self.text += event.delta.text
                if event.delta.HasField("stats"):
                    self.steps.append(event.delta.stats)
                yield event.delta
            elif kind == "finished":
                self.finished = event.finished

    def wait(self) -> Generation:
        """Consume the whole stream."""
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Drop the stream (the turn keeps running on the gateway; use RsdClient.cancel to stop it)."""
        self._call.cancel()


class RsdClient:
    def __init__(self, address: str, timeout_s: float | None = None, security: ClientSecurity | None = None):
        """security: TLS (its tls_ca, and a client certificate for mTLS) and the gateway's bearer token."""
        self.address, self.timeout_s = address, timeout_s
        security = security or ClientSecurity()
        self._channel = sync_channel(address, security)
        self._metadata = security.metadata() or None
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def __enter__(self) -> RsdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[tuple[str, str]] | None = None,
        session_id: str = "",
        method: str | None = None,
        shape: str | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        max_new_tokens: int = 0,
        stop: Sequence[str] = (),
        seed: int | None = None,
        verification: str | None = None,
        resume_from_position: int | None = None,
        request_id: str = "",
        logit_bias: Mapping[int, float] | None = None,
        top_logprobs: int | None = None,
        adaptive_shape: bool = False,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logprobs_mode: str | None = None,
    ) -> Generation:
        """Start (no session_id), continue (session_id and input) or resume (session_id, no input).
        The input: prompt (text), token_ids, or messages as (role, content) pairs (chat template).
        Parameters left None take the gateway's defaults (new session) or the session's (continuation).
        top_logprobs (0..20): each TokenDelta carries its tokens' logprobs with that many top tokens each;
        logprobs_mode: which figures (rsd.logprobs; None: the gateway's --logprobs-mode, or the session's).
        verification: "token" (the default), "traversal", "block" or "coupled" (rsd.methods; the verifier applies it).
        adaptive_shape: the drafter picks each step's shape up to `shape` (rsd.shape_control); this turn only."""
        request = gateway_pb2.GenerateRequest(session_id=session_id, request_id=request_id)
        if sum(x is not None for x in (prompt, token_ids, messages)) > 1:
            raise ValueError("give one of prompt, token_ids and messages")
        if prompt is not None:
            request.text = prompt
        elif token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        elif messages is not None:
            request.messages.messages.extend(gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages)
        if resume_from_position is not None:
            request.resume_from_position = resume_from_position
        params = build_params(
            method,
            shape,
            temperature,
            top_k,
            top_p,
            max_new_tokens,
            stop,
            seed,
            logit_bias,
            top_logprobs,
            verification,
            adaptive_shape,
            penalties=(presence_penalty, frequency_penalty, repetition_penalty),
            logprobs_mode=logprobs_mode,
        )
        if params is not None:
            request.params.CopyFrom(params)
        return Generation(self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata))

    def cancel(self, session_id: str) -> gateway_pb2.CancelResponse:
        request = gateway_pb2.CancelRequest(session_id=session_id)
        return self._stub.Cancel(request, timeout=self.timeout_s, metadata=self._metadata)

    def get_session(self, session_id: str, include_token_ids: bool = False) -> gateway_pb2.Session:
        request = gateway_pb2.GetSessionRequest(session_id=session_id, include_token_ids=include_token_ids)
        return self._stub.GetSession(request, timeout=self.timeout_s, metadata=self._metadata)


def build_params(
    method: str | None = None,
    shape: str | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    max_new_tokens: int = 0,
    stop: Sequence[str] = (),
    seed: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    top_logprobs: int | None = None,
    verification: str | None = None,
    adaptive_shape: bool = False,
    *,
    penalties: tuple[float | None, float | None, float | None] = (None, None, None),
    logprobs_mode: str | None = None,
) -> common_pb2.GenerationParams | None:
    """GenerationParams with only the given fields present (None when nothing is given). top_logprobs given:
    logprobs on, with that many top tokens. penalties: (presence, frequency, repetition), None = not given."""
    params = common_pb2.GenerationParams(max_new_tokens=max_new_tokens, stop_sequences=list(stop))
    if top_logprobs is not None:
        params.logprobs, params.top_logprobs = True, top_logprobs
    presence, frequency, repetition = penalties
    if (
        temperature is not None
        or top_k is not None
        or top_p is not None
        or logit_bias
        or any(v is not None for v in penalties)
    ):
        params.sampling.top_k = top_k or 0
        params.sampling.presence_penalty = presence or 0.0
        params.sampling.frequency_penalty = frequency or 0.0
        if repetition is not None:
            params.sampling.repetition_penalty = repetition
        params.sampling.logit_bias.update(logit_bias or {})
        if temperature is not None:
            params.sampling.temperature = temperature
        if top_p is not None:
            params.sampling.top_p = top_p
    if method is not None or shape is not None:
        params.method.name, params.method.shape = method or "", shape or ""
    if seed is not None:
        params.seed = seed
    params.verification = verification or ""
    params.adaptive_shape = adaptive_shape
    params.logprobs_mode = logprobs_mode or ""
    given = params.HasField("sampling") or params.HasField("method") or params.HasField("seed") or params.logprobs
    return params if given or max_new_tokens or stop or verification or adaptive_shape or logprobs_mode else None

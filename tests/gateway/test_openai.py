"""Chat in the gRPC API and the gateway's OpenAI-compatible HTTP API (gateway.openai), with the official
`openai` client, against real services: a verifier and a drafter (tiny Qwen2 pair, real grpc.aio servers
on loopback) that register in a real redis-server, and gateways that find them there and serve gRPC and
HTTP from one engine. Every HTTP answer is checked against what the gRPC API gives for the same request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import http.client
import json
import ssl
import threading
import time
from dataclasses import dataclass
from importlib import metadata

import grpc
import httpx2 as httpx
import openai
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig
from gateway.server import create_server
from gateway.store.memory_store import MemorySessionStore
from rsd.sampling import SamplingParams
from rsd_service.client import RsdClient
from rsd_service.security import ClientSecurity
from rsd_tools.launcher import ClusterSecurity
from rsd_tools.tiny import word_tokenizer
from rsd_wire import common_pb2, gateway_pb2
from rsd_wire.convert import token_logprobs_from_proto
from tests.fixtures.pki import make_pki
from tests.fixtures.services import penalised_greedy, processed_scores
from tests.fixtures.stack import start_registered_services, start_stack
from verifier_service.config import VerifierConfig
from verifier_service.server import create_server as create_verifier

TOKEN = "s3cret-token"
MODEL = "rsd-tiny"
PROMPT = "w2 w10 w11 w12"
CHAT = [("system", "w3 w4"), ("user", "w5 w6 w7")]
RSD_C = {"method": "rsd_c", "shape": "2,2,1"}
FINISH = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_EOS: "stop"}


@dataclass
class Gateway:
    server: grpc.aio.Server
    handle: object
    address: str

    @property
    def base_url(self) -> str:
        return self.handle.http.base_url

    def grpc(self) -> RsdClient:
        return RsdClient(self.address, timeout_s=60, security=ClientSecurity(token=TOKEN))

    def openai(self, api_key: str = TOKEN) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def registry(loop, pair, redis_url):
    registry = {"redis_url": redis_url, "redis_namespace": f"rsd-test-openai-{time.monotonic_ns()}"}
    closers = loop.run(start_registered_services(pair, registry), timeout_s=120)
    yield registry
    for handle, server in closers:
        loop.run(handle.close(server, 0))


@pytest.fixture(scope="module")
def start_gateway(loop, registry, tiny_tokenizer):
    """start_gateway(**config) -> a Gateway (gRPC and HTTP, token TOKEN) over the registered services."""
    started = []

    def start(tokenizer=tiny_tokenizer, **config) -> Gateway:
        cfg = GatewayConfig(port=0, http_port=0, auth_token=TOKEN, served_model_name=MODEL, **registry, **config)
        server, port, handle = loop.run(create_server(cfg, tokenizer=tokenizer))
        started.append(Gateway(server, handle, f"127.0.0.1:{port}"))
        return started[-1]

    yield start
    for gw in started:
        loop.run(gw.handle.close(gw.server, 0))


@pytest.fixture(scope="module")
def gw(start_gateway) -> Gateway:
    return start_gateway()


def wait_until_done(gw: Gateway, session_id: str) -> gateway_pb2.Session:
    """The session once its turn has ended (the turn may still be stopping when the client returns)."""
    with gw.grpc() as client:
        while (session := client.get_session(session_id, include_token_ids=True)).status == (
            gateway_pb2.SESSION_STATUS_RUNNING
        ):
            time.sleep(0.05)
    return session


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# Chat in the gRPC API


def test_chat_template_end_of_turn_and_continuation():
    tok = word_tokenizer(64)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nw1<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatTemplate(tok)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert chat.end_of_turn_ids == [tok.eos_token_id, im_end]
    first = [{"role": "user", "content": "w5"}]
    reply = [{"role": "assistant", "content": "w9"}]
    more = [{"role": "user", "content": "w7"}]
    # A continuation after a turn that ended at <|im_end|> is the whole conversation's rendering.
    whole = chat.encode([*first, *reply, *more], continuation=False)
    assert chat.encode(first, False) + tok.encode("w9", add_special_tokens=False) + [im_end] + chat.encode(
        more, True
    ) == [*whole]
    assert chat.encode(more, True)[0] == im_start  # no second system prompt
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate(_without_template(tok)).encode(first, False)
    with pytest.raises(ValueError, match="empty"):
        chat.encode([], False)


def _without_template(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    return plain


def test_a_chat_turn_also_stops_at_the_end_of_turn_token(loop, pair, tiny_tokenizer):
    """The drafter is told to stop at eos and at the template's end of turn (here <pad>, id 0) for a chat
    turn, at eos alone for a text turn; tests/fixtures/stack.py's DrafterTap records the real drafter's runs."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = tok.chat_template.replace("<eos>", "<pad>")
    stack = start_stack(loop, (pair[0], pair[1], tok), MemorySessionStore())
    try:
        with stack.client() as client:
            gen = client.generate(messages=CHAT, temperature=0.0, max_new_tokens=3, seed=0).wait()
            client.generate("w9", session_id=gen.session_id, max_new_tokens=2).wait()
    finally:
        stack.stop()
    chat_run, text_run = stack.drafters[0].runs
    assert list(chat_run.eos_token_ids) == [tok.eos_token_id, tok.pad_token_id]
    assert list(text_run.eos_token_ids) == [tok.eos_token_id]


def test_grpc_chat_renders_the_template_and_continues(gw, tiny_tokenizer):
    with gw.grpc() as client:
        gen = client.generate(messages=CHAT, temperature=0.0, max_new_tokens=8, seed=0).wait()
        session = client.get_session(gen.session_id, include_token_ids=True)
        assert list(session.prompt_token_ids) == chat_ids(tiny_tokenizer, CHAT)
        assert gen.started.input_length_tokens == len(session.prompt_token_ids)
        more = client.generate(messages=[("user", "w8")], session_id=gen.session_id, max_new_tokens=4).wait()
        after = client.get_session(gen.session_id, include_token_ids=True)
    appended = tiny_tokenizer.encode("<bos> user w8 <eos> <bos> assistant", add_special_tokens=False)
    committed = list(after.committed_token_ids)
    assert committed[: len(session.committed_token_ids)] == list(session.committed_token_ids)
    assert committed[len(session.committed_token_ids) :][: len(appended)] == appended
    assert more.started.input_length_tokens == len(appended) and len(more.token_ids) <= 4


def test_chat_without_a_template_is_invalid_argument(start_gateway, tiny_tokenizer):
    plain = start_gateway(tokenizer=_without_template(tiny_tokenizer))
    with plain.grpc() as client, pytest.raises(grpc.RpcError) as info:
        client.generate(messages=CHAT, max_new_tokens=4).wait()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in info.value.details()
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        plain.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}])


# ---------------------------------------------------------------------------------------------
# The HTTP API: the same text as gRPC


def test_models(gw):
    assert [m.id for m in gw.openai().models.list().data] == [MODEL]


def _completion_text(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, str, object, str]:
    """(text, finish_reason, usage, session id) of a completion, streamed or not."""
    if not stream:
        out = client.completions.create(model=MODEL, **kwargs)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage, out.session_id
    chunks = list(client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    finish = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finish[-1] is not None and not any(finish[:-1])
    return "".join(c.choices[0].text for c in chunks[:-1]), finish[-1], chunks[-1].usage, chunks[0].session_id


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_grpc_and_is_reproducible(gw, stream):
    kwargs = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.8, "seed": 11}
    text, finish, token_usage, session_id = _completion_text(gw.openai(), stream, extra_body=RSD_C, **kwargs)
    again, *_ = _completion_text(gw.openai(), stream, extra_body=RSD_C, **kwargs)
    with gw.grpc() as client:
        ref = client.generate(PROMPT, temperature=0.8, seed=11, max_new_tokens=16, **RSD_C).wait()
        session = client.get_session(session_id)
    assert text == again == ref.text and text.strip()
    assert finish == FINISH[ref.finished.reason]
    assert (token_usage.prompt_tokens, token_usage.completion_tokens) == (4, len(ref.token_ids))
    assert token_usage.total_tokens == 4 + len(ref.token_ids)
    assert session.params.method.name == "rsd_c" and session.params.seed == 11
    assert session.committed_length_tokens == 4 + len(ref.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_verification_extra_field_equals_grpc(gw, stream):
    """The extra body field `verification` (the openai client's extra_body) picks the rule as params.verification
    does over gRPC: a seeded T = 1 traversal completion equals the gRPC turn (which the gateway tests tie to the
    in-process generator), T = 0 block verification the greedy output; the metrics say which rule ran."""
    client = gw.openai()
    sampled = {"method": "rsd_c", "shape": "2,2,1", "verification": "traversal"}
    kwargs = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 13}
    text, *_ = _completion_text(client, stream, extra_body=sampled, **kwargs)
    whole = client.completions.create(model=MODEL, extra_body=sampled, **kwargs)
    block = {"method": "sd", "shape": "3", "verification": "block"}
    greedy_text, *_ = _completion_text(client, stream, extra_body=block, prompt=PROMPT, max_tokens=16, temperature=0)
    with gw.grpc() as grpc_client:
        ref = grpc_client.generate(PROMPT, temperature=1.0, seed=13, max_new_tokens=16, **sampled).wait()
        plain = grpc_client.generate(PROMPT, temperature=0.0, max_new_tokens=16, method="sd", shape="3").wait()
    assert text == whole.choices[0].text == ref.text and greedy_text == plain.text
    spec = whole.model_extra["metrics"]["speculative_decoding"]
    assert (spec["verification"], spec["acceptance_rule"]) == ("traversal", "traversal")
    with pytest.raises(openai.BadRequestError) as info:  # spectr drafts trees: block is not exact for it
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"method": "spectr", "verification": "block"})
    assert info.value.param == "verification" and "one chain only" in info.value.message
    # coupled: the target samples with the drafter's noise, so the seeded text is the same whatever the method
    coupled = [
        client.completions.create(model=MODEL, extra_body={"method": m, "verification": "coupled"}, **kwargs)
        for m in ("rsd_s", "sd")
    ]
    assert coupled[0].choices[0].text == coupled[1].choices[0].text
    assert coupled[0].model_extra["metrics"]["speculative_decoding"]["acceptance_rule"] == "coupled"
    with pytest.raises(openai.BadRequestError) as info:  # spectr's children are i.i.d., not Gumbel-Top-K
        client.completions.create(
            model=MODEL, prompt=PROMPT, extra_body={"method": "spectr", "verification": "coupled"}
        )
    assert info.value.param == "verification" and "Gumbel-Top-K" in info.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completion_equals_grpc_chat(gw, tiny_tokenizer, stream):
    messages = [{"role": r, "content": c} for r, c in CHAT]
    kwargs = {"model": MODEL, "messages": messages, "max_completion_tokens": 12, "temperature": 0.7, "seed": 5}
    client = gw.openai()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
        finish, token_usage = chunks[-2].choices[0].finish_reason, chunks[-1].usage
    else:
        out = client.chat.completions.create(**kwargs)
        assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
        text, finish, token_usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
    with gw.grpc() as grpc_client:
        ref = grpc_client.generate(messages=CHAT, temperature=0.7, seed=5, max_new_tokens=12).wait()
    assert text == ref.text and finish == FINISH[ref.finished.reason]
    assert token_usage.prompt_tokens == len(chat_ids(tiny_tokenizer, CHAT))
    assert token_usage.completion_tokens == len(ref.token_ids)


def test_stop_sequences(gw):
    client = gw.openai()
    full, *_ = _completion_text(client, False, prompt=PROMPT, max_tokens=16, temperature=0.0)
    stop = full.split()[3]  # a word the greedy text reaches
    for stream in (False, True):
        text, finish, *_ = _completion_text(client, stream, prompt=PROMPT, max_tokens=16, temperature=0.0, stop=stop)
        assert text == full[: full.index(stop)] and finish == "stop"


def test_token_id_prompt_and_session_continuation(gw, tiny_tokenizer):
    client = gw.openai()
    ids = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.0)
    text, *_ = _completion_text(client, False, prompt=PROMPT, max_tokens=6, temperature=0.0)
    assert first.choices[0].text == text
    more = client.completions.create(
        model=MODEL, prompt="w40", max_tokens=5, extra_body={"session_id": first.session_id}
    )
    assert more.session_id == first.session_id and more.usage.prompt_tokens == 1
    session = wait_until_done(gw, first.session_id)
    assert session.committed_length_tokens == 4 + 6 + 1 + more.usage.completion_tokens


# ---------------------------------------------------------------------------------------------
# Errors


def test_auth_failures_are_401(gw):
    with pytest.raises(openai.AuthenticationError, match="invalid token"):
        gw.openai(api_key="wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    reply = httpx.post(f"{gw.base_url}/completions", json={"model": MODEL, "prompt": PROMPT}, timeout=60)
    assert reply.status_code == 401 and "authorization" in reply.json()["error"]["message"]
    assert reply.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("change", "param", "reason"),
    [
        ({"n": 17}, "n", "n: Input should be less than or equal to 16"),
        ({"n": 2, "seed": 2**64 - 1}, "n", "seeds seed .. seed + n - 1 must be below 2^64"),
        ({"n": 2, "session_id": "abc"}, "session_id", "n > 1 starts n new sessions"),
        ({"temperature": -1}, "temperature", "temperature: Input should be greater than or equal to 0"),
        ({"temperature": float("nan")}, "temperature", "temperature: Input should be a finite number"),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"top_k": 0.5}, "top_k", "top_k: Input should be a valid integer"),
        ({"max_tokens": 100_000}, "max_tokens", "max_tokens: must be in [1, 2048], got 100000"),
        ({"prompt": ["w1", "w2"]}, "prompt", "one prompt per request"),
        ({"prompt": ""}, "prompt", "prompt: must not be empty"),
        ({"prompt": [4, 99_999]}, "prompt", "prompt: token id 99999 is outside [0, "),
        ({"stop": ["x"] * 9}, "stop", "stop: at most 8, got 9"),
        ({"stream": "maybe"}, "stream", "stream: Input should be a valid boolean"),
        ({"logprobs": 21}, "logprobs", "logprobs: Input should be less than or equal to 20"),
        ({"logit_bias": {"w5": 1}}, "logit_bias", "logit_bias: keys must be token ids, got 'w5'"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias", "the bias of token 5 must be in [-100, 100], got 100.5"),
        ({"logit_bias": {"99999": -1}}, "logit_bias", "logit_bias token id 99999 is outside the vocabulary"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty: Input should be less than or equal to 2"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty", "frequency_penalty: Input should be a finite"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty: Input should be greater than 0"),
        ({"bogus": 1}, "bogus", "bogus: Extra inputs are not permitted"),
        ({"model": None}, "model", "model: Field required"),
        ({"method": "beam"}, "method", "method: unknown method"),
        ({"verification": "bogus"}, "verification", "verification: unknown verification 'bogus'"),
        ({"verification": "block", "method": "rsd_c"}, "verification", "verification: block verification is exact"),
        ({"session_id": "no-such-session"}, None, "no-such-session"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(gw, change, param, reason):
    """The message begins with the parameter the client sent (never the engine's params.max_new_tokens or
    token_ids.ids), and `param` names it."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **change})  # NaN as JSON's NaN
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    reply = httpx.post(f"{gw.base_url}/completions", content=body, headers=headers, timeout=60)
    expected = 404 if change.get("session_id") == "no-such-session" else 400
    assert reply.status_code == expected, reply.text
    error = reply.json()["error"]
    assert reason in error["message"] and error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_over_the_context_length_is_400_context_length_exceeded(gw, path, stream):
    """prompt + max_tokens + the draft tree over the services' max_len (2048, from the registry): 400 with
    OpenAI's code context_length_exceeded, `stream: true` too: the answer is the error, not a 200 whose
    stream then fails. The official client raises BadRequestError with that code."""
    prompt = {"prompt": PROMPT} if path == "completions" else {"messages": [{"role": r, "content": c} for r, c in CHAT]}
    body = {"model": MODEL, "max_tokens": 2040, "stream": stream, "method": "sd", "shape": "4", **prompt}
    headers = {"authorization": f"Bearer {TOKEN}"}
    reply = httpx.post(f"{gw.base_url}/{path}", json=body, headers=headers, timeout=60)
    assert reply.status_code == 400 and reply.headers["content-type"] == "application/json", reply.text
    error = reply.json()["error"]
    assert (error["code"], error["type"]) == ("context_length_exceeded", "invalid_request_error")
    assert "maximum context length is 2048 tokens" in error["message"] and "2040 new tokens" in error["message"]
    assert error["param"] == ("prompt" if path == "completions" else "messages")
    client = gw.openai()
    create = client.completions.create if path == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as info:
        create(max_tokens=2040, stream=stream, model=MODEL, extra_body={"method": "sd", "shape": "4"}, **prompt)
    assert info.value.code == "context_length_exceeded"


def test_unknown_model_is_404(gw):
    with pytest.raises(openai.NotFoundError) as info:
        gw.openai().chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "w5"}])
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize("limit", ["max_running_turns", "max_concurrent_rpcs"])
def test_no_capacity_is_429(start_gateway, limit):
    small = start_gateway(**{limit: 1})
    client = small.openai()
    with client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2000, temperature=0.0, stream=True) as s:
        first = next(iter(s))
        with pytest.raises(openai.RateLimitError, match=limit):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert wait_until_done(small, first.session_id).status == gateway_pb2.SESSION_STATUS_CANCELLED


def test_body_over_max_message_bytes_is_413(start_gateway):
    small = start_gateway(max_message_bytes=4096)
    body = {"model": MODEL, "prompt": "w1 " * 2000, "max_tokens": 2}
    headers = {"authorization": f"Bearer {TOKEN}"}
    reply = httpx.post(f"{small.base_url}/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 413 and "4096" in reply.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as info:
        small.openai().completions.create(model=MODEL, prompt="w1 " * 2000, max_tokens=2)
    assert info.value.status_code == 413 and info.value.body["message"] == "body over max_message_bytes 4096"


# ---------------------------------------------------------------------------------------------
# Disconnects cancel the turn; nothing committed is lost


def _assert_cancelled_and_intact(gw: Gateway, session_id: str, prompt_len: int, streamed_text: str) -> None:
    session = wait_until_done(gw, session_id)
    assert session.status == gateway_pb2.SESSION_STATUS_CANCELLED
    generated = list(session.committed_token_ids)[prompt_len:]
    assert 0 < len(generated) < 2000
    with gw.grpc() as client:  # the same request run to that length gives exactly the committed tokens
        prompt_ids = list(session.committed_token_ids)[:prompt_len]
        ref = client.generate(token_ids=prompt_ids, temperature=0.0, max_new_tokens=len(generated)).wait()
        replay = client.generate(session_id=session_id, resume_from_position=prompt_len).wait()
    assert ref.token_ids == generated == replay.token_ids
    assert replay.text.startswith(streamed_text)


def test_stream_disconnect_cancels_the_turn(gw):
    client = gw.openai()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w5 w6"}],
        max_tokens=2000,
        temperature=0.0,
        stream=True,
    )
    chunks = [next(iter(stream)) for _ in range(3)]
    stream.close()
    session_id = chunks[0].session_id
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    prompt_len = wait_until_done(gw, session_id).prompt_length_tokens
    _assert_cancelled_and_intact(gw, session_id, prompt_len, text)


def test_waiting_client_disconnect_cancels_the_turn(gw):
    client = gw.openai()
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0.0)
    body = {"model": MODEL, "prompt": "w9", "max_tokens": 2000, "temperature": 0.0, "session_id": first.session_id}
    headers = {"authorization": f"Bearer {TOKEN}"}
    # The client gives up long before 2000 tokens are generated (the read timeout only ends the wait).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.base_url}/completions", json=body, headers=headers, timeout=httpx.Timeout(60, read=1.0))
    _assert_cancelled_and_intact(gw, first.session_id, 4 + 1 + 1, "")


def test_request_ids_are_echoed(gw):
    headers = {"authorization": f"Bearer {TOKEN}", "x-request-id": "my-call-7"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    reply = httpx.post(f"{gw.base_url}/completions", json=body, headers=headers, timeout=60)
    assert reply.headers["x-request-id"] == "my-call-7" and reply.json()["id"] == "cmpl-my-call-7"
    anonymous = httpx.post(f"{gw.base_url}/completions", json=body, headers=headers | {"x-request-id": ""}, timeout=60)
    assert anonymous.json()["id"] == f"cmpl-{anonymous.headers['x-request-id']}" != "cmpl-"


def test_https_with_client_certificates(start_gateway, tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    secure = start_gateway(tls_cert=pki["server"], tls_key=pki["server_key"], tls_ca=pki["ca"])
    assert secure.base_url.startswith("https://127.0.0.1:")
    trusted = ssl.create_default_context(cafile=pki["ca"])
    trusted.load_cert_chain(pki["client"], pki["client_key"])
    client = openai.OpenAI(
        base_url=secure.base_url, api_key=TOKEN, max_retries=0, http_client=httpx.Client(verify=trusted)
    )
    assert [m.id for m in client.models.list().data] == [MODEL]
    no_certificate = httpx.Client(verify=ssl.create_default_context(cafile=pki["ca"]))
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=secure.base_url, api_key=TOKEN, max_retries=0, http_client=no_certificate).models.list()


def test_http_calls_share_the_gateway_metrics(gw):
    """HTTP requests count in the gateway's own registry: by route and status, their tokens by method."""
    gw.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"method": "rsd_c"})
    anonymous = httpx.post(f"{gw.base_url}/completions", json={"model": MODEL, "prompt": PROMPT}, timeout=60)
    assert anonymous.status_code == 401
    text = generate_latest(gw.handle.metrics.registry).decode()
    assert 'rsd_gateway_requests_total{code="OK",method="/v1/completions"}' in text
    assert 'rsd_gateway_requests_total{code="UNAUTHENTICATED",method="/v1/completions"}' in text
    assert 'rsd_gateway_generated_tokens_total{method="rsd_c"}' in text


# ---------------------------------------------------------------------------------------------
# What clients of vLLM's or OpenAI's server expect


def _auth(**headers) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKEN}", **headers}


def test_nulls_read_as_the_defaults(gw):
    """`null` in a nullable field is its default, as OpenAI and vLLM read it (some clients send them)."""
    nulls = dict.fromkeys(["stream", "n", "presence_penalty", "frequency_penalty", "temperature", "seed", "stop"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 3, "logprobs": None, **nulls}
    reply = httpx.post(f"{gw.base_url}/chat/completions", json=body, headers=_auth(), timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["object"] == "chat.completion"  # stream: null is no stream
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "echo": None, "best_of": None, **nulls}
    assert httpx.post(f"{gw.base_url}/completions", json=completion, headers=_auth(), timeout=60).status_code == 200
    # the official client sends an explicit None as null too
    out = gw.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=None, presence_penalty=None)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_a_named_message_reaches_the_chat_template(start_gateway, tiny_tokenizer):
    """`name` (LangChain's HumanMessage(name=...)) is accepted and passed to the template with role and content."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = tok.chat_template.replace(
        "{{ message['content'] }}", "{{ message.get('name', '') }} {{ message['content'] }}"
    )
    named = start_gateway(tokenizer=tok)
    messages = [{"role": "user", "name": "w33", "content": "w5 w6"}]
    out = named.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "w33 w5 w6" in rendered
    assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize(
    ("message", "param", "reason"),
    [
        ({"role": "wizard", "content": "w5"}, "messages[0].role", "Input should be 'system', 'developer'"),
        ({"role": "tool", "content": "w5"}, "messages[0].tool_call_id", "required in a tool message"),
        ({"role": "user", "content": "w5", "tool_call_id": "t1"}, "messages[0].tool_call_id", "only in a tool"),
        ({"role": "user"}, "messages[0].content", "Field required"),
        ({"role": "assistant", "content": None}, "messages[0].content", "Field required"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, "messages[0].content", ""),
    ],
)
def test_messages_are_checked_as_openai_checks_them(gw, message, param, reason):
    body = {"model": MODEL, "messages": [message], "max_tokens": 2}
    reply = httpx.post(f"{gw.base_url}/chat/completions", json=body, headers=_auth(), timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and reason in error["message"]


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_chat_names_the_max_tokens_parameter_it_was_sent(gw, name):
    with pytest.raises(openai.BadRequestError) as info:
        gw.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], **{name: 9999})
    assert info.value.param == name and info.value.body["message"] == f"{name}: must be in [1, 2048], got 9999"


def test_every_openai_role_is_accepted(gw, tiny_tokenizer):
    messages = [
        {"role": "developer", "content": "w3"},
        {"role": "user", "content": [{"type": "text", "text": "w5"}], "name": "w7"},
        {"role": "assistant", "content": "w6"},
        {"role": "tool", "content": "w8", "tool_call_id": "call-1"},
    ]
    out = gw.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    rendered = [("developer", "w3"), ("user", "w5"), ("assistant", "w6"), ("tool", "w8")]
    assert out.usage.prompt_tokens == len(chat_ids(tiny_tokenizer, rendered))


def test_every_error_has_openai_shape(gw):
    """Unknown routes, wrong methods and bodies that are not JSON objects answer {"error": {...}}, not FastAPI's
    {"detail": ...}, and no message begins with "None"."""
    replies = {
        404: httpx.get(f"{gw.base_url}/nothing-here", headers=_auth(), timeout=60),
        405: httpx.get(f"{gw.base_url}/completions", headers=_auth(), timeout=60),
        400: httpx.post(f"{gw.base_url}/completions", content=b"{not json", headers=_auth(), timeout=60),
    }
    for status, reply in replies.items():
        assert reply.status_code == status and set(reply.json()) == {"error"}, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and not error["message"].startswith("None")
    assert replies[404].json()["error"]["message"] == "Not Found (GET /v1/nothing-here)"
    assert replies[405].headers["allow"] == "POST"
    assert replies[400].json()["error"]["message"].startswith("the body is not valid JSON: ")
    listed = httpx.post(f"{gw.base_url}/completions", json=[1], headers=_auth(), timeout=60)
    assert listed.json()["error"]["message"] == "the body must be a JSON object"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_max_tokens_over_the_context_is_refused_as_vllm_does(gw, stream):
    """prompt + max_tokens over the context (vLLM: max_model_len) is 400 context_length_exceeded, before any
    byte streams: max_tokens 2048 leaves no room for the prompt in a 2048-token context."""
    with pytest.raises(openai.BadRequestError) as info:
        gw.openai().completions.create(model=MODEL, prompt="w5", max_tokens=2048, stream=stream)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert "maximum context length is 2048 tokens" in info.value.message


def test_a_body_over_the_limit_is_refused_before_it_is_read(start_gateway):
    """413 from the size check, never a body buffered whole: from a Content-Length over max_message_bytes before
    any of the body is sent, and from a chunked body as soon as what arrived passes the limit (the body never
    ends here: only the size check can answer it)."""
    small = start_gateway(max_message_bytes=4096)
    address = small.base_url.removeprefix("http://").removesuffix("/v1")
    declared = http.client.HTTPConnection(address, timeout=60)
    declared.putrequest("POST", "/v1/completions")
    for name, value in {**_auth(), "content-type": "application/json", "content-length": str(10**9)}.items():
        declared.putheader(name, value)
    declared.endheaders()  # and nothing of the body
    reply = declared.getresponse()
    assert reply.status == 413 and json.loads(reply.read())["error"]["message"] == "body over max_message_bytes 4096"
    chunked = http.client.HTTPConnection(address, timeout=60)
    chunked.putrequest("POST", "/v1/completions")
    for name, value in {**_auth(), "content-type": "application/json", "transfer-encoding": "chunked"}.items():
        chunked.putheader(name, value)
    chunked.endheaders()
    for _ in range(5):  # 5 KB of an unfinished body
        chunked.send(b"400\r\n" + b" " * 1024 + b"\r\n")
    reply = chunked.getresponse()
    assert reply.status == 413 and "max_message_bytes" in json.loads(reply.read())["error"]["message"]


class _HeldTokenizer:
    """The tiny tokenizer, except that encoding a text with HOLD in it waits until the test releases it."""

    HOLD = "w59 w59 w59"

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, text, **kwargs):
        if self.HOLD in text:
            self.entered.set()
            assert self.release.wait(60)
        return self._tokenizer.encode(text, **kwargs)


def test_a_tokenisation_in_progress_holds_up_no_other_call(start_gateway, tiny_tokenizer):
    """A prompt is tokenised off the event loop: while one is being tokenised (held here until the test lets
    it go), the gateway answers other calls; were it on the loop, they would wait for it (and time out)."""
    held = _HeldTokenizer(tiny_tokenizer)
    slow = start_gateway(tokenizer=held)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(slow.openai().completions.create, model=MODEL, prompt=f"w5 {held.HOLD}", max_tokens=2)
        tokenizing = pool.submit(
            httpx.post, f"{slow.base_url[:-3]}/tokenize", json={"prompt": held.HOLD}, headers=_auth(), timeout=60
        )
        assert held.entered.wait(60)
        try:
            assert [m.id for m in slow.openai().models.list().data] == [MODEL]
            assert slow.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.prompt_tokens == 4
            assert not waiting.done() and not tokenizing.done()
        finally:
            held.release.set()
        assert waiting.result(60).usage.prompt_tokens == 4 and tokenizing.result(60).json()["count"] == 3


def test_health_version_and_one_model(gw):
    root = gw.base_url[:-3]
    assert httpx.get(f"{root}/health", timeout=60).status_code == 200  # no token needed, as for gRPC health
    assert httpx.get(f"{root}/version", timeout=60).json() == {"version": metadata.version("rsd")}
    model = gw.openai().models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by, model.max_model_len) == (MODEL, "model", "rsd", 2048)
    assert gw.openai().models.list().data == [model]
    with pytest.raises(openai.NotFoundError) as info:
        gw.openai().models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"


def test_health_is_503_while_the_gateway_drains(loop, start_gateway):
    """A draining gateway (SIGTERM: GatewayHandle.drain lets running turns finish) answers /health 503, so a
    load balancer sends it nothing new, as gRPC health turns NOT_SERVING."""
    draining = start_gateway()
    health = draining.base_url[:-3] + "/health"
    assert httpx.get(health, timeout=60).status_code == 200
    with draining.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2000, stream=True) as stream:
        next(iter(stream))  # a turn is running: the drain waits for it
        drained = asyncio.run_coroutine_threadsafe(draining.handle.drain(60), loop.loop)
        replies = (httpx.get(health, timeout=60) for _ in range(1000))
        reply = next(r for r in replies if r.status_code != 200)
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable_error"
    drained.result(60)  # closing the stream cancelled the turn: the drain ends


def test_tokenize_and_detokenize_as_vllm(gw, tiny_tokenizer):
    """vLLM's /tokenize (a prompt, or messages through the chat template) gives the ids the completions
    endpoints start from; /detokenize turns ids back into text."""
    root = gw.base_url[:-3]
    ids = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)
    prompt = httpx.post(f"{root}/tokenize", json={"model": MODEL, "prompt": PROMPT}, headers=_auth(), timeout=60)
    assert prompt.json() == {"count": 4, "max_model_len": 2048, "tokens": ids, "token_strs": None}
    strs = httpx.post(
        f"{root}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, headers=_auth(), timeout=60
    )
    assert strs.json()["token_strs"] == PROMPT.split()
    messages = [{"role": r, "content": c} for r, c in CHAT]
    chat = httpx.post(f"{root}/tokenize", json={"messages": messages}, headers=_auth(), timeout=60).json()
    used = gw.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    assert chat["tokens"] == chat_ids(tiny_tokenizer, CHAT) and chat["count"] == used
    text = httpx.post(f"{root}/detokenize", json={"model": MODEL, "tokens": ids}, headers=_auth(), timeout=60)
    assert text.json() == {"prompt": PROMPT}
    bad = httpx.post(f"{root}/detokenize", json={"tokens": [1, -1]}, headers=_auth(), timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    other = httpx.post(f"{root}/tokenize", json={"model": "gpt-4o", "prompt": "w1"}, headers=_auth(), timeout=60)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert httpx.post(f"{root}/tokenize", json={"prompt": "w1"}, timeout=60).status_code == 401


@pytest.mark.parametrize("path", ["/metrics", "/openapi.json", "/v1/models/rsd-tiny", "/tokenize"])
def test_the_token_guards_every_route_but_health_and_version(gw, path):
    method = "POST" if path == "/tokenize" else "GET"
    url = gw.base_url[:-3] + path
    refused = httpx.request(method, url, json={"prompt": "w1"}, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.request(method, url, json={"prompt": "w1"}, headers=_auth(), timeout=60).status_code == 200


def test_metrics_and_schema_on_the_http_port(gw):
    root = gw.base_url[:-3]
    gw.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    metrics = httpx.get(f"{root}/metrics", headers=_auth(), timeout=60)
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'rsd_gateway_requests_total{code="OK",method="/v1/completions"}' in metrics.text
    schema = httpx.get(f"{root}/openapi.json", headers=_auth(), timeout=60).json()
    paths = schema["paths"]
    assert {"/v1/chat/completions", "/tokenize", "/health"} <= set(paths) and "/openapi.json" not in paths
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "messages", "max_tokens", "stream"} <= set(chat["properties"]) and "messages" in chat["required"]


def test_the_secure_cluster_openai_snippet_connects(start_gateway, tmp_path_factory):
    """What `rsd cluster --secure` prints for the openai client (ClusterSecurity.openai_snippet) works as
    printed: base URL, the token file, the CA, and the client certificate where the public API asks for one."""
    folder = tmp_path_factory.mktemp("snippet")
    pki = make_pki(folder)
    (folder / "token").write_text(TOKEN + "\n")
    secure = start_gateway(tls_cert=pki["server"], tls_key=pki["server_key"], tls_ca=pki["ca"])
    sec = ClusterSecurity(
        pki["server"], pki["server_key"], pki["ca"], pki["client"], pki["client_key"], True, str(folder / "token")
    )
    lines = sec.how_to_connect("127.0.0.1:1", secure.base_url)
    assert lines[-1].strip() == sec.openai_snippet(secure.base_url)
    scope: dict = {}
    exec(sec.openai_snippet(secure.base_url), scope)
    assert [m.id for m in scope["client"].models.list().data] == [MODEL]


# ---------------------------------------------------------------------------------------------
# Per-response speculative decoding metrics (vLLM's metrics.speculative_decoding)


def _spec_metrics(steps, depth: int) -> dict:
    """What the reply must say for these StepStats (the definitions of gateway.openai.schema.SpecDecodeMetrics)."""
    accepted, drafted = sum(s.num_accepted_tokens for s in steps), sum(s.num_draft_tokens for s in steps)
    histogram = [sum(s.num_accepted_tokens == j for s in steps) for j in range(depth + 1)]
    return {
        "mean_acceptance_length": 1 + accepted / len(steps),
        "draft_acceptance_rate": accepted / drafted,
        "acceptance_histogram": histogram,
        "num_spec_steps": len(steps),
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": depth,
        "verification": "token",
        "acceptance_rule": next(s.verifier.rule for s in steps),
    }


@pytest.mark.parametrize("include_usage", [False, True], ids=["finish-chunk", "usage-chunk"])
def test_speculative_metrics_in_the_reply_and_the_last_chunk(gw, include_usage):
    """The whole reply and the stream's last chunk (the usage chunk when asked for, else the finish chunk) carry
    the turn's `metrics.speculative_decoding`, equal to what its steps' StepStats say over gRPC for the same
    seeded request."""
    kwargs = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 3}
    with gw.grpc() as client:
        ref = client.generate(PROMPT, temperature=0.8, seed=3, max_new_tokens=24, **RSD_C).wait()
    expected = _spec_metrics(ref.steps, depth=3)  # rsd_c 2,2,1: trees of depth 3
    assert expected["num_accepted_draft_tokens"] > 0 and sum(expected["acceptance_histogram"]) == len(ref.steps)
    whole = gw.openai().completions.create(model=MODEL, extra_body=RSD_C, **kwargs)
    assert whole.model_extra["metrics"] == {"speculative_decoding": expected}
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(gw.openai().completions.create(model=MODEL, stream=True, extra_body=RSD_C, **kwargs, **options))
    assert chunks[-1].model_extra["metrics"] == {"speculative_decoding": expected}
    assert all("metrics" not in c.model_extra for c in chunks[:-1])
    chat = gw.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w5"}],
        max_tokens=4,
        extra_body={"method": "sd", "shape": "4"},
    )
    spec = chat.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_tokens"] == 4 and len(spec["acceptance_histogram"]) == 5 and spec["num_spec_steps"] >= 1


def _spec_counters(text: str, **labels: str) -> dict[str, float]:
    """The rsd_gateway_spec_decode_* counters of a /metrics page whose labels include `labels`, by short name
    ("num_drafts", ...; "num_accepted_tokens_per_pos[j]" for position j)."""
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            spec = s.name.startswith("rsd_gateway_spec_decode_") and s.name.endswith("_total")
            if spec and set(labels.items()) <= set(s.labels.items()):
                name = s.name.removeprefix("rsd_gateway_spec_decode_").removesuffix("_total")
                name += f"[{s.labels['position']}]" if "position" in s.labels else ""
                counters[name] = counters.get(name, 0.0) + s.value
    return counters


@pytest.mark.parametrize(
    ("extra", "rule"),
    [(RSD_C, None), ({"method": "sd", "shape": "3", "verification": "block"}, "block")],
    ids=["rsd_c", "sd-block"],
)
def test_prometheus_spec_decode_counters_per_method_add_up_to_the_replies(gw, extra, rule):
    """/metrics' rsd_gateway_spec_decode_* counters, labelled by method, verification and acceptance rule, grow by
    the figures of the reply's metrics.speculative_decoding (vLLM's spec_decode_num_drafts, num_draft_tokens,
    num_accepted_tokens, num_accepted_tokens_per_pos) and the tokens the steps emitted."""
    metrics = f"{gw.base_url[:-3]}/metrics"
    before = httpx.get(metrics, headers=_auth(), timeout=60).text
    out = gw.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.8, seed=5, extra_body=extra
    )
    spec = out.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] > 0 and spec["num_draft_tokens"] > 0 and rule in (None, spec["acceptance_rule"])
    labels = {"method": extra["method"], "verification": spec["verification"], "rule": spec["acceptance_rule"]}
    after = _spec_counters(httpx.get(metrics, headers=_auth(), timeout=60).text, **labels)
    old = _spec_counters(before, **labels)
    grown = {name: value - old.get(name, 0.0) for name, value in after.items()}
    histogram = spec["acceptance_histogram"]  # position j: the steps that accepted more than j draft tokens
    want = {
        "num_drafts": spec["num_spec_steps"],
        "num_draft_tokens": spec["num_draft_tokens"],
        "num_accepted_tokens": spec["num_accepted_draft_tokens"],
        "num_emitted_tokens": out.usage.completion_tokens,
        **{f"num_accepted_tokens_per_pos[{j}]": sum(histogram[j + 1 :]) for j in range(len(histogram) - 1)},
    }
    assert {k: v for k, v in grown.items() if v} == {k: v for k, v in want.items() if v}
    assert spec["mean_acceptance_length"] == 1 + grown["num_accepted_tokens"] / grown["num_drafts"]


# ---------------------------------------------------------------------------------------------
# logprobs and logit_bias


def plain_logprobs(target, before: list[int], new: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits where each of `new` was generated, from one plain forward [M, V]."""
    seq = before + new
    with torch.no_grad():
        logits = target(torch.tensor([seq])).logits[0, len(before) - 1 : len(seq) - 1]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grpc_logprobs_are_the_targets_log_softmax(gw, pair, tiny_tokenizer, temperature):
    """Through the real services: every committed token's logprob, and the top 3 at its position, equal
    log_softmax of the target's logits in a plain forward (raw: the same at T = 0 and T = 1)."""
    prompt = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)
    with gw.grpc() as client:
        gen = client.generate(PROMPT, temperature=temperature, seed=3, max_new_tokens=12, top_logprobs=3, **RSD_C)
        deltas = list(gen)
    chosen = torch.cat([token_logprobs_from_proto(d.logprobs, len(d.token_ids)).logprobs for d in deltas])
    top = torch.cat([token_logprobs_from_proto(d.logprobs, len(d.token_ids)).top_logprobs for d in deltas])
    want = plain_logprobs(pair[1], prompt, gen.token_ids)
    assert len(gen.token_ids) == 12 and all(d.HasField("logprobs") for d in deltas)
    assert torch.allclose(chosen, want[torch.arange(12), torch.tensor(gen.token_ids)], atol=1e-4)
    assert torch.allclose(top, want.topk(3, -1).values, atol=1e-4)
    with gw.grpc() as client:  # a turn that does not ask gets none
        assert not any(d.HasField("logprobs") for d in client.generate(PROMPT, max_new_tokens=3))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_logprobs_legacy_shape(gw, pair, tiny_tokenizer, temperature, stream):
    client, prompt = gw.openai(), tiny_tokenizer.encode(PROMPT, add_special_tokens=False)
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": temperature, "seed": 4, "logprobs": 2}
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        session_id = chunks[0].session_id
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        values = [v for p in parts for v in p.token_logprobs]
        tops = [d for p in parts for d in p.top_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        out = client.completions.create(**kwargs)
        session_id, lp, text = out.session_id, out.choices[0].logprobs, out.choices[0].text
        tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    ids = list(wait_until_done(gw, session_id).committed_token_ids[len(prompt) :])
    want = plain_logprobs(pair[1], prompt, ids)
    assert tokens == [tiny_tokenizer.decode([t]) for t in ids]  # vLLM's: each id decoded alone
    # the text: the same words (a word-level tokenizer's spaces come from the context), special tokens skipped
    assert text.split() == [t for t in tokens if t not in tiny_tokenizer.all_special_tokens]
    assert torch.allclose(torch.tensor(values), want[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-4)
    best = want.topk(2, -1)
    for row, top in enumerate(tops):
        names = [tiny_tokenizer.decode([t]) for t in best.indices[row].tolist()]
        assert list(top) == names and torch.allclose(torch.tensor(list(top.values())), best.values[row], atol=1e-4)
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_and_top_logprobs(gw, pair, tiny_tokenizer, stream):
    messages = [{"role": r, "content": c} for r, c in CHAT]
    client, prompt = gw.openai(), chat_ids(tiny_tokenizer, CHAT)
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": 8}
    kwargs.update(logprobs=True, top_logprobs=4)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        session_id = chunks[0].session_id
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        out = client.chat.completions.create(**kwargs)
        session_id, content = out.session_id, out.choices[0].logprobs.content
    ids = list(wait_until_done(gw, session_id).committed_token_ids[len(prompt) :])
    want = plain_logprobs(pair[1], prompt, ids)
    assert [e.token for e in content] == [tiny_tokenizer.decode([t]) for t in ids]
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 4 for e in content)
    got = torch.tensor([e.logprob for e in content])
    assert torch.allclose(got, want[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-4)
    got_top = torch.tensor([[t.logprob for t in e.top_logprobs] for e in content])
    assert torch.allclose(got_top, want.topk(4, -1).values, atol=1e-4)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


PROCESSED = {  # logit_bias, penalties, temperature, top-k and top-p all move the law the tokens are sampled from
    "temperature": 0.8,
    "top_p": 0.9,
    "logit_bias": {"40": 3.0, "7": -2.0},
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "extra_body": {"top_k": 20, "repetition_penalty": 1.3},
}


def processed_want(target, prompt: list[int], ids: list[int], params: SamplingParams, mode: str) -> torch.Tensor:
    """The processed figures of `ids` after `prompt`, by hand on one plain forward's logits [M, V]."""
    seq = prompt + ids
    with torch.no_grad():
        raw = target(torch.tensor([seq])).logits[0, len(prompt) - 1 : len(seq) - 1]  # [M, V]
    return torch.stack([processed_scores(raw[j], prompt, ids[:j], params, mode) for j in range(len(ids))])


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("greedy", [False, True], ids=["T0.8", "T0"])
def test_chat_processed_logprobs_are_the_law_sampled_from(gw, pair, tiny_tokenizer, mode, stream, greedy):
    """logprobs_mode (an extra body field, vLLM's values) through the real services: each token's figure and the
    top 3 equal a plain forward's logits with logit_bias, the penalties, temperature, top-k and top-p written out."""
    messages = [{"role": r, "content": c} for r, c in CHAT]
    client, prompt = gw.openai(), chat_ids(tiny_tokenizer, CHAT)
    body = copy.deepcopy(PROCESSED) | ({"temperature": 0.0} if greedy else {})
    body["extra_body"] |= {"logprobs_mode": mode, **RSD_C}
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 10, "seed": 5, "logprobs": True, "top_logprobs": 3}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs, **body))
        session_id = chunks[0].session_id
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        out = client.chat.completions.create(**kwargs, **body)
        session_id, content = out.session_id, out.choices[0].logprobs.content
    ids = list(wait_until_done(gw, session_id).committed_token_ids[len(prompt) :])
    bias = tuple(sorted((int(t), b) for t, b in body["logit_bias"].items()))
    penalties = (body["presence_penalty"], body["frequency_penalty"], body["extra_body"]["repetition_penalty"])
    params = SamplingParams(body["temperature"], 20, body["top_p"], bias, *penalties)
    want = processed_want(pair[1], prompt, ids, params, mode)
    got = torch.tensor([e.logprob for e in content], dtype=torch.float64)
    assert len(ids) == 10 and [e.token for e in content] == [tiny_tokenizer.decode([t]) for t in ids]
    torch.testing.assert_close(got, want[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-4, rtol=0)
    floor = -9999.0  # JSON has no -inf: tokens outside the law (top-k, top-p) read as vLLM writes them
    got_top = torch.tensor([[t.logprob for t in e.top_logprobs] for e in content], dtype=torch.float64)
    torch.testing.assert_close(got_top, want.topk(3, -1).values.clamp(min=floor), atol=1e-4, rtol=0)
    if greedy:  # the emitted token is the argmax of the processed logits
        assert [e.top_logprobs[0].token for e in content] == [e.token for e in content]


def test_logprobs_mode_default_is_the_gateways_and_raw_stays_raw(start_gateway, gw, pair, tiny_tokenizer):
    """--logprobs-mode is the default of a request that does not say (vLLM's engine argument); a request's own
    logprobs_mode wins; raw_logprobs ignores the transforms; gRPC's logprobs_mode is the same field."""
    processed_gw = start_gateway(logprobs_mode="processed_logprobs")
    prompt = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "seed": 2, "logprobs": 2, **PROCESSED}
    params = SamplingParams(0.8, 20, 0.9, ((7, -2.0), (40, 3.0)), 0.5, 0.3, 1.3)
    by_default = processed_gw.openai().completions.create(**kwargs)
    ids = list(wait_until_done(processed_gw, by_default.session_id).committed_token_ids[len(prompt) :])
    want = processed_want(pair[1], prompt, ids, params, "processed_logprobs")
    got = torch.tensor(by_default.choices[0].logprobs.token_logprobs, dtype=torch.float64)
    torch.testing.assert_close(got, want[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-4, rtol=0)
    kwargs["extra_body"] = kwargs["extra_body"] | {"logprobs_mode": "raw_logprobs"}
    raw = processed_gw.openai().completions.create(**kwargs)
    assert wait_until_done(processed_gw, raw.session_id).committed_token_ids[len(prompt) :] == ids  # same law
    got = torch.tensor(raw.choices[0].logprobs.token_logprobs)
    assert torch.allclose(
        got, plain_logprobs(pair[1], prompt, ids)[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-4
    )
    with gw.grpc() as client:  # the same field over gRPC, on a gateway whose default is raw
        gen = client.generate(
            token_ids=prompt,
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            seed=2,
            max_new_tokens=8,
            top_logprobs=0,
            logit_bias={7: -2.0, 40: 3.0},
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.3,
            logprobs_mode="processed_logprobs",
            method="rsd_s",
            shape="3x4",
        )
        deltas = list(gen)
    got = torch.cat([token_logprobs_from_proto(d.logprobs, len(d.token_ids)).logprobs for d in deltas]).double()
    want = processed_want(pair[1], prompt, gen.token_ids, params, "processed_logprobs")
    torch.testing.assert_close(got, want[torch.arange(8), torch.tensor(gen.token_ids)], atol=1e-4, rtol=0)


def test_unknown_logprobs_mode_is_refused_by_name(gw):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "logprobs": 1, "logprobs_mode": "processed"}
    reply = httpx.post(f"{gw.base_url}/completions", json=body, headers=_auth(), timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "logprobs_mode" and "must be one of raw_logprobs" in error["message"], error
    with gw.grpc() as client, pytest.raises(grpc.RpcError) as info:
        client.generate(PROMPT, max_new_tokens=2, top_logprobs=1, logprobs_mode="logits").wait()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs_mode" in info.value.details()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: Input should be less than or equal to 20"),
        ({"top_logprobs": 2}, "top_logprobs: needs logprobs: true"),
    ],
)
def test_chat_top_logprobs_is_checked(gw, change, reason):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2, **change}
    reply = httpx.post(f"{gw.base_url}/chat/completions", json=body, headers=_auth(), timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "top_logprobs" and reason in error["message"], error


def test_grpc_top_logprobs_over_20_is_invalid_argument(gw):
    with gw.grpc() as client, pytest.raises(grpc.RpcError) as info:
        client.generate(PROMPT, max_new_tokens=2, top_logprobs=21).wait()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in info.value.details()


def test_logit_bias_forces_and_bans_tokens(gw, tiny_tokenizer):
    """+100 on one token makes greedy decoding emit only it; -100 on the tokens a seeded T = 1 run emitted
    bans them from the same run (the same seed: every other draw is the same)."""
    client = gw.openai()
    (forced,) = tiny_tokenizer.encode("w30", add_special_tokens=False)
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0, logit_bias={str(forced): 100}
    )
    assert list(wait_until_done(gw, out.session_id).committed_token_ids[4:]) == [forced] * 8
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 21}
    free = client.completions.create(**kwargs)
    emitted = set(wait_until_done(gw, free.session_id).committed_token_ids[4:])
    banned = client.completions.create(**kwargs, logit_bias=dict.fromkeys(map(str, emitted), -100))
    again = list(wait_until_done(gw, banned.session_id).committed_token_ids[4:])
    assert again and not set(again) & emitted
    with gw.grpc() as grpc_client:  # the same through gRPC
        ref = grpc_client.generate(PROMPT, temperature=0.0, max_new_tokens=8, logit_bias={forced: 100.0}).wait()
    assert ref.token_ids == [forced] * 8


def test_penalties_at_temperature_zero_are_the_penalised_targets_greedy_output(gw, pair, tiny_tokenizer):
    """presence_penalty, frequency_penalty (OpenAI's) and repetition_penalty (vLLM's, an extra body field) through
    gateway, drafter and verifier: at T = 0 the target alone with the penalties, token for token; gRPC the same.
    An out-of-range one is INVALID_ARGUMENT over gRPC, naming it."""
    prompt = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)
    penalties = {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.8}
    want = penalised_greedy(pair[1], prompt, 12, SamplingParams(0, **penalties))
    assert want != penalised_greedy(pair[1], prompt, 12, SamplingParams(0))  # the penalties change this output
    out = gw.openai().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
        extra_body={"repetition_penalty": penalties["repetition_penalty"], **RSD_C},
    )
    assert list(wait_until_done(gw, out.session_id).committed_token_ids[len(prompt) :]) == want
    with gw.grpc() as client:
        assert (
            client.generate(PROMPT, temperature=0.0, max_new_tokens=12, **penalties, **RSD_C).wait().token_ids == want
        )
        with pytest.raises(grpc.RpcError) as info:
            client.generate(PROMPT, max_new_tokens=2, repetition_penalty=-1.0).wait()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "repetition_penalty" in info.value.details()


# ---------------------------------------------------------------------------------------------
# n > 1: n sessions, seeds seed, seed + 1, ...


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_choices_are_the_single_runs_with_seeds_seed_plus_i(gw, stream):
    client = gw.openai()
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0.9}
    if stream:
        chunks = list(
            client.completions.create(n=3, seed=11, stream=True, stream_options={"include_usage": True}, **kwargs)
        )
        texts, finish = ["", "", ""], [None, None, None]
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
        token_usage, session_ids = chunks[-1].usage, chunks[0].session_ids
        assert chunks[-1].metrics["speculative_decoding"]["num_spec_steps"] > 0
    else:
        out = client.completions.create(n=3, seed=11, **kwargs)
        assert [c.index for c in out.choices] == [0, 1, 2]
        texts, finish = [c.text for c in out.choices], [c.finish_reason for c in out.choices]
        token_usage, session_ids = out.usage, out.session_ids
    singles = [client.completions.create(seed=11 + i, **kwargs) for i in range(3)]
    assert texts == [one.choices[0].text for one in singles] and len(set(texts)) > 1
    assert finish == [one.choices[0].finish_reason for one in singles]
    assert token_usage.prompt_tokens == 4  # once, as OpenAI counts it
    assert token_usage.completion_tokens == sum(one.usage.completion_tokens for one in singles)
    assert len(set(session_ids)) == 3
    for session_id, one in zip(session_ids, singles, strict=True):
        assert (
            wait_until_done(gw, session_id).committed_token_ids
            == wait_until_done(gw, one.session_id).committed_token_ids
        )


def test_n_chat_choices_with_logprobs(gw):
    messages = [{"role": r, "content": c} for r, c in CHAT]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 1.0, "logprobs": True}
    out = gw.openai().chat.completions.create(n=2, seed=30, **kwargs)
    one = gw.openai().chat.completions.create(seed=31, **kwargs)
    assert out.choices[1].message.content == one.choices[0].message.content
    assert [e.logprob for e in out.choices[1].logprobs.content] == [e.logprob for e in one.choices[0].logprobs.content]
    assert len(out.choices[0].logprobs.content) == len(
        wait_until_done(gw, out.session_ids[0]).committed_token_ids
    ) - len(wait_until_done(gw, out.session_ids[0]).prompt_token_ids)


def test_n_choices_share_the_prompts_prefill_on_one_verifier(loop, pair, redis_url):
    """With two verifiers, the n choices go beside choice 0 (its verifier has room), whose pool reads the prompt's
    K/V off one slot for the other choices instead of computing them again; each choice is still the single run
    with its seed (on whichever verifier that lands)."""
    registry = {"redis_url": redis_url, "redis_namespace": f"rsd-test-n-{time.monotonic_ns()}"}
    closers = loop.run(start_registered_services(pair, registry), timeout_s=120)
    v1 = loop.run(create_verifier(VerifierConfig(verifier_id="v1", **registry), pair[1]))
    closers.append((v1[2], v1[0]))
    cfg = GatewayConfig(port=0, http_port=0, auth_token=TOKEN, served_model_name=MODEL, **registry)
    server, port, handle = loop.run(create_server(cfg, tokenizer=pair[2]))
    gw = Gateway(server, handle, f"127.0.0.1:{port}")
    try:
        engines = {"v0": closers[1][0].servicer.engine, "v1": v1[2].servicer.engine}
        prompt = "w2 w10 w11 w12 w13 w14 w15 w16 w17 w18"
        kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.9}
        before = {v: e.num_shared_tokens for v, e in engines.items()}
        out = gw.openai().completions.create(n=3, seed=21, **kwargs)
        (verifier,) = {wait_until_done(gw, s).verifier_id for s in out.session_ids}  # one verifier for all
        shared = engines[verifier].num_shared_tokens - before[verifier]
        assert shared >= 2 * (len(pair[2].encode(prompt, add_special_tokens=False)) - 1)  # the prompt, twice
        singles = [gw.openai().completions.create(seed=21 + i, **kwargs) for i in range(3)]
        assert [c.text for c in out.choices] == [one.choices[0].text for one in singles]
        assert len({c.text for c in out.choices}) > 1
    finally:
        loop.run(handle.close(server, 0))
        for service, srv in closers:
            loop.run(service.close(srv, 0))


# ---------------------------------------------------------------------------------------------
# Per-request speculation: adaptive_shape (an extra body field, GenerationParams.adaptive_shape)


def test_adaptive_shape_is_exact_at_temperature_zero_and_refused_by_name(gw):
    """adaptive_shape: the drafter picks each step's shape up to `shape` (rsd.shape_control): at T = 0 the text
    is the fixed shape's (the target's greedy output), the steps' trees vary in size; a method whose trees are
    not (W, L) is a 400 naming adaptive_shape."""
    client = gw.openai()
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0}
    fixed = client.completions.create(**kwargs, extra_body={"method": "rsd_s", "shape": "3x3"})
    adaptive = client.completions.create(
        **kwargs, extra_body={"method": "rsd_s", "shape": "3x3", "adaptive_shape": True}
    )
    assert adaptive.choices[0].text == fixed.choices[0].text
    assert adaptive.model_extra["metrics"]["speculative_decoding"]["num_spec_tokens"] == 3  # the deepest allowed
    with gw.grpc() as grpc_client:  # the same turn over gRPC shows each step's tree
        ref = grpc_client.generate(
            PROMPT, method="rsd_s", shape="3x3", temperature=0.0, max_new_tokens=24, adaptive_shape=True
        ).wait()
    assert ref.text == adaptive.choices[0].text and len({s.num_draft_tokens for s in ref.steps}) > 1
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kwargs, extra_body={**RSD_C, "adaptive_shape": True})
    assert err.value.body["param"] == "adaptive_shape" and err.value.body["message"].startswith("adaptive_shape: ")

"""The official client's async flavour, `openai.AsyncOpenAI`, against the real gateway over a real drafter and
verifier on loopback (tests/fixtures/stack.py serve_pair, the tiny word-level Qwen2 pair): chat and completions,
streamed with include_usage, many requests at once on one event loop, and a stream closed mid-way. Each answer is
checked against the sync client's for the same request (tests/gateway/test_openai.py checks those against gRPC
and the target's own law): what is under test is the async client's own request and stream handling."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from rsd_service.client import RsdClient
from rsd_wire import gateway_pb2
from tests.fixtures.stack import serve_pair

MODEL = "tiny"
PROMPT = "w2 w10 w11 w12"
MESSAGES = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w6 w7"}]
SPEC = {"method": "rsd_c", "shape": "2,2,1"}  # rsd's extra body fields


@pytest.fixture(scope="module")
def served(tiny_dirs):
    with serve_pair(*tiny_dirs, model_name=MODEL) as served:
        yield served


def run(served, make):
    """asyncio.run(make(client)) with an AsyncOpenAI client for `served`, closed afterwards."""

    async def main():
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="-", max_retries=0, timeout=120) as client:
            return await make(client)

    return asyncio.run(main())


def sync_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="-", max_retries=0, timeout=120)


def finished_session(served, session_id: str) -> gateway_pb2.Session:
    """The session once its turn has ended (a closed stream's turn may still be stopping)."""
    with RsdClient(served.address, timeout_s=60) as client:
        while (session := client.get_session(session_id, include_token_ids=True)).status == (
            gateway_pb2.SESSION_STATUS_RUNNING
        ):
            time.sleep(0.05)
    return session


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_and_completion_match_the_sync_client(served, temperature):
    kwargs = {"model": MODEL, "max_tokens": 12, "temperature": temperature, "seed": 3, "extra_body": SPEC}

    async def both(client):
        chat = await client.chat.completions.create(messages=MESSAGES, **kwargs)
        completion = await client.completions.create(prompt=PROMPT, **kwargs)
        return chat, completion

    chat, completion = run(served, both)
    want_chat = sync_client(served).chat.completions.create(messages=MESSAGES, **kwargs)
    want_completion = sync_client(served).completions.create(prompt=PROMPT, **kwargs)
    assert chat.choices[0].message.content == want_chat.choices[0].message.content
    assert chat.choices[0].finish_reason == want_chat.choices[0].finish_reason and chat.usage == want_chat.usage
    assert completion.choices[0].text == want_completion.choices[0].text
    assert completion.usage == want_completion.usage and completion.usage.completion_tokens == 12


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_with_include_usage(served, endpoint):
    """Streamed: the deltas join to the whole answer's text; usage comes once, in a last chunk without choices."""
    kwargs = {"model": MODEL, "max_tokens": 10, "temperature": 1.0, "seed": 7, "extra_body": SPEC}
    kwargs |= {"messages": MESSAGES} if endpoint == "chat" else {"prompt": PROMPT}

    async def stream(client):
        create = client.chat.completions.create if endpoint == "chat" else client.completions.create
        return [chunk async for chunk in await create(stream=True, stream_options={"include_usage": True}, **kwargs)]

    chunks = run(served, stream)
    sync = sync_client(served)
    whole = (sync.chat.completions if endpoint == "chat" else sync.completions).create(**kwargs)
    *body, last = chunks
    if endpoint == "chat":
        text = "".join(c.choices[0].delta.content or "" for c in body if c.choices)
        want = whole.choices[0].message.content
    else:
        text, want = "".join(c.choices[0].text for c in body if c.choices), whole.choices[0].text
    assert text == want and last.choices == [] and last.usage == whole.usage
    assert all(c.usage is None for c in body)
    assert [c.choices[0].finish_reason for c in body if c.choices and c.choices[0].finish_reason] == ["length"]


def test_many_requests_at_once_on_one_loop(served):
    """Eight requests in flight together (the verifier packs their trees into shared forwards): each answer is the
    one the same request gets alone."""
    kwargs = {"model": MODEL, "max_tokens": 8, "temperature": 1.0, "extra_body": SPEC}

    async def together(client):
        calls = [client.completions.create(prompt=PROMPT, seed=seed, **kwargs) for seed in range(8)]
        return await asyncio.gather(*calls)

    answers = run(served, together)
    alone = [sync_client(served).completions.create(prompt=PROMPT, seed=seed, **kwargs) for seed in range(8)]
    assert [a.choices[0].text for a in answers] == [a.choices[0].text for a in alone]
    assert len({a.session_id for a in answers}) == 8


def test_closing_a_stream_mid_way_cancels_the_turn(served):
    """`await stream.close()` after three chunks: the gateway sees the disconnect and cancels the turn; what it
    committed is kept, exactly the greedy continuation the same request gives when run to that length."""

    async def cancel(client):
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2000, temperature=0.0, stream=True, extra_body=SPEC
        )
        chunks = [await anext(aiter(stream)) for _ in range(3)]
        await stream.close()
        return chunks

    chunks = run(served, cancel)
    session = finished_session(served, chunks[0].session_id)
    assert session.status == gateway_pb2.SESSION_STATUS_CANCELLED
    prompt = list(session.committed_token_ids)[: session.prompt_length_tokens]
    generated = list(session.committed_token_ids)[session.prompt_length_tokens :]
    assert 0 < len(generated) < 2000
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    with RsdClient(served.address, timeout_s=60) as client:
        ref = client.generate(token_ids=prompt, temperature=0.0, max_new_tokens=len(generated), **SPEC).wait()
    assert ref.token_ids == generated and ref.text.startswith(streamed)

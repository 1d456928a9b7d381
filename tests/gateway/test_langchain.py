"""A second real client: LangChain's ChatOpenAI (langchain-openai) against the gateway's OpenAI API, over a real
drafter and verifier on loopback: the byte-level tiny pair of tests/e2e/test_structured.py (any text encodes, so
a JSON schema can constrain it), one stack for the module. Each answer is checked against what the official
`openai` client gets for the same request (whose answers tests/gateway/test_openai.py checks against gRPC and the
target's own law): LangChain's own request building and reply parsing are what is under test here."""

from __future__ import annotations

import json

import openai
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

from tests.fixtures.byte_pair import build_byte_pair
from tests.fixtures.stack import serve_pair

MODEL = "tiny"
SPEC = {"method": "rsd_c", "shape": "2,2,1"}  # rsd's extra body fields
MESSAGES = [SystemMessage("Be brief."), HumanMessage("Say something.")]
WIRE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
SCHEMA = {
    "title": "answer",
    "description": "A yes or no and a kind.",
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bc"]}},
    "required": ["ok", "kind"],
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve_pair(*build_byte_pair(tmp_path_factory.mktemp("bytes")), model_name=MODEL) as served:
        yield served


def chat_model(served, **kwargs) -> ChatOpenAI:
    kwargs = {"temperature": 0.0, "max_tokens": 8, "extra_body": SPEC, **kwargs}
    return ChatOpenAI(model=MODEL, base_url=served.base_url, api_key="-", max_retries=0, timeout=120, **kwargs)


def official(served, messages=WIRE, **kwargs):
    """The official client's chat completion for the same request."""
    client = openai.OpenAI(base_url=served.base_url, api_key="-", max_retries=0, timeout=120)
    kwargs = {"temperature": 0.0, "max_tokens": 8, "extra_body": SPEC, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_invoke_and_stream(served):
    """invoke and stream give the official client's text at T = 0, with its finish reason and token counts."""
    want = official(served)
    reply = chat_model(served).invoke(MESSAGES)
    assert reply.content == want.choices[0].message.content
    assert reply.response_metadata["finish_reason"] == want.choices[0].finish_reason
    assert reply.usage_metadata["output_tokens"] == want.usage.completion_tokens
    assert reply.usage_metadata["input_tokens"] == want.usage.prompt_tokens
    chunks = list(chat_model(served, stream_usage=True).stream(MESSAGES))
    assert "".join(c.content for c in chunks) == reply.content
    assert sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata) == want.usage.completion_tokens


def test_a_named_message(served):
    """HumanMessage(name=...) is sent as the message's `name` (it broke the gateway before: issue 32)."""
    named = [SystemMessage("Be brief."), HumanMessage("Say something.", name="alice")]
    want = official(served, [WIRE[0], {**WIRE[1], "name": "alice"}])
    assert chat_model(served).invoke(named).content == want.choices[0].message.content


def test_with_structured_output_json_schema(served):
    """with_structured_output(method="json_schema") sends response_format json_schema (strict); the gateway's
    constrained decoding makes the reply parse, as the official client's does at T = 0."""
    structured = chat_model(served, max_tokens=60).with_structured_output(SCHEMA, method="json_schema", strict=True)
    answer = structured.invoke(MESSAGES)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    want = official(served, max_tokens=60, response_format=fmt).choices[0].message.content
    assert answer == json.loads(want) and answer["kind"] in ("a", "bc") and isinstance(answer["ok"], bool)


def test_logprobs(served):
    """logprobs and top_logprobs reach the reply's response_metadata as the official client reads them."""
    reply = chat_model(served, logprobs=True, top_logprobs=2, temperature=1.0, seed=4).invoke(MESSAGES)
    want = official(served, logprobs=True, top_logprobs=2, temperature=1.0, seed=4).choices[0].logprobs.content
    got = reply.response_metadata["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in got] == [(e.token, e.logprob) for e in want]
    assert [[t["logprob"] for t in e["top_logprobs"]] for e in got] == [
        [t.logprob for t in e.top_logprobs] for e in want
    ]
    assert all(len(e["top_logprobs"]) == 2 for e in got) and len(got) == 8


def test_processed_logprobs_mode_in_extra_body(served):
    """logprobs_mode (vLLM's values) rides in extra_body: processed_logprobs reach response_metadata as the
    official client reads them (the log of the law sampled from, top_p cut included), not the raw figures."""
    kwargs = {"logprobs": True, "top_logprobs": 2, "temperature": 0.7, "top_p": 0.5, "seed": 4}
    processed = {**SPEC, "logprobs_mode": "processed_logprobs"}
    reply = chat_model(served, extra_body=processed, **kwargs).invoke(MESSAGES)
    want = official(served, extra_body=processed, **kwargs).choices[0].logprobs.content
    raw = official(served, **kwargs).choices[0].logprobs.content
    got = reply.response_metadata["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in got] == [(e.token, e.logprob) for e in want]
    assert [e.token for e in raw] == [e.token for e in want]  # the same law sampled: the same tokens
    assert [e.logprob for e in raw] != [e.logprob for e in want]


def test_presence_and_frequency_penalties(served):
    """The penalties reach the sampler: at T = 0 the official client's penalised text, not the plain one (negative
    ones: the random tiny model rarely repeats a token of its own, which a positive penalty would need)."""
    penalties = {"presence_penalty": -2.0, "frequency_penalty": -1.0}
    want = official(served, max_tokens=16, **penalties).choices[0].message.content
    assert want != official(served, max_tokens=16).choices[0].message.content
    assert chat_model(served, max_tokens=16, **penalties).invoke(MESSAGES).content == want


def test_n_choices(served):
    """ChatOpenAI(n=2).generate: two generations, the official client's two choices (seeds seed, seed + 1)."""
    result = chat_model(served, n=2, temperature=1.0, seed=9).generate([MESSAGES])
    want = official(served, n=2, temperature=1.0, seed=9).choices
    assert [g.text for g in result.generations[0]] == [c.message.content for c in want]
    assert result.llm_output["token_usage"]["completion_tokens"] > 0


def test_speculation_per_request_in_extra_body(served):
    """rsd's per-request fields ride in extra_body: another method with adaptive shapes gives the same text at
    T = 0 (every method is exact); a method adaptive shapes cannot drive is a 400 naming adaptive_shape."""
    want = official(served).choices[0].message.content
    adaptive = {"method": "rsd_s", "shape": "2x3", "adaptive_shape": True}
    assert chat_model(served, extra_body=adaptive).invoke(MESSAGES).content == want
    with pytest.raises(openai.BadRequestError) as err:
        chat_model(served, extra_body={**SPEC, "adaptive_shape": True}).invoke(MESSAGES)
    assert err.value.body["param"] == "adaptive_shape"

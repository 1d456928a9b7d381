"""Structured output end to end: the official openai client against the gateway's HTTP API, real drafter and
verifier services on loopback (each building its own automaton from its --tokenizer folder), the tiny pair with
a byte-level tokenizer (tests/fixtures/byte_pair.py). json_object output parses; at T = 0 a JSON schema's
output is the target's constrained greedy output token for token; bad constraints are 400s naming the parameter."""

from __future__ import annotations

import json
import re

import grpc
import openai
import pytest

from rsd.constraint import Constraint
from rsd.sampling import SamplingParams
from rsd_runtime.constraint import AutomatonCache
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.runner import ModelRunner
from rsd_wire import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.fixtures.byte_pair import build_byte_pair
from tests.fixtures.stack import serve_pair

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bc"]}},
    "required": ["ok", "kind"],
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
EXTRA = {"method": "rsd_c", "shape": "2,2,1"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(openai client, tokenizer, target model, gRPC address) over a gateway, a drafter and a verifier on loopback."""
    with serve_pair(*build_byte_pair(tmp_path_factory.mktemp("bytes"))) as served:
        client = openai.OpenAI(base_url=served.base_url, api_key="-", max_retries=0, timeout=120)
        yield client, served.tokenizer, served.target, served.address


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, extra_body=EXTRA, **kwargs)


def test_json_object_output_parses(stack):
    client, tokenizer, *_ = stack
    # A random tiny model would wander inside strings for long: a bias toward closing them keeps outputs short.
    closing = {str(tokenizer.convert_tokens_to_ids(c)): 6 for c in ('"', "}")}
    for seed in range(2):
        reply = chat(client, response_format={"type": "json_object"}, temperature=1.0, seed=seed, logit_bias=closing)
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_json_schema_at_temperature_zero_is_the_targets_constrained_greedy(stack):
    client, tokenizer, target, _ = stack
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    text = chat(client, response_format=fmt, temperature=0).choices[0].message.content
    automaton = AutomatonCache(lambda: tokenizer).get(Constraint("json_schema", json.dumps(SCHEMA)))
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    alone = SpeculativeGenerator(ModelRunner(target, 256)).generate(
        prompt_ids, None, SamplingParams(0), 60, (tokenizer.eos_token_id,), 0, "token", automaton
    )
    assert text == tokenizer.decode(alone.token_ids, skip_special_tokens=True)
    assert json.loads(text)["kind"] in ("a", "bc")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_are_400_naming_the_parameter(stack, body, param):
    client = stack[0]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=body)
    assert err.value.body["param"] == param, err.value.body


def test_grpc_params_constraint(stack):
    """The same through the gateway's gRPC API: params.constraint (the gateway fills its start_position)."""
    address, regex = stack[3], r"(yes|no)[0-9]{2}"

    def generate(constraint: common_pb2.Constraint, seed: int) -> str:
        params = common_pb2.GenerationParams(method=common_pb2.Method(name="rsd_s", shape="3x3"), seed=seed)
        params.max_new_tokens, params.sampling.temperature = 40, 1.0
        params.constraint.CopyFrom(constraint)
        request = gateway_pb2.GenerateRequest(text="<bos> user yes or no? <eos> <bos> assistant ", params=params)
        with grpc.insecure_channel(address) as channel:
            events = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120))
        return "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")

    for seed in range(2):
        assert re.fullmatch(regex, generate(common_pb2.Constraint(regex=regex), seed))
    with pytest.raises(grpc.RpcError) as err:
        generate(common_pb2.Constraint(json_schema="{not json"), 0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.constraint" in err.value.details()

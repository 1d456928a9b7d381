"""The gateway: request validation, text streaming, sessions in both stores, failover.

Every test runs the gateway as a real grpc.aio server on loopback (on an event loop in a background
thread) and talks to it through rsd_service.client.RsdClient. Sessions live in a MemorySessionStore
or a real redis-server. Behind it run the real drafter_service and verifier_service servers on the tiny
pair; start_stack puts each drafter behind a DrafterTap, which records its runs and can slow it down,
stall it or fail it with UNAVAILABLE at a chosen step (the faults a real drafter cannot be told to make).
The `test_real_services_*` tests at the bottom find the services in the Redis registry instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from drafter_service.config import DrafterConfig
from drafter_service.server import create_server as create_drafter
from gateway.config import GatewayConfig, parse_services
from gateway.errors import RequestError
from gateway.requests import default_params, finish_reason_name, merge_params, params_to_proto, validate_params
from gateway.server import create_server
from gateway.store.memory_store import MemorySessionStore
from gateway.store.redis_store import RedisSessionStore
from gateway.text import Detokenizer, StopFilter
from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.runner import ModelRunner
from rsd_service.client import build_params
from rsd_wire import common_pb2, gateway_pb2
from tests.fixtures.stack import Stack, start_registered_services, start_stack
from verifier_service.config import VerifierConfig
from verifier_service.server import create_server as create_verifier

PROMPT = "w2 w10 w11 w12"
EOS = 1  # the tiny tokenizer's <eos>

# ---------------------------------------------------------------------------------------------
# Pure parts: config, params, text


def test_parse_services():
    assert parse_services("d0=127.0.0.1:7002, d1=host:7003") == {"d0": "127.0.0.1:7002", "d1": "host:7003"}
    assert parse_services("") == {}
    for bad in ("127.0.0.1:7002", "d0=host", "d0=a:1,d0=b:2", "bad id=a:1"):
        with pytest.raises(ValueError):
            parse_services(bad)


def test_config_checks_its_defaults():
    with pytest.raises(ValueError, match="unknown method"):
        GatewayConfig(default_method="nope")
    with pytest.raises(ValueError, match="default_max_new_tokens"):
        GatewayConfig(default_max_new_tokens=10, max_new_tokens_limit=5)
    with pytest.raises(ValueError, match="id=host:port"):
        GatewayConfig(drafters="localhost:1")
    with pytest.raises(ValueError, match="logprobs_mode"):
        GatewayConfig(logprobs_mode="processed")
    with pytest.raises(ValueError, match="verification"):
        GatewayConfig(verification="gumbel")
    assert default_params(GatewayConfig(verification="coupled"))["verification"] == "coupled"


def test_params_merge_and_validate():
    config = GatewayConfig()
    base = default_params(config)
    assert merge_params(base, None) == base
    msg = build_params(method="sd", temperature=0.0, max_new_tokens=5, stop=["\n"], seed=7)
    merged = merge_params(base, msg)
    assert merged["method"] == "sd" and merged["shape"] == "4"  # the method's default shape
    assert (merged["temperature"], merged["top_p"], merged["seed"]) == (0.0, 1.0, 7)
    assert merged["max_new_tokens"] == 5 and merged["stop_sequences"] == ["\n"]
    again = merge_params(merged, build_params(shape="2"))  # a continuation keeps what it does not name
    assert (again["method"], again["shape"], again["temperature"]) == ("sd", "2", 0.0)
    validate_params(again, config, 64)
    biased = merge_params(again, build_params(logit_bias={9: -100.0, 3: 2.5}, top_logprobs=4))
    assert biased["logit_bias"] == [[3, 2.5], [9, -100.0]] and (biased["logprobs"], biased["top_logprobs"]) == (True, 4)
    validate_params(biased, config, 64)
    later = merge_params(biased, build_params(seed=1))
    assert later["logit_bias"] == [[3, 2.5], [9, -100.0]] and not later["logprobs"]  # logprobs: the turn's own
    assert base["verification"] == again["verification"] == "token"
    chosen = merge_params(again, build_params(verification="block"))  # sd 2: a chain
    validate_params(chosen, config, 64)
    assert merge_params(chosen, build_params(seed=3))["verification"] == "block"  # "" keeps the session's
    assert params_to_proto({k: v for k, v in chosen.items() if k != "verification"}).verification == "token"
    adaptive = merge_params(again, build_params(adaptive_shape=True))
    assert adaptive["adaptive_shape"] and params_to_proto(adaptive).adaptive_shape
    validate_params(adaptive, config, 64)
    assert not merge_params(adaptive, build_params(seed=2))["adaptive_shape"]  # the turn's own
    assert base["logprobs_mode"] == "raw_logprobs"  # the gateway's --logprobs-mode
    processed = merge_params(again, build_params(logprobs_mode="processed_logits"))
    assert params_to_proto(processed).logprobs_mode == "processed_logits"
    assert merge_params(processed, build_params(seed=2))["logprobs_mode"] == "processed_logits"  # kept, as vLLM's
    processed_default = GatewayConfig(logprobs_mode="processed_logprobs")
    assert merge_params(default_params(processed_default), None)["logprobs_mode"] == "processed_logprobs"
    for change, reason in [
        ({"adaptive_shape": True, "method": "rsd_c", "shape": "2,1"}, "params.adaptive_shape: .* sd, spectr, rsd_s"),
        ({"verification": "bogus"}, "params.verification: unknown verification 'bogus'"),
        ({"method": "rsd_c", "shape": "2,1", "verification": "block"}, "params.verification: block .* one chain"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"method": "beam"}, "unknown method"),
        ({"shape": "x"}, "bad shape"),
        ({"max_new_tokens": 10_000}, "max_new_tokens"),
        ({"stop_sequences": ["a"] * 9}, "stop_sequences"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"logit_bias": [[64, 1.0]]}, "logit_bias token id 64 is outside the vocabulary"),
        ({"logit_bias": [[3, -100.01]]}, "logit_bias values"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs: needs params.logprobs"),
        ({"logprobs_mode": "logits"}, "params.logprobs_mode: must be one of raw_logprobs, raw_logits"),
    ]:
        with pytest.raises(RequestError, match=reason):
            validate_params({**again, **change}, config, 64)


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (like Qwen's) trained here on a few lines: multi-byte characters split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def add(a, b):\n    return a + b", "héllo wörld"] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _stream(detok: Detokenizer, ids: list[int], chunk: int) -> list[str]:
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_detokenizer_on_split_characters(chunk):
    tokenizer = _byte_level_tokenizer()
    context = tokenizer.encode("def f():", add_special_tokens=False)
    text = " return '你好 🙂 ünïcödé' + x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 2  # unseen characters come as single bytes
    deltas = _stream(Detokenizer(tokenizer, context), ids, chunk)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)  # a character is emitted whole, with its last byte


def test_detokenizer_keeps_the_spaces_between_words(tiny_tokenizer):
    context = tiny_tokenizer.encode("w1 w2", add_special_tokens=False)
    new = [*tiny_tokenizer.encode("w3 w4 w5", add_special_tokens=False), EOS]
    assert "".join(_stream(Detokenizer(tiny_tokenizer, context), new, 1)) == " w3 w4 w5"


def test_stop_filter():
    f = StopFilter(["STOP", "\n\n"])
    assert f.push("abc ST") == "abc "  # "ST" may start a stop sequence: held back
    assert f.push("ART ") == "START "
    assert f.push("x\n") == "x"
    assert f.push("\nnever") == "" and f.stopped
    assert f.push("more") == ""
    g = StopFilter(["STOP"])
    assert g.push("a ST") == "a " and g.push("", final=True) == "ST"
    assert StopFilter([]).push("anything") == "anything"


def reference(pair, prompt_ids, method="rsd_s", shape="3x4", max_new_tokens=24) -> list[int]:
    draft_model, target_model, _ = pair
    gen = SpeculativeGenerator(ModelRunner(target_model, 512), ModelRunner(draft_model, 512))
    out = gen.generate(prompt_ids, Method.parse(method, shape), SamplingParams(0.0), max_new_tokens, (EOS,), 0)
    return out.token_ids


def decoded_after(tokenizer, before: list[int], new: list[int]) -> str:
    full = tokenizer.decode(before + new, skip_special_tokens=True)
    return full[len(tokenizer.decode(before, skip_special_tokens=True)) :]


def greedy(**kwargs):
    return {"temperature": 0.0, "seed": 0, **kwargs}


def status_of(call: Callable) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ---------------------------------------------------------------------------------------------
# Validation and errors


def test_each_bad_field_is_invalid_argument_with_its_reason(loop, pair):
    s = start_stack(loop, pair, MemorySessionStore(), max_prompt_tokens=16, max_new_tokens_limit=64)
    bad = [
        ({}, "needs an input"),
        ({"prompt": ""}, "text: must not be empty"),
        ({"token_ids": []}, "token_ids.ids: must not be empty"),
        ({"token_ids": [4, 300]}, "token id 300 is outside"),
        ({"prompt": " ".join(["w5"] * 17)}, "max_prompt_tokens"),
        ({"prompt": PROMPT, "session_id": "no spaces!"}, "session_id"),
        ({"prompt": PROMPT, "temperature": -1.0}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0.0}, "top_p"),
        ({"prompt": PROMPT, "method": "beam"}, "unknown method"),
        ({"prompt": PROMPT, "method": "rsd_s", "shape": "3,4"}, "bad shape"),
        ({"prompt": PROMPT, "max_new_tokens": 65}, "max_new_tokens"),
        ({"prompt": PROMPT, "stop": ["x"] * 9}, "stop_sequences"),
        ({"prompt": PROMPT, "verification": "bogus"}, "params.verification: unknown verification"),
        ({"prompt": PROMPT, "method": "spectr", "verification": "block"}, "params.verification: block verification"),
        ({"prompt": PROMPT, "resume_from_position": 0}, "resume_from_position"),
        ({"prompt": PROMPT, "request_id": "r" * 129}, "request_id"),
    ]
    try:
        with s.client() as client:
            for kwargs, reason in bad:
                err = status_of(lambda kw=kwargs: client.generate(**kw).wait())
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (kwargs, err.details())
                assert reason in err.details(), (kwargs, err.details())
            for call in (
                lambda: client.generate(PROMPT, session_id="unknown").wait(),
                lambda: client.generate(session_id="unknown").wait(),
                lambda: client.get_session("unknown"),
                lambda: client.cancel("unknown"),
            ):
                assert status_of(call).code() == grpc.StatusCode.NOT_FOUND
            assert status_of(lambda: client.get_session("")).code() == grpc.StatusCode.INVALID_ARGUMENT
            # the gateway stays up and serves a good request
            assert client.generate(PROMPT, max_new_tokens=4, **greedy()).wait().finished.num_new_tokens == 4
    finally:
        s.stop()


def test_no_live_service_is_resource_exhausted(loop, pair):
    s = start_stack(loop, pair, MemorySessionStore(), num_drafters=0)
    try:
        with s.client() as client:
            err = status_of(lambda: client.generate(PROMPT).wait())
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no live drafter" in err.details()
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------
# Sessions, both stores


def test_generate_streams_committed_tokens_and_text(stack, pair):
    tokenizer = pair[2]
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    with stack.client() as client:
        gen = client.generate(PROMPT, max_new_tokens=24, request_id="r1", **greedy())
        deltas = list(gen)
        session = client.get_session(gen.session_id, include_token_ids=True)
    assert gen.started.start_position == len(prompt_ids) == gen.started.input_length_tokens
    assert gen.started.params.method.name == "rsd_s" and gen.started.params.seed == 0
    position = len(prompt_ids)
    for delta in deltas:  # contiguous: no gap, no repeat
        assert delta.start_position == position
        position += len(delta.token_ids)
    expected = reference(pair, prompt_ids)
    assert gen.token_ids == expected
    assert gen.text == decoded_after(tokenizer, prompt_ids, expected)
    assert gen.finished.committed_length_tokens == position == len(prompt_ids) + len(expected)
    assert gen.finished.num_steps == len(deltas) == len(gen.steps) >= 1
    assert gen.finished.reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS)
    assert list(session.committed_token_ids) == prompt_ids + expected
    assert list(session.prompt_token_ids) == prompt_ids
    assert session.status == gateway_pb2.SESSION_STATUS_FINISHED
    assert (session.drafter_id, session.verifier_id, session.kv_location.verifier_id) == ("d0", "v0", "v0")
    assert session.kv_location.epoch == 1 and session.kv_location.length_tokens == position - 1


def test_continue_resume_and_stick_to_the_verifier(loop, pair, store):
    s = start_stack(loop, pair, store, num_verifiers=2)
    tokenizer = pair[2]
    try:
        with s.client() as client:
            first = client.generate(PROMPT, max_new_tokens=8, **greedy()).wait()
            turn_ids = tokenizer.encode("w40 w41", add_special_tokens=False)
            second = client.generate(token_ids=turn_ids, session_id=first.session_id, max_new_tokens=6).wait()
            session = client.get_session(first.session_id, include_token_ids=True)
            replay = client.generate(session_id=first.session_id, resume_from_position=len(session.prompt_token_ids))
            replay.wait()
            follow = client.generate(session_id=first.session_id).wait()  # nothing running: ends at once
    finally:
        s.stop()
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    before_turn = prompt_ids + first.token_ids + turn_ids
    assert second.started.start_position == len(before_turn) and second.started.input_length_tokens == 2
    assert second.started.params.sampling.temperature == 0.0  # the stored params carry over
    assert second.token_ids == reference(pair, before_turn, max_new_tokens=6)
    assert list(session.committed_token_ids) == before_turn + second.token_ids
    # the continuation went to the verifier that holds the session's cache, at a new epoch
    run1, run2 = s.drafters[0].runs
    assert run1.verifier_id == run2.verifier_id == session.kv_location.verifier_id == session.verifier_id
    assert (run1.epoch, run2.epoch, session.kv_location.epoch) == (1, 2, 2)
    assert list(run2.committed_token_ids) == before_turn
    # a resume replays exactly the committed tokens after the position
    assert replay.token_ids == list(session.committed_token_ids)[len(prompt_ids) :]
    assert replay.finished.committed_length_tokens == len(session.committed_token_ids)
    assert follow.token_ids == [] and follow.started.start_position == len(session.committed_token_ids)


def test_stop_sequence_cuts_text(stack, pair):
    tokenizer = pair[2]
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    full = decoded_after(tokenizer, prompt_ids, reference(pair, prompt_ids))
    stop = full.split()[3]  # the 4th generated word
    with stack.client() as client:
        gen = client.generate(PROMPT, max_new_tokens=24, stop=[stop], **greedy()).wait()
        resumed = client.generate(session_id=gen.session_id, resume_from_position=gen.started.start_position).wait()
    assert gen.finished.reason == common_pb2.FINISH_REASON_STOP_SEQUENCE
    assert gen.text == full[: full.index(stop)]
    assert resumed.finished.reason == common_pb2.FINISH_REASON_STOP_SEQUENCE  # the store kept why it ended


def test_cancel_and_busy_session(loop, pair, store):
    s = start_stack(loop, pair, store, drafter_kwargs={"step_delay_s": 0.05})
    try:
        with s.client() as client:
            gen = client.generate(PROMPT, max_new_tokens=400, **greedy())
            events = iter(gen)
            next(events)  # one step is in
            busy = status_of(lambda: client.generate("w5", session_id=gen.session_id).wait())
            reply = client.cancel(gen.session_id)
            rest = list(events)
            again = client.cancel(gen.session_id)
            session = client.get_session(gen.session_id)
    finally:
        s.stop()
    assert busy.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reply.was_running and not again.was_running
    assert gen.finished.reason == common_pb2.FINISH_REASON_CANCELLED
    assert len(rest) < 400 and gen.finished.committed_length_tokens == session.committed_length_tokens
    assert session.status == gateway_pb2.SESSION_STATUS_CANCELLED
    assert session.last_finish_reason == common_pb2.FINISH_REASON_CANCELLED


class SlowFinish:
    """A real store whose write of a turn's final status is slow: the window in which a client that has seen
    the end of its stream could still read RUNNING if the gateway sent the end before writing it."""

    def __init__(self, store, delay_s: float):
        self._store, self._delay_s = store, delay_s

    def __getattr__(self, name):
        return getattr(self._store, name)

    def update_session(self, session_id, **fields):
        if "finish_reason" in fields:
            time.sleep(self._delay_s)
        return self._store.update_session(session_id, **fields)


def test_a_finished_stream_reads_finished_in_the_store(loop, pair, store):
    s = start_stack(loop, pair, SlowFinish(store, 0.3))
    try:
        with s.client() as client:
            gen = client.generate(PROMPT, max_new_tokens=6, **greedy()).wait()
            session = client.get_session(gen.session_id)
            again = client.cancel(gen.session_id)
            follow = client.generate("w5", session_id=gen.session_id, max_new_tokens=2, **greedy()).wait()
    finally:
        s.stop()
    assert session.status == gateway_pb2.SESSION_STATUS_FINISHED and not again.was_running
    assert follow.finished.num_new_tokens == 2  # not refused as busy


def _orphan(store, pair, committed: int) -> tuple[str, list[int], list[int]]:
    """A session as a gateway leaves it when it dies mid-turn: RUNNING at epoch 1, `committed` tokens of its
    greedy run in. -> (session id, prompt ids, the whole greedy run)."""
    prompt_ids = pair[2].encode(PROMPT, add_special_tokens=False)
    expected = reference(pair, prompt_ids, max_new_tokens=8)
    params = {**default_params(GatewayConfig(tokenizer="x")), **greedy(), "max_new_tokens": 8}
    store.create_session("orphan", prompt_ids, {**params, "turn_start": len(prompt_ids)})
    epoch = store.begin_epoch("orphan", 0, "d0", "v0")
    store.append_tokens("orphan", len(prompt_ids), expected[:committed], epoch)
    return "orphan", prompt_ids, expected


def _wait_until_not_running(store, session_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (record := store.get_session(session_id)).status == "running":
        assert time.monotonic() < deadline, f"{session_id} still running after {timeout_s} s"
        time.sleep(0.05)
    return record


def _wait_lease_expired(store, session_id: str, lease_s: float) -> None:
    """Until the store's own clock says the lease is over (nothing is compared to this process's clock)."""
    while store.now_ms() - store.get_session(session_id).updated_unix_ms <= lease_s * 1000:
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_orphan_sweep_finishes_a_turn_whose_gateway_died(loop, pair, kind, request):
    """No client comes back: the sweep takes the turn over once its lease expired on the store's clock,
    and the turn ends as the uninterrupted run would; a resume then reports why it ended."""
    clock = [1_000_000.0]
    if kind == "memory":  # the store's clock is injected: only it decides when the lease is over
        store, lease_s = MemorySessionStore(clock=lambda: clock[0]), 5.0
    else:
        url = request.getfixturevalue("redis_url")
        store, lease_s = RedisSessionStore.from_url(url, f"rsd-test-orphan-{time.monotonic_ns()}"), 0.3
    session_id, prompt_ids, expected = _orphan(store, pair, committed=2)
    s = start_stack(loop, pair, store, turn_lease_s=lease_s, orphan_sweep_s=0)  # sweeps called here
    try:
        if kind == "memory":
            assert loop.run(s.engine.sweep_orphans()) == []  # lease not over on the store's clock
            clock[0] += lease_s + 0.001
        else:
            _wait_lease_expired(store, session_id, lease_s)
        assert store.running_sessions() == [session_id]
        assert loop.run(s.engine.sweep_orphans()) == [session_id]
        record = _wait_until_not_running(store, session_id)
        with s.client() as client:
            resumed = client.generate(session_id=session_id, resume_from_position=len(prompt_ids)).wait()
            session = client.get_session(session_id)
    finally:
        s.stop()
    assert record.status == "finished" and record.epoch == 2 and store.running_sessions() == []
    assert list(record.committed_ids) == prompt_ids + expected  # as if the gateway had never died
    assert s.drafters[0].runs[0].committed_token_ids == prompt_ids + expected[:2]
    reason = common_pb2.FINISH_REASON_EOS if expected[-1] == EOS else common_pb2.FINISH_REASON_LENGTH
    assert record.finish_reason == finish_reason_name(reason)
    assert resumed.token_ids == expected and resumed.finished.reason == reason == session.last_finish_reason


def test_orphan_sweep_fails_a_turn_no_service_can_take(loop, pair):
    clock = [1_000_000.0]
    store = MemorySessionStore(clock=lambda: clock[0])
    session_id, _, _ = _orphan(store, pair, committed=1)
    s = start_stack(loop, pair, store, num_drafters=0, num_verifiers=0, turn_lease_s=5.0, orphan_sweep_s=0)
    try:  # no static services, and none registered in the store
        clock[0] += 6.0
        assert loop.run(s.engine.sweep_orphans()) == [session_id]
    finally:
        s.stop()
    record = store.get_session(session_id)
    assert (record.status, record.finish_reason, record.epoch) == ("failed", "", 2)  # claimed, then failed
    assert store.running_sessions() == []


def test_concurrent_sessions(loop, pair):
    s = start_stack(loop, pair, MemorySessionStore(), num_drafters=2, num_verifiers=2)
    tokenizer = pair[2]
    prompts = [f"w2 w{10 + i} w{30 + 2 * i}" for i in range(8)]
    results: dict[int, object] = {}

    def run(i):
        with s.client() as client:
            results[i] = client.generate(prompts[i], max_new_tokens=12, method="sd", shape="3", **greedy()).wait()

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        s.stop()
    assert sorted(results) == list(range(8))
    for i, gen in results.items():
        prompt_ids = tokenizer.encode(prompts[i], add_special_tokens=False)
        assert gen.token_ids == reference(pair, prompt_ids, "sd", "3", 12), i
    assert {r.session_id for r in results.values()}.__len__() == 8
    assert all(d.runs for d in s.drafters)  # the load spread over both drafters
    # ... and over both verifiers, although all 8 picks happen at once (each pick is held before any await)
    assert len({run.verifier_address for d in s.drafters for run in d.runs}) == 2


@pytest.mark.parametrize("dead", ["drafter", "verifier"])
def test_failover_mid_run_has_no_gap_and_no_repeat(loop, pair, store, dead):
    s = start_stack(loop, pair, store, num_drafters=2, num_verifiers=2, drafter_kwargs={"fail_after_steps": 2})
    s.drafters[1].fail_after_steps = None

    async def play_dead():
        if dead == "drafter":
            await s.drafter_health[0].set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        else:
            await s.verifier_servers[0].stop(0)

    s.drafters[0].on_fail = play_dead
    tokenizer = pair[2]
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    try:
        with s.client() as client:
            gen = client.generate(PROMPT, max_new_tokens=24, **greedy())
            deltas = list(gen)
            session = client.get_session(gen.session_id, include_token_ids=True)
    finally:
        s.stop()
    expected = reference(pair, prompt_ids)
    assert gen.token_ids == expected and gen.text == decoded_after(tokenizer, prompt_ids, expected)
    position = len(prompt_ids)
    for delta in deltas:
        assert delta.start_position == position
        position += len(delta.token_ids)
    assert list(session.committed_token_ids) == prompt_ids + expected
    assert session.kv_location.epoch == 2 and session.status == gateway_pb2.SESSION_STATUS_FINISHED
    first = s.drafters[0].runs[0]
    second = (s.drafters[1] if dead == "drafter" else s.drafters[0]).runs[-1]
    assert first.epoch == 1 and second.epoch == 2
    assert len(second.committed_token_ids) > len(prompt_ids)  # re-run from the committed tokens
    assert list(second.committed_token_ids) == list(session.committed_token_ids)[: len(second.committed_token_ids)]
    if dead == "drafter":
        assert session.drafter_id == "d1" and second.verifier_id == "v0"
    else:
        assert session.verifier_id == "v1" and second.verifier_id == "v1"


# ---------------------------------------------------------------------------------------------
# Through the real drafter and verifier services

REAL_METHODS = [("sd", "4"), ("specinfer", "2,2,1"), ("spectr", "3x3"), ("rsd_c", "2,2,1"), ("rsd_s", "3x4")]


@pytest.fixture(scope="module")
def real_stack(loop, pair, tiny_tokenizer, redis_url):
    """Verifier and drafter servers that register in Redis; the gateway finds them in the registry."""
    namespace = f"rsd-test-real-{time.monotonic_ns()}"
    registry = {"redis_url": redis_url, "redis_namespace": namespace}
    stack = Stack(loop)
    closers = []

    async def start():
        closers.extend(await start_registered_services(pair, registry))
        cfg = GatewayConfig(port=0, **registry)  # no static lists: the registry
        store = RedisSessionStore.from_url(redis_url, namespace=namespace)
        gserver, gport, ghandle = await create_server(cfg, store=store, tokenizer=tiny_tokenizer)
        stack.servers.append(gserver)
        stack.address, stack.engine = f"127.0.0.1:{gport}", ghandle.engine

    async def close_services():
        for handle, server in closers:
            await handle.close(server, 0)

    loop.run(start(), timeout_s=120)
    yield stack
    stack.stop()
    loop.run(close_services())


@pytest.mark.parametrize(("method", "shape"), REAL_METHODS)
def test_real_services_greedy_equals_in_process(real_stack, pair, method, shape):
    prompt_ids = pair[2].encode(PROMPT, add_special_tokens=False)
    with real_stack.client() as client:
        gen = client.generate(PROMPT, method=method, shape=shape, max_new_tokens=24, **greedy()).wait()
    assert gen.token_ids == reference(pair, prompt_ids, method, shape)
    assert gen.finished.num_steps >= 1


def test_real_services_apply_and_record_the_verification(real_stack, pair):
    """GenerateRequest params.verification reaches the verifier: at T = 0 every rule gives the target's greedy
    output; a seeded T = 1 turn with traversal equals the in-process generator's with that seed and rule. The
    started event echoes the verification, each step's stats name the rule, and a continuation keeps it."""
    draft_model, target_model, tokenizer = pair
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    gen = SpeculativeGenerator(ModelRunner(target_model, 512), ModelRunner(draft_model, 512), draft_top_k=256)
    method = Method.parse("rsd_c", "2,2,1")
    expected = gen.generate(prompt_ids, method, SamplingParams(1.0), 24, (EOS,), 11, "traversal").token_ids
    with real_stack.client() as client:
        for name, shape, verification in [("sd", "3", "block"), ("rsd_c", "2,2,1", "traversal")]:
            greedy_run = client.generate(
                PROMPT, method=name, shape=shape, max_new_tokens=24, verification=verification, **greedy()
            ).wait()
            assert greedy_run.token_ids == reference(pair, prompt_ids, name, shape), verification
            assert {s.verifier.rule for s in greedy_run.steps} == {"greedy"}
        sampled = client.generate(
            PROMPT, method="rsd_c", shape="2,2,1", temperature=1.0, seed=11, max_new_tokens=24, verification="traversal"
        ).wait()
        more = client.generate(" w5", session_id=sampled.session_id, max_new_tokens=4).wait()
    assert sampled.token_ids == expected
    assert sampled.started.params.verification == more.started.params.verification == "traversal"
    assert {s.verifier.rule for s in sampled.steps + more.steps} == {"traversal"}


def test_real_services_concurrent_sessions(real_stack, pair):
    prompts = [f"w2 w{10 + i} w{30 + 2 * i}" for i in range(8)]
    results: dict[int, object] = {}

    def run(i):
        with real_stack.client() as client:
            results[i] = client.generate(prompts[i], max_new_tokens=12, **greedy()).wait()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(8))
    for i, gen in results.items():
        assert gen.token_ids == reference(pair, pair[2].encode(prompts[i], add_special_tokens=False), max_new_tokens=12)


def test_real_services_continuation_reuses_the_verifier_cache(real_stack, pair):
    tokenizer = pair[2]
    with real_stack.client() as client:
        first = client.generate(PROMPT, max_new_tokens=8, **greedy()).wait()
        after_first = client.get_session(first.session_id)
        turn = tokenizer.encode("w40 w41", add_special_tokens=False)
        second = client.generate(token_ids=turn, session_id=first.session_id, max_new_tokens=8).wait()
        after = client.get_session(first.session_id, include_token_ids=True)
    before_turn = tokenizer.encode(PROMPT, add_special_tokens=False) + first.token_ids + turn
    assert second.token_ids == reference(pair, before_turn, max_new_tokens=8)
    assert after.verifier_id == after_first.kv_location.verifier_id == "v0"
    assert after_first.kv_location.length_tokens == after_first.committed_length_tokens - 1
    assert after.kv_location.epoch == 2
    assert after.kv_location.length_tokens == after.committed_length_tokens - 1


def test_real_services_verifier_failover(loop, pair, tiny_tokenizer):
    """Two real verifiers; the one serving the session stops mid-run. The drafter's stream fails, the
    gateway re-runs from the committed tokens on the other verifier: same text as an undisturbed run."""
    draft_model, target_model, _ = pair
    stack, services = Stack(loop), {}

    async def start():
        for vid in ("v0", "v1"):
            services[vid] = await create_verifier(VerifierConfig(verifier_id=vid), target_model)
        services["d0"] = await create_drafter(DrafterConfig(drafter_id="d0"), draft_model)
        listed = {k: f"{k}=127.0.0.1:{port}" for k, (_, port, _) in services.items()}
        cfg = GatewayConfig(port=0, drafters=listed["d0"], verifiers=f"{listed['v0']},{listed['v1']}")
        gserver, gport, ghandle = await create_server(cfg, store=MemorySessionStore(), tokenizer=tiny_tokenizer)
        stack.servers.append(gserver)
        stack.address, stack.engine = f"127.0.0.1:{gport}", ghandle.engine

    async def close(names):
        for name in names:
            server, _, handle = services[name]
            await handle.close(server, 0)

    loop.run(start(), timeout_s=120)
    prompt_ids = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)
    try:
        with stack.client() as client:
            gen = client.generate(PROMPT, max_new_tokens=200, method="sd", shape="2", **greedy())
            events = iter(gen)
            first = next(events)
            loop.run(close(["v0"]))
            deltas = [first, *events]
            session = client.get_session(gen.session_id, include_token_ids=True)
    finally:
        stack.stop()
        loop.run(close(["d0", "v1"]))
    assert first.start_position == len(prompt_ids)
    expected = reference(pair, prompt_ids, "sd", "2", 200)
    assert gen.token_ids == expected
    assert gen.text == decoded_after(tiny_tokenizer, prompt_ids, expected)
    position = len(prompt_ids)
    for delta in deltas:  # no gap, no repeat
        assert delta.start_position == position
        position += len(delta.token_ids)
    assert list(session.committed_token_ids) == prompt_ids + expected
    assert session.verifier_id == "v1" and session.kv_location.epoch == 2


def test_context_length_is_the_smallest_advertised_max_len():
    """input + max_new_tokens + the method's tree nodes (node 0 included) may reach the smallest max_len
    the picked services advertise, not pass it; a service that advertises none (0: static lists) is not
    a limit."""
    from gateway.errors import ContextLengthExceeded
    from gateway.requests import check_context_length
    from rsd_service.registry import ServiceInfo

    params = {**default_params(GatewayConfig()), "method": "rsd_s", "shape": "3x4", "max_new_tokens": 30}
    nodes = Method.parse("rsd_s", "3x4").max_draft_tokens + 1
    drafter, verifier = ServiceInfo("drafter", "d0", "a:1", max_len=100), ServiceInfo("verifier", "v0", "b:1")
    check_context_length(100 - 30 - nodes, params, (drafter, verifier))  # exactly the limit
    check_context_length(10_000, params, (ServiceInfo("drafter", "d0", "a:1"), verifier))  # nothing advertised
    with pytest.raises(ContextLengthExceeded, match=r"maximum context length is 100 tokens \(drafter d0 max_len\)"):
        check_context_length(100 - 30 - nodes + 1, params, (drafter, verifier))
    small = ServiceInfo("verifier", "v1", "b:1", max_len=64)
    with pytest.raises(
        RequestError, match=f"64 tokens \\(verifier v1 max_len\\), but the turn needs {30 + 30 + nodes}"
    ):
        check_context_length(30, params, (drafter, small))


def test_real_services_refuse_a_turn_over_their_max_len(real_stack, pair):
    """The services advertise their max_len in the registry; a turn that would pass it is INVALID_ARGUMENT
    before anything runs or is stored (a continuation's session stays as it was), one that fits runs."""
    for role in ("drafter", "verifier"):
        assert [s.max_len for s in real_stack.loop.run(real_stack.engine.services.live(role))] == [2048]
    prompt_ids = pair[2].encode(PROMPT, add_special_tokens=False)
    nodes = Method.parse("sd", "4").max_draft_tokens + 1
    fits = 2048 - len(prompt_ids) - nodes
    with real_stack.client() as client:
        err = status_of(lambda: client.generate(PROMPT, method="sd", shape="4", max_new_tokens=fits + 1).wait())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "maximum context length is 2048 tokens" in err.details() and "needs 2049" in err.details()
        first = client.generate(PROMPT, method="sd", shape="4", max_new_tokens=8, **greedy()).wait()
        before = client.get_session(first.session_id, include_token_ids=True)
        turn = [5, 6]
        over = 2048 - before.committed_length_tokens - len(turn) - nodes + 1
        err = status_of(
            lambda: client.generate(token_ids=turn, session_id=first.session_id, max_new_tokens=over).wait()
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs 2049" in err.details()
        after = client.get_session(first.session_id, include_token_ids=True)
        assert after == before  # nothing stored: same tokens, status, epoch
        second = client.generate(token_ids=turn, session_id=first.session_id, max_new_tokens=4, **greedy()).wait()
        assert second.finished.num_new_tokens == 4

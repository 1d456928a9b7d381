"""Hostile input at every RPC edge: Gateway Generate / Cancel / GetSession, Drafter Run / Cancel, Verifier
Attach / Verify / Release.

Hypothesis (derandomized, bounded examples) builds malformed messages: trees with cycles and wrong
parents, out-of-vocabulary ids, NaN / negative / unnormalised probabilities, tensors whose dtype, shape
and bytes disagree, huge sizes, unknown sessions, another session's id at a wrong epoch, oversized
prompts, invalid sampling params. Each must get a status with a reason that names the problem,
never INTERNAL or UNKNOWN; a well-formed request that happens to come out is served.

A victim session runs through the gateway first. After the fuzzing its verifier state (committed
sequence, cached length) and store record are unchanged, and its next turn equals the in-process
reference: hostile traffic touched no one else. All servers are in-process (one event loop in a
thread) on the tiny Qwen2 pair; the test talks to them with synchronous stubs.
"""

from __future__ import annotations

import asyncio
import math
import threading

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafter_service import server as drafter_server
from drafter_service.config import DrafterConfig
from gateway.config import GatewayConfig
from gateway.server import create_server as create_gateway
from gateway.store.memory_store import MemorySessionStore
from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd.tree import DraftTree
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import load_model
from rsd_runtime.runner import ModelRunner
from rsd_runtime.tokenizer import load_tokenizer
from rsd_tools.tiny import build_tiny_pair
from rsd_wire import (
    GRPC_OPTIONS,
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from rsd_wire.convert import draft_tree_to_proto, tensor_to_proto
from verifier_service import server as verifier_server
from verifier_service.config import VerifierConfig

MAX_LEN = 256
VICTIM_PROMPT = [2, 10, 11, 12]
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FUZZ = settings(
    max_examples=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


class Servers:
    """Verifier, drafter and gateway on an event loop in a background thread; sync stubs to each."""

    def __init__(self, tmp_path):
        draft_dir, target_dir = build_tiny_pair(tmp_path, "qwen2")
        self.draft, self.target = load_model(draft_dir), load_model(target_dir)
        self.vocab = self.target.config.vocab_size
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.closers = []
        self.run(self._start(load_tokenizer(target_dir)))

    def run(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self, tokenizer) -> None:
        vcfg = VerifierConfig(max_len=MAX_LEN, num_slots=64, verifier_id="v0")
        vserver, _, self.v = await verifier_server.create_server(vcfg, self.target)
        dserver, _, self.d = await drafter_server.create_server(DrafterConfig(max_len=MAX_LEN), self.draft)
        gcfg = GatewayConfig(
            port=0,
            drafters=f"d0={self.d.address}",
            verifiers=f"v0={self.v.address}",
            max_prompt_tokens=64,
            max_session_tokens=MAX_LEN - 40,
            max_new_tokens_limit=16,
            default_max_new_tokens=8,
        )
        gserver, gport, self.g = await create_gateway(gcfg, store=MemorySessionStore(), tokenizer=tokenizer)
        self.gateway_address = f"127.0.0.1:{gport}"
        self.closers = [(self.g, gserver), (self.d, dserver), (self.v, vserver)]
        self.channels = [
            grpc.insecure_channel(a, options=GRPC_OPTIONS)
            for a in (self.gateway_address, self.d.address, self.v.address)
        ]
        self.gateway = gateway_pb2_grpc.GatewayStub(self.channels[0])
        self.drafter = drafter_pb2_grpc.DrafterStub(self.channels[1])
        self.verifier = verifier_pb2_grpc.VerifierStub(self.channels[2])

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

        async def stop():
            for handle, server in self.closers:
                await handle.close(server, 0)

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    s = Servers(tmp_path_factory.mktemp("tiny"))
    yield s
    s.close()


def greedy_params(max_new_tokens: int = 12) -> common_pb2.GenerationParams:
    params = common_pb2.GenerationParams(
        sampling=common_pb2.SamplingParams(temperature=0.0),
        method=common_pb2.Method(name="rsd_c", shape="2,2"),
        max_new_tokens=max_new_tokens,
    )
    params.seed = 0
    return params


def generate(servers: Servers, request: gateway_pb2.GenerateRequest) -> tuple[str, list[int]]:
    session_id, ids = "", []
    for event in servers.gateway.Generate(request, timeout=60):
        session_id = event.session_id
        if event.WhichOneof("event") == "delta":
            ids += event.delta.token_ids
    return session_id, ids


def reference(servers: Servers, prompt: list[int], new_tokens: int) -> list[int]:
    gen = SpeculativeGenerator(ModelRunner(servers.target, MAX_LEN), ModelRunner(servers.draft, MAX_LEN))
    out = gen.generate(prompt, Method.parse("rsd_c", "2,2"), SamplingParams(0.0), new_tokens, (1,), 0)
    return out.token_ids


@pytest.fixture(scope="module")
def victim(servers):
    """A session that ran one turn; its state before the fuzzing."""
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=VICTIM_PROMPT), params=greedy_params())
    session_id, ids = generate(servers, request)
    assert ids == reference(servers, VICTIM_PROMPT, 12)
    session = servers.v.servicer.sessions[session_id]
    state = (list(session.committed), session.epoch, servers.v.engine.cached_length(session_id))
    return session_id, state


def expect_refusal(call, allowed=REFUSALS):
    """Run `call`; it may succeed (a well-formed request) or fail with an allowed status and a reason."""
    try:
        return call()
    except grpc.RpcError as e:
        assert e.code() not in FORBIDDEN, f"{e.code()}: {e.details()}"
        assert e.code() in allowed, f"{e.code()}: {e.details()}"
        assert e.details(), f"{e.code()} without a reason"
        return e


# ---------------------------------------------------------------------------------------------
# Strategies

ids = st.integers(min_value=-(2**40), max_value=2**40)
vocab_ids = st.integers(min_value=0, max_value=63)
floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
session_ids = st.one_of(
    st.sampled_from(["fz0", "fz1", "fz2", "nobody", "", "a b", "x" * 129, "../../etc", "é", "s\x00"]),
    st.text(max_size=20),
)


@st.composite
def tensors(draw, kind: str) -> common_pb2.Tensor:
    """A Tensor message that is sometimes consistent, often not."""
    if draw(st.booleans()):  # consistent bytes for a drawn dtype and shape
        dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.float32, torch.float16, torch.bool]))
        n = draw(st.integers(0, 12))
        if dtype.is_floating_point:
            values = draw(st.lists(floats if kind == "probs" else st.floats(-2, 2), min_size=n, max_size=n))
        else:
            values = draw(
                st.lists(st.integers(-3, 70) if dtype != torch.bool else st.integers(0, 1), min_size=n, max_size=n)
            )
        t = torch.tensor(values, dtype=dtype)
        shape = draw(st.sampled_from([[n], [1, n], [n, 1], []])) if n else [0]
        if math.prod(shape) != n:
            shape = [n]
        msg = tensor_to_proto(t)
        del msg.shape[:]
        msg.shape.extend(shape)
        return msg
    return common_pb2.Tensor(
        dtype=draw(st.integers(-1, 14)),
        shape=draw(st.lists(st.integers(-(2**62), 2**62), max_size=4)),
        data=draw(st.binary(max_size=64)),
    )


@st.composite
def trees(draw, servers: Servers, session_id: str, epoch: int, root_position: int, root: int, breakage: str):
    """A valid DraftTree with one thing broken (or none)."""
    n = draw(st.integers(2, 5))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    token_ids = [root] + [draw(vocab_ids) for _ in range(n - 1)]
    probs = torch.zeros(n, servers.vocab)
    for node in set(parents[1:]):
        probs[node] = torch.softmax(torch.randn(servers.vocab, generator=torch.Generator().manual_seed(node)), -1)
    tree = DraftTree(torch.tensor(token_ids), torch.tensor(parents), probs)
    msg = draft_tree_to_proto(tree, session_id=session_id, epoch=epoch, root_position=root_position)
    parent_tensor = msg.parent_idx
    if breakage == "cycle":
        parents[1] = n - 1 if n > 2 else 1
        parent_tensor.data = torch.tensor(parents).numpy().tobytes()
    elif breakage == "forward_parent":
        parents[-1] = n + draw(st.integers(0, 2**20))
        parent_tensor.data = torch.tensor(parents).numpy().tobytes()
    elif breakage == "oov":
        token_ids[-1] = draw(st.sampled_from([servers.vocab, -1, 2**40]))
        msg.token_ids.data = torch.tensor(token_ids).numpy().tobytes()
    elif breakage in ("nan", "negative", "unnormalised"):
        law = msg.laws[0]
        values = torch.frombuffer(bytearray(law.probs.data), dtype=torch.float32).clone()
        values[0] = {"nan": float("nan"), "negative": -0.5, "unnormalised": values[0] + 3.0}[breakage]
        law.probs.data = values.numpy().tobytes()
    elif breakage == "vocab":
        msg.vocab_size = draw(st.integers(0, 2**32 - 1))
    elif breakage == "laws":
        del msg.laws[draw(st.integers(0, len(msg.laws) - 1))]
        if draw(st.booleans()):
            msg.laws.add(node_idx=draw(st.integers(0, 2**32 - 1)), probs=draw(tensors("probs")))
    elif breakage == "tensor":
        getattr(msg, draw(st.sampled_from(["token_ids", "parent_idx"]))).CopyFrom(draw(tensors("ids")))
    return msg


sampling = st.builds(
    common_pb2.SamplingParams,
    temperature=st.one_of(st.none(), floats),
    top_k=st.integers(0, 2**32 - 1),
    top_p=st.one_of(st.none(), floats),
    presence_penalty=floats,
    frequency_penalty=floats,
    repetition_penalty=st.one_of(st.none(), floats),
)
methods = st.builds(
    common_pb2.Method,
    name=st.sampled_from(["sd", "specinfer", "spectr", "rsd_c", "rsd_s", "ar", "", "beam", "RSD_S"]),
    shape=st.one_of(
        st.sampled_from(["2", "2,2", "2x2", "0", "-1", "1000x1000", "9999999999", "", "x", "2,,2"]), st.text(max_size=8)
    ),
)


@st.composite
def gen_params(draw) -> common_pb2.GenerationParams | None:
    if draw(st.booleans()):
        return None
    params = common_pb2.GenerationParams(
        max_new_tokens=draw(st.sampled_from([0, 1, 4, 16, 17, 2**32 - 1])),
        stop_sequences=draw(st.lists(st.text(max_size=300), max_size=10)),
    )
    if draw(st.booleans()):
        params.sampling.CopyFrom(draw(sampling))
    if draw(st.booleans()):
        params.method.CopyFrom(draw(methods))
    if draw(st.booleans()):
        params.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        params.verification = draw(st.one_of(st.sampled_from(["token", "traversal", "block", "Token"]), st.text()))
    return params


# ---------------------------------------------------------------------------------------------
# The verifier

BREAKAGES = ["cycle", "forward_parent", "oov", "nan", "negative", "unnormalised", "vocab", "laws", "tensor", "none"]


@FUZZ
@given(data=st.data(), breakage=st.sampled_from(BREAKAGES), root_position=st.sampled_from([3, 3, 0, 2**63]))
def test_fuzz_verify_trees(servers, data, breakage, root_position):
    """Trees for a session attached just before, so each tree is checked against a known state."""
    attach = verifier_pb2.AttachRequest(session_id="fz-tree", epoch=1, committed_token_ids=VICTIM_PROMPT)
    attach.params.CopyFrom(greedy_params())
    servers.verifier.Attach(attach, timeout=30)
    msg = data.draw(trees(servers, "fz-tree", 1, root_position, VICTIM_PROMPT[-1], breakage))
    try:
        expect_refusal(lambda: next(iter(servers.verifier.Verify(iter([msg]), timeout=30))))
    finally:
        servers.verifier.Release(verifier_pb2.ReleaseRequest(session_id="fz-tree", epoch=1), timeout=30)


@FUZZ
@given(data=st.data(), breakage=st.sampled_from(BREAKAGES))
def test_fuzz_verify_another_sessions_id(servers, victim, data, breakage):
    """The victim's id at any epoch but its own, or an unknown session."""
    victim_id, (committed, victim_epoch, _) = victim
    sid = data.draw(st.sampled_from([victim_id, victim_id, "fz-unknown"]))
    epoch = data.draw(st.integers(0, 2**64 - 1).filter(lambda e: e != victim_epoch))
    msg = data.draw(trees(servers, sid, epoch, len(committed) - 1, committed[-1], breakage))
    expect_refusal(lambda: next(iter(servers.verifier.Verify(iter([msg]), timeout=30))))


@FUZZ
@given(
    sid=st.sampled_from(["fz0", "fz1", "fz0", "", "a b", "x" * 129, "é"]),
    epoch=st.integers(0, 2**64 - 1),
    committed=st.one_of(
        st.lists(vocab_ids, min_size=1, max_size=8),
        st.lists(ids, max_size=8),
        st.lists(vocab_ids, min_size=MAX_LEN - 2, max_size=MAX_LEN + 2),
    ),
    params=gen_params(),
)
def test_fuzz_attach(servers, sid, epoch, committed, params):
    request = verifier_pb2.AttachRequest(session_id=sid, epoch=epoch, committed_token_ids=committed)
    if params is not None:
        request.params.CopyFrom(params)
    attached = not isinstance(expect_refusal(lambda: servers.verifier.Attach(request, timeout=30)), grpc.RpcError)
    if attached:
        servers.verifier.Release(verifier_pb2.ReleaseRequest(session_id=sid, epoch=epoch), timeout=30)


@FUZZ
@given(data=st.data(), epoch=st.integers(0, 2**64 - 1))
def test_fuzz_attach_and_release_another_sessions_id(servers, victim, data, epoch):
    """Attach at an older epoch, Release at any epoch but the victim's own: refused or a no-op."""
    victim_id, (committed, victim_epoch, _) = victim
    if data.draw(st.booleans()):
        older = data.draw(st.integers(0, victim_epoch - 1))
        tokens = data.draw(st.sampled_from([committed, committed[:2], [5, 6, 7]]))
        request = verifier_pb2.AttachRequest(session_id=victim_id, epoch=older, committed_token_ids=tokens)
        request.params.CopyFrom(greedy_params())
        expect_refusal(lambda: servers.verifier.Attach(request, timeout=30))
    else:
        sid = data.draw(st.sampled_from([victim_id, "", "nobody", "a b"]))
        if sid == victim_id and epoch == victim_epoch:
            epoch += 1
        reply = expect_refusal(
            lambda: servers.verifier.Release(verifier_pb2.ReleaseRequest(session_id=sid, epoch=epoch))
        )
        assert isinstance(reply, grpc.RpcError) == (sid in ("", "a b"))  # a malformed id is refused
        assert not getattr(reply, "released", False)


# ---------------------------------------------------------------------------------------------
# The drafter


@FUZZ
@given(
    sid=st.sampled_from(["fz-run", "fz-run", "", "a b", "x" * 129]),
    epoch=st.integers(0, 2**64 - 1),
    committed=st.one_of(st.lists(vocab_ids, min_size=1, max_size=6), st.lists(ids, max_size=6)),
    params=gen_params(),
    max_new_tokens=st.sampled_from([0, 1, 3, 3, MAX_LEN, 2**32 - 1]),
    eos=st.lists(st.one_of(vocab_ids, ids), max_size=3),
    address=st.sampled_from(["verifier", "verifier", "", "127.0.0.1:1", "not an address"]),
    cancel=st.booleans(),
)
def test_fuzz_drafter(servers, sid, epoch, committed, params, max_new_tokens, eos, address, cancel):
    if cancel:
        cancel_request = drafter_pb2.CancelRunRequest(session_id=sid, epoch=epoch)
        reply = expect_refusal(lambda: servers.drafter.Cancel(cancel_request, timeout=30))
        assert isinstance(reply, grpc.RpcError) == (sid != "fz-run")  # a malformed id is refused
        return
    request = drafter_pb2.RunRequest(
        session_id=sid,
        epoch=epoch,
        committed_token_ids=committed,
        params=params or common_pb2.GenerationParams(),
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos,
        verifier_address=servers.v.address if address == "verifier" else address,
    )
    # An unreachable verifier is UNAVAILABLE by contract (the gateway fails over to another one).
    allowed = REFUSALS | {grpc.StatusCode.UNAVAILABLE} if address != "verifier" else REFUSALS
    expect_refusal(lambda: list(servers.drafter.Run(request, timeout=60)), allowed)


@FUZZ
@given(data=st.data())
def test_fuzz_drafter_run_of_another_session(servers, victim, data):
    """The victim's id at an older epoch: the verifier refuses it, the drafter passes that on."""
    victim_id, (committed, victim_epoch, _) = victim
    request = drafter_pb2.RunRequest(
        session_id=victim_id,
        epoch=data.draw(st.integers(0, victim_epoch - 1)),
        committed_token_ids=data.draw(st.sampled_from([committed, [5, 6, 7]])),
        params=greedy_params(),
        max_new_tokens=4,
        verifier_address=servers.v.address,
    )
    error = expect_refusal(lambda: list(servers.drafter.Run(request, timeout=60)))
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.FAILED_PRECONDITION


# ---------------------------------------------------------------------------------------------
# The gateway


@FUZZ
@given(
    sid=st.sampled_from(["", "", "", "fz0", "a b", "x" * 129]),
    kind=st.sampled_from(["text", "ids", "long_ids", "long_text", "messages", "none"]),
    data=st.data(),
    params=gen_params(),
    resume=st.one_of(st.none(), st.none(), st.integers(0, 2**64 - 1)),
    request_id=st.sampled_from(["", "", "r1", "x" * 200]),
)
def test_fuzz_generate(servers, sid, kind, data, params, resume, request_id):
    request = gateway_pb2.GenerateRequest(session_id=sid, request_id=request_id)
    if kind == "text":
        request.text = data.draw(st.text(max_size=40) | st.just("w5 w6 w7"))
    elif kind == "ids":
        request.token_ids.ids.extend(data.draw(st.lists(ids, max_size=8) | st.lists(vocab_ids, min_size=1, max_size=8)))
    elif kind == "long_ids":
        request.token_ids.ids.extend([5] * data.draw(st.sampled_from([65, 10_000])))
    elif kind == "long_text":
        request.text = "w5 " * data.draw(st.sampled_from([65, 20_000]))
    elif kind == "messages":  # empty lists and roles, over-long roles, template syntax as content
        role = st.sampled_from(["user", "system", "assistant", ""]) | st.text(max_size=70)
        content = st.text(max_size=40) | st.just("w5 {{ 7 * 7 }} {% endfor %}")
        request.messages.SetInParent()
        for r, c in data.draw(st.lists(st.tuples(role, content), max_size=4)):
            request.messages.messages.add(role=r, content=c)
    if params is not None:
        request.params.CopyFrom(params)
    if resume is not None:
        request.resume_from_position = resume
    expect_refusal(lambda: generate(servers, request))


@FUZZ
@given(
    which=st.sampled_from(["resume", "cancel", "get"]),
    sid=st.sampled_from(["victim", "victim", "nobody", "", "a b", "x" * 129, "é"]),
    position=st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(0, 20)),
    include=st.booleans(),
)
def test_fuzz_resume_cancel_get(servers, victim, which, sid, position, include):
    """Replaying, cancelling (it is not running) or reading the victim only reads it."""
    sid = victim[0] if sid == "victim" else sid
    if which == "resume":
        request = gateway_pb2.GenerateRequest(session_id=sid)
        if position is not None:
            request.resume_from_position = position
        expect_refusal(lambda: generate(servers, request))
    elif which == "cancel":
        expect_refusal(lambda: servers.gateway.Cancel(gateway_pb2.CancelRequest(session_id=sid), timeout=30))
    else:
        request = gateway_pb2.GetSessionRequest(session_id=sid, include_token_ids=include)
        expect_refusal(lambda: servers.gateway.GetSession(request, timeout=30))


def _params(**fields) -> common_pb2.GenerationParams:
    params = greedy_params(4)
    for name, value in fields.items():
        if name in ("temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(params.sampling, name, value)
        elif name in ("method", "shape"):
            setattr(params.method, "name" if name == "method" else "shape", value)
        elif name == "stop":
            params.stop_sequences.extend(value)
        else:
            setattr(params, name, value)
    return params


HOSTILE_PARAMS = [
    {"temperature": float("nan")},
    {"temperature": float("inf")},
    {"temperature": -1.0},
    {"top_p": float("nan")},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"top_k": 2**32 - 1},
    {"presence_penalty": float("nan")},
    {"frequency_penalty": -3.0},
    {"repetition_penalty": 0.0},
    {"repetition_penalty": float("-inf")},
    {"method": "rsd_s", "shape": "1000x1000"},
    {"method": "sd", "shape": "9999999999"},
    {"method": "rsd_c", "shape": "64,64,64"},
    {"method": "spectr", "shape": "0x4"},
    {"max_new_tokens": 2**32 - 1},
    {"stop": ["a"] * 50},
    {"stop": ["x" * 10_000]},
    {"seed": 2**64 - 1},
]


@pytest.mark.parametrize("fields", HOSTILE_PARAMS, ids=lambda f: ",".join(f"{k}={str(v)[:12]}" for k, v in f.items()))
def test_hostile_sampling_params_everywhere(servers, fields):
    """The same params at the gateway (a new session), the drafter (Run) and the verifier (Attach)."""
    params = _params(**fields)
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]), params=params)
    expect_refusal(lambda: generate(servers, request))
    run = drafter_pb2.RunRequest(
        session_id="fz-params", epoch=1, committed_token_ids=[5, 6, 7], params=params, max_new_tokens=4,
        verifier_address=servers.v.address,
    )  # fmt: skip
    expect_refusal(lambda: list(servers.drafter.Run(run, timeout=60)))
    attach = verifier_pb2.AttachRequest(session_id="fz-params", epoch=2, committed_token_ids=[5, 6, 7], params=params)
    if not isinstance(expect_refusal(lambda: servers.verifier.Attach(attach, timeout=30)), grpc.RpcError):
        servers.verifier.Release(verifier_pb2.ReleaseRequest(session_id="fz-params", epoch=2), timeout=30)


# ---------------------------------------------------------------------------------------------
# After all of it (this file's last test)


def test_the_victim_is_untouched_and_the_servers_still_serve(servers, victim):
    victim_id, (committed, epoch, cached) = victim
    session = servers.v.servicer.sessions[victim_id]
    assert (list(session.committed), session.epoch, servers.v.engine.cached_length(victim_id)) == (
        committed,
        epoch,
        cached,
    )
    stored = servers.gateway.GetSession(gateway_pb2.GetSessionRequest(session_id=victim_id, include_token_ids=True))
    assert list(stored.committed_token_ids) == committed[: stored.committed_length_tokens]
    assert stored.status == gateway_pb2.SESSION_STATUS_FINISHED
    # Its next turn continues from the untouched state, exactly.
    turn = [20, 21]
    request = gateway_pb2.GenerateRequest(session_id=victim_id, token_ids=gateway_pb2.TokenIds(ids=turn))
    request.params.max_new_tokens = 8
    _, new = generate(servers, request)
    assert new == reference(servers, list(stored.committed_token_ids) + turn, 8)
    after = servers.v.servicer.sessions[victim_id].committed  # may run past the budget (the last verdict)
    assert after[: len(stored.committed_token_ids) + len(turn) + len(new)] == [*stored.committed_token_ids, *turn, *new]
    assert servers.v.engine.cached_length(victim_id) == len(after) - 1

"""rsd_wire: tensors, draft trees, verdicts, params and methods survive the wire exactly; bad
messages raise ValueError; the generated modules import, match the protos, and carry big messages."""

from __future__ import annotations

import importlib.util
import shutil
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from rsd.acceptance import RULES, Verdict, verify
from rsd.logprobs import TokenLogprobs, token_logprobs
from rsd.methods import METHOD_NAMES, Method
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd.tree import DraftTree
from rsd_wire import (
    GRPC_OPTIONS,
    MAX_MESSAGE_BYTES,
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from rsd_wire.convert import (
    draft_tree_from_proto,
    draft_tree_to_proto,
    logprobs_mode_from_proto,
    method_from_proto,
    method_shape,
    method_to_proto,
    num_top_logprobs,
    output_start_from_proto,
    rule_from_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    tensor_from_proto,
    tensor_to_proto,
    token_logprobs_from_proto,
    token_logprobs_to_proto,
    verdict_from_proto,
    verdict_to_proto,
)
from tests.fixtures.toy import TableProposal, random_table, target_probs_for, transformed

REPO = Path(__file__).resolve().parents[2]
ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
KEY = {"session_id": "s1", "epoch": 2, "root_position": 41}


# ---- tensors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 4), (2, 3, 4)])
def test_tensor_round_trip(dtype, shape):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    tensor = values > 0 if dtype == torch.bool else values.to(dtype)
    msg = tensor_to_proto(tensor)
    assert list(msg.shape) == list(shape) and len(msg.data) == tensor.numel() * dtype.itemsize
    back = tensor_from_proto(common_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_tensor_round_trip_keeps_special_values_and_strides():
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45], dtype=torch.float32)
    back = tensor_from_proto(tensor_to_proto(special))
    assert torch.equal(back.view(torch.int32), special.view(torch.int32))  # bit for bit
    strided = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()[::2]  # [2, 3], not contiguous
    assert torch.equal(tensor_from_proto(tensor_to_proto(strided)), strided)
    back[0] = 5  # decoded tensors own writable memory
    assert back[0] == 5


def test_tensor_to_proto_rejects_dtypes_off_the_list():
    with pytest.raises(ValueError, match="cannot travel"):
        tensor_to_proto(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"\0"), "not allowed"),
        (common_pb2.Tensor(dtype=99, shape=[1], data=b"\0"), "unknown 99"),
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2, -1], data=b""), "negative"),
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[3], data=b"\0" * 11), "needs 12 bytes, got 11"),
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=[1], data=b"\0" * 16), "needs 8 bytes, got 16"),
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_INT16, shape=[], data=b""), "needs 2 bytes, got 0"),
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_BOOL, shape=[2], data=b"\x01\x02"), "other than 0 and 1"),
    ],
)
def test_tensor_from_proto_rejects_inconsistent_messages(msg, reason):
    with pytest.raises(ValueError, match=reason):
        tensor_from_proto(msg)


# ---- draft trees --------------------------------------------------------------------------------


def random_tree(seed: int, num_nodes: int, vocab_size: int, dtype: torch.dtype) -> DraftTree:
    """Random topology; each internal node gets a law on a random support of 1..V tokens, and its
    children are tokens of that support. Leaf rows hold noise (they must not travel)."""
    g = torch.Generator().manual_seed(seed)
    parent_idx = torch.tensor([-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, num_nodes)])
    draft_probs = torch.rand(num_nodes, vocab_size, generator=g, dtype=torch.float64)  # [N, V] leaf noise
    for node in torch.unique(parent_idx[1:]).tolist():
        size = int(torch.randint(1, vocab_size + 1, (), generator=g))
        row = torch.zeros(vocab_size, dtype=torch.float64)
        row[torch.randperm(vocab_size, generator=g)[:size]] = torch.rand(size, generator=g, dtype=torch.float64) + 0.01
        draft_probs[node] = row / row.sum()
    draft_probs = draft_probs.to(dtype)
    token_ids = torch.zeros(num_nodes, dtype=torch.int64)
    token_ids[0] = int(torch.randint(0, vocab_size, (), generator=g))
    for i in range(1, num_nodes):
        support = draft_probs[parent_idx[i]].nonzero().flatten()
        token_ids[i] = support[int(torch.randint(0, support.numel(), (), generator=g))]
    return DraftTree(token_ids, parent_idx, draft_probs)


def internal_nodes(tree: DraftTree) -> list[int]:
    return torch.unique(tree.parent_idx[1:]).tolist()


def wire_bytes(msg) -> bytes:
    return msg.SerializeToString(deterministic=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_draft_tree_round_trip_is_exact(seed, dtype):
    tree = random_tree(seed, num_nodes=12, vocab_size=40, dtype=dtype)
    msg = draft_tree_to_proto(tree, **KEY)
    assert (msg.session_id, msg.epoch, msg.root_position, msg.vocab_size) == ("s1", 2, 41, 40)
    assert [law.node_idx for law in msg.laws] == internal_nodes(tree)

    back = draft_tree_from_proto(verifier_pb2.DraftTree.FromString(wire_bytes(msg)), vocab_size=40)
    assert torch.equal(back.token_ids, tree.token_ids) and torch.equal(back.parent_idx, tree.parent_idx)
    assert back.draft_probs.dtype == dtype
    internal = internal_nodes(tree)
    assert torch.equal(back.draft_probs[internal], tree.draft_probs[internal])  # dense -> sparse -> dense
    leaves = [n for n in range(tree.num_nodes) if n not in internal]
    assert not back.draft_probs[leaves].any()
    assert wire_bytes(draft_tree_to_proto(back, **KEY)) == wire_bytes(msg)  # sparse -> dense -> sparse


def test_laws_take_the_smaller_form():
    tree = random_tree(0, num_nodes=40, vocab_size=40, dtype=torch.float32)
    msg = draft_tree_to_proto(tree, **KEY)
    sizes = {law.node_idx: int((tree.draft_probs[law.node_idx] > 0).sum()) for law in msg.laws}
    for law in msg.laws:
        sparse = sizes[law.node_idx] * (4 + 4) < 40 * 4
        assert law.HasField("token_ids") == sparse
        if sparse:
            assert law.token_ids.dtype == common_pb2.DTYPE_INT32 and list(law.probs.shape) == [sizes[law.node_idx]]
        else:
            assert list(law.probs.shape) == [40]
    assert {law.HasField("token_ids") for law in msg.laws} == {True, False}  # both forms occur


def test_a_drafted_tree_verifies_the_same_after_the_wire():
    table = transformed(random_table(seed=3, vocab=30), top_k=4)
    tree = Method.parse("rsd_c", "3,2").draft(TableProposal(table), 7, StepRandom(1, Stream.DRAFT, 0), greedy=False)
    msg = draft_tree_to_proto(tree, **KEY)
    assert all(law.HasField("token_ids") and list(law.probs.shape) == [4] for law in msg.laws)
    back = draft_tree_from_proto(msg, vocab_size=30)
    target_probs = target_probs_for(tree, random_table(seed=4, vocab=30))  # [N, V]
    for seed in range(5):
        ours = verify(tree, target_probs, RULES["rrs"], StepRandom(seed, Stream.VERIFY, 0))
        theirs = verify(back, target_probs, RULES["rrs"], StepRandom(seed, Stream.VERIFY, 0))
        assert ours == theirs


def _tree_msg():
    """rsd_c-like tree over V=10: root -> {1, 2}, 1 -> {3}; laws on nodes 0 (sparse) and 1 (dense)."""
    token_ids = torch.tensor([9, 4, 6, 1])
    parent_idx = torch.tensor([-1, 0, 0, 1])
    draft_probs = torch.zeros(4, 10)
    draft_probs[0, [4, 6]] = torch.tensor([0.75, 0.25])
    draft_probs[1] = torch.full((10,), 0.1)
    msg = draft_tree_to_proto(DraftTree(token_ids, parent_idx, draft_probs), **KEY)
    assert msg.laws[0].HasField("token_ids") and not msg.laws[1].HasField("token_ids")
    return msg


def _ids(values, dtype=torch.int64):
    return tensor_to_proto(torch.tensor(values, dtype=dtype))


def _set(name: str, value, law: int | None = None):
    """A mutation setting msg.<name>, or msg.laws[law].<name>, to value."""

    def apply(msg):
        target = msg if law is None else msg.laws[law]
        if isinstance(value, common_pb2.Tensor):
            getattr(target, name).CopyFrom(value)
        else:
            setattr(target, name, value)

    return apply


def _drop_law(index):
    return lambda msg: msg.laws.pop(index)


def _add_leaf_law(msg):
    msg.laws.add(node_idx=3, probs=tensor_to_proto(torch.full((10,), 0.1)))


def _clear_ids(msg):
    msg.laws[0].ClearField("token_ids")


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (_set("vocab_size", 11), "vocab_size: expected 10, got 11"),
        (_set("token_ids", _ids([9.0, 4.0, 6.0, 1.0], torch.float32)), "token_ids: expected a 1-D int32 or int64"),
        (_set("token_ids", _ids([9, 4, 6])), "3 nodes but parent_idx has 4"),
        (_set("parent_idx", _ids([-1, 0, 3, 1])), "node 2 has parent 3"),
        (_set("token_ids", _ids([9, 4, 6, 10])), "outside the vocabulary"),
        (_drop_law(1), r"internal node \[0, 1\]"),
        (_add_leaf_law, r"got nodes \[0, 1, 3\]"),
        (_set("token_ids", _ids([6, 4], torch.int32), law=0), "strictly increasing"),
        (_set("token_ids", _ids([4, 10], torch.int32), law=0), r"must lie in \[0, 10\)"),
        (_set("token_ids", _ids([4], torch.int32), law=0), "must be equal"),
        (_set("probs", tensor_to_proto(torch.tensor([1.0, 0.0])), law=0), "finite and > 0"),
        (_set("probs", tensor_to_proto(torch.tensor([0.75, 0.25], dtype=torch.float64)), law=0), "one probs dtype"),
        (_set("probs", _ids([1, 1]), law=0), "expected a 1-D float tensor"),
        (_clear_ids, r"dense law needs \[V=10\]"),
        (_set("probs", tensor_to_proto(torch.tensor([0.5, 0.25])), law=0), "sum to 1"),
        (_set("token_ids", _ids([9, 5, 6, 1])), "zero probability under its parent"),
    ],
)
def test_draft_tree_from_proto_rejects_bad_trees(mutate, reason):
    msg = _tree_msg()
    draft_tree_from_proto(msg, vocab_size=10)  # the unmutated message is fine
    mutate(msg)
    with pytest.raises(ValueError, match=reason):
        draft_tree_from_proto(msg, vocab_size=10)


def test_draft_tree_from_proto_enforces_max_nodes():
    with pytest.raises(ValueError, match="more than the limit of 3"):
        draft_tree_from_proto(_tree_msg(), vocab_size=10, max_nodes=3)


def test_single_node_tree_has_no_laws():
    tree = DraftTree(torch.tensor([3]), torch.tensor([-1]), torch.zeros(1, 10))
    msg = draft_tree_to_proto(tree, **KEY)
    assert len(msg.laws) == 0
    back = draft_tree_from_proto(msg, vocab_size=10)
    assert back.num_nodes == 1 and back.draft_probs.shape == (1, 10)


# ---- verdicts, sampling params, methods ---------------------------------------------------------


def test_verdict_round_trip():
    stats = common_pb2.VerifierStats(queue_ms=0.5, forward_ms=12.25, batch_num_sessions=3, batch_num_nodes=40)
    for verdict in (Verdict([1, 4, 9], [11, 12, 13], 14, True), Verdict([], [], 0, False)):
        msg = verdict_to_proto(verdict, **KEY, stats=stats)
        msg = verifier_pb2.Verdict.FromString(msg.SerializeToString())
        assert (msg.session_id, msg.epoch, msg.root_position, msg.stats) == ("s1", 2, 41, stats)
        assert verdict_from_proto(msg) == verdict


@pytest.mark.parametrize(
    "msg",
    [
        verifier_pb2.Verdict(accepted_node_idx=[1, 2], accepted_token_ids=[5]),
        verifier_pb2.Verdict(accepted_node_idx=[0], accepted_token_ids=[5]),
        verifier_pb2.Verdict(accepted_node_idx=[3, 2], accepted_token_ids=[5, 6]),
        verifier_pb2.Verdict(next_token_id=-1),
    ],
)
def test_verdict_from_proto_rejects_bad_verdicts(msg):
    with pytest.raises(ValueError, match="verdict"):
        verdict_from_proto(msg)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(0.0),
        SamplingParams(0.7, 50, 0.9),
        SamplingParams(1.3, 0, 0.123456789),
        SamplingParams(0.8, logit_bias=((0, -100.0), (7, 0.25), (151_935, 100.0))),
        SamplingParams(0.9, presence_penalty=-2.0, frequency_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(0.0, repetition_penalty=0.7),
    ],
)
def test_sampling_params_round_trip(params):
    msg = common_pb2.SamplingParams.FromString(sampling_params_to_proto(params).SerializeToString())
    assert sampling_params_from_proto(msg) == params


def test_sampling_params_absent_fields_take_the_defaults():
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0)).greedy
    for bad in (common_pb2.SamplingParams(top_p=0.0), common_pb2.SamplingParams(temperature=-1.0)):
        with pytest.raises(ValueError):
            sampling_params_from_proto(bad)
    assert sampling_params_from_proto(common_pb2.SamplingParams()).repetition_penalty == 1.0  # absent: off


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        (common_pb2.SamplingParams(presence_penalty=2.5), "presence_penalty must be in"),
        (common_pb2.SamplingParams(frequency_penalty=float("nan")), "frequency_penalty must be in"),
        (common_pb2.SamplingParams(repetition_penalty=0.0), "repetition_penalty must be finite and > 0"),
        (common_pb2.SamplingParams(repetition_penalty=float("inf")), "repetition_penalty must be finite and > 0"),
    ],
)
def test_out_of_range_penalties_are_refused_naming_them(msg, reason):
    with pytest.raises(ValueError, match=reason):
        sampling_params_from_proto(msg)


def test_output_start_position():
    msg = verifier_pb2.AttachRequest(committed_token_ids=[4, 5, 6])
    assert output_start_from_proto(msg) == 3  # absent: nothing generated yet
    msg.output_start_position = 1
    assert output_start_from_proto(msg) == 1
    msg.output_start_position = 4
    with pytest.raises(ValueError, match="output_start_position 4 is past the 3 committed tokens"):
        output_start_from_proto(msg)


@pytest.mark.parametrize(
    ("name", "shape"),
    [("sd", "4"), ("specinfer", "2,2,1"), ("spectr", "3x4"), ("rsd_c", "2,2,1"), ("rsd_s", "4x5"), ("spectr", "2x1")],
)
def test_method_round_trip(name, shape):
    method = Method.parse(name, shape)
    msg = method_to_proto(method)
    assert (msg.name, msg.shape) == (name, shape)
    assert method_from_proto(common_pb2.Method.FromString(msg.SerializeToString())) == method


def test_methods_without_a_shape_string_are_rejected():
    assert {Method.parse(n, "2x2" if n in ("spectr", "rsd_s") else "2").name for n in METHOD_NAMES} == set(METHOD_NAMES)
    for method in (Method("spectr", (2, 2)), Method("sd", ()), Method("sd", (2, 1))):
        with pytest.raises(ValueError):
            method_shape(method)
    for msg in (common_pb2.Method(name="eagle", shape="2"), common_pb2.Method(name="sd", shape="x")):
        with pytest.raises(ValueError):
            method_from_proto(msg)


# ---- generated code -----------------------------------------------------------------------------


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_services_have_the_documented_shapes():
    kinds = {}
    for pb2 in (gateway_pb2, drafter_pb2, verifier_pb2):
        for service in pb2.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                kinds[f"{service.full_name}.{method.name}"] = (method.client_streaming, method.server_streaming)
    assert kinds == {
        "rsd.v1.Gateway.Generate": (False, True),
        "rsd.v1.Gateway.Cancel": (False, False),
        "rsd.v1.Gateway.GetSession": (False, False),
        "rsd.v1.Drafter.Run": (False, True),
        "rsd.v1.Drafter.Cancel": (False, False),
        "rsd.v1.Verifier.Attach": (False, False),
        "rsd.v1.Verifier.Verify": (True, True),
        "rsd.v1.Verifier.Release": (False, False),
    }
    for name in ("GatewayStub", "GatewayServicer", "add_GatewayServicer_to_server"):
        assert hasattr(gateway_pb2_grpc, name)
    assert hasattr(drafter_pb2_grpc, "DrafterStub") and hasattr(verifier_pb2_grpc, "VerifierStub")


def test_generated_code_is_up_to_date():
    assert _load_generator().generate(check=True), "rsd_proto/ is stale: run python scripts/gen_protos.py"


def test_generator_reports_protoc_errors(tmp_path):
    gen = _load_generator()
    protos = tmp_path / "protos"
    shutil.copytree(REPO / "protos", protos)
    broken = protos / "rsd_proto" / "v1" / "common.proto"
    broken.write_text(broken.read_text().replace("message Tensor {", "message Tensor {\n  nonsense;"))
    with pytest.raises(gen.GenerationError, match=r"protoc failed on .*common\.proto"):
        gen.generate(out_root=tmp_path / "out", proto_root=protos)
    assert not (tmp_path / "out" / "rsd_proto").exists()


def test_grpc_options_carry_messages_over_the_default_limit():
    """A 6 MB tree (dense laws over V = 500,000) goes through a real server and channel."""

    class EchoVerifier(verifier_pb2_grpc.VerifierServicer):
        def Verify(self, request_iterator, context):
            for tree in request_iterator:
                yield verifier_pb2.Verdict(session_id=tree.session_id, next_token_id=len(tree.laws[0].probs.data))

    assert dict(GRPC_OPTIONS) == {
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
        "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    }
    vocab_size = 500_000
    draft_probs = torch.full((4, vocab_size), 1.0 / vocab_size)  # [N, V]: 3 internal nodes of 2 MB
    tree = DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 1, 2]), draft_probs)
    msg = draft_tree_to_proto(tree, **KEY)
    assert msg.ByteSize() > 4 * 1024 * 1024

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    verifier_pb2_grpc.add_VerifierServicer_to_server(EchoVerifier(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            verdicts = list(verifier_pb2_grpc.VerifierStub(channel).Verify(iter([msg]), timeout=30))
    finally:
        server.stop(grace=None)
    assert [(v.session_id, v.next_token_id) for v in verdicts] == [("s1", 4 * vocab_size)]


def test_token_logprobs_round_trip_and_checks():
    lp = token_logprobs(torch.randn(3, 40, generator=torch.Generator().manual_seed(1)), torch.tensor([1, 2, 3]), 4)
    msg = common_pb2.TokenLogprobs.FromString(token_logprobs_to_proto(lp).SerializeToString())
    back = token_logprobs_from_proto(msg, 3)
    assert torch.equal(back.logprobs, lp.logprobs) and torch.equal(back.top_ids, lp.top_ids)
    assert torch.equal(back.top_logprobs, lp.top_logprobs)
    with pytest.raises(ValueError, match="logprobs: expected float32 \\[2\\]"):
        token_logprobs_from_proto(msg, 2)  # not the step's token count
    too_many = token_logprobs(torch.zeros(1, 40), torch.tensor([0]), 20)
    wide = token_logprobs_to_proto(
        TokenLogprobs(too_many.logprobs, torch.zeros(1, 21, dtype=torch.long), torch.zeros(1, 21))
    )
    with pytest.raises(ValueError, match="k <= 20"):
        token_logprobs_from_proto(wide, 1)


def test_num_top_logprobs_reads_the_request():
    assert num_top_logprobs(common_pb2.GenerationParams()) is None
    assert num_top_logprobs(common_pb2.GenerationParams(logprobs=True)) == 0
    assert num_top_logprobs(common_pb2.GenerationParams(logprobs=True, top_logprobs=20)) == 20
    with pytest.raises(ValueError, match="top_logprobs: must be in \\[0, 20\\]"):
        num_top_logprobs(common_pb2.GenerationParams(logprobs=True, top_logprobs=21))
    with pytest.raises(ValueError, match=r"needs params\.logprobs"):
        num_top_logprobs(common_pb2.GenerationParams(top_logprobs=3))
    assert logprobs_mode_from_proto(common_pb2.GenerationParams()) == "raw_logprobs"  # "": vLLM's default
    assert logprobs_mode_from_proto(common_pb2.GenerationParams(logprobs_mode="processed_logits")) == "processed_logits"
    with pytest.raises(ValueError, match=r"params\.logprobs_mode: must be one of"):
        logprobs_mode_from_proto(common_pb2.GenerationParams(logprobs_mode="processed"))


def test_rule_from_proto_names_params_verification():
    """ "" is the method's own rule; each value maps to the rule Method.rule gives; a value that is unknown (quoted
    cut to 64 characters) or not exact for the method is a ValueError naming params.verification."""
    tree, chain = Method.parse("specinfer", "2,2"), Method.parse("sd", "3")
    hot, cold = SamplingParams(1.0), SamplingParams(0.0)

    def rule(method, sampling, verification):
        return rule_from_proto(common_pb2.GenerationParams(verification=verification), sampling, method)

    assert rule(tree, hot, "") is rule(tree, hot, "token") is RULES["rrs_with_replacement"]
    assert rule(tree, hot, "traversal") is RULES["traversal_with_replacement"]
    assert rule(chain, hot, "block") is RULES["block"] and rule(chain, cold, "block") is RULES["greedy"]
    with pytest.raises(ValueError, match=r"^params\.verification: unknown verification 'xxxx") as info:
        rule(tree, hot, "x" * 10_000)
    assert len(str(info.value)) < 200
    for sampling in (hot, cold):  # not exact at any temperature: refused at T = 0 too
        with pytest.raises(ValueError, match=r"^params\.verification: block verification is exact for one chain"):
            rule(tree, sampling, "block")

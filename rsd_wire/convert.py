"""Conversions between the algorithm's types (`rsd`) and the wire messages (`rsd.v1` protos).

    torch.Tensor            <->  Tensor {dtype, shape, data}
    rsd.tree.DraftTree      <->  DraftTree: dense draft_probs [N, V] <-> one ProposalLaw per internal node
    rsd.acceptance.Verdict  <->  Verdict
    rsd.logprobs.TokenLogprobs  <->  TokenLogprobs
    rsd.sampling.SamplingParams <-> SamplingParams
    rsd.methods.Method      <->  Method {name, shape}

Every *_from_proto function treats its message as untrusted: it raises ValueError naming the field,
what was expected and what came, and never returns something the algorithm would reject.
Servicers map that ValueError to INVALID_ARGUMENT.

Proposal laws (verifier.proto, ProposalLaw) have one canonical encoding: the support (the nonzero
entries, in increasing token id) when listing it is smaller than the dense row, else the dense
row. So encode(decode(encode(tree))) is bit-identical to encode(tree), and decoding restores the
rows of internal nodes exactly; rows of leaves are not sent and decode as zeros.
"""

from __future__ import annotations

import itertools
import math
import re
import sys

import torch
from torch import Tensor

from rsd.acceptance import Rule, Verdict
from rsd.constraint import Constraint
from rsd.logprobs import MAX_TOP_LOGPROBS, RAW_LOGPROBS, TokenLogprobs, check_mode
from rsd.methods import VERIFICATIONS, Method
from rsd.sampling import SamplingParams, nonzero_ids
from rsd.tree import DraftTree, validate_draft_tree, validate_tree
from rsd_wire import common_pb2, drafter_pb2, verifier_pb2

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("rsd_wire writes tensors little-endian with native byte copies; this host is big-endian")

_TORCH_DTYPE: dict[int, torch.dtype] = {
    common_pb2.DTYPE_BOOL: torch.bool,
    common_pb2.DTYPE_UINT8: torch.uint8,
    common_pb2.DTYPE_INT8: torch.int8,
    common_pb2.DTYPE_INT16: torch.int16,
    common_pb2.DTYPE_INT32: torch.int32,
    common_pb2.DTYPE_INT64: torch.int64,
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    common_pb2.DTYPE_FLOAT32: torch.float32,
    common_pb2.DTYPE_FLOAT64: torch.float64,
}
_WIRE_DTYPE: dict[torch.dtype, int] = {dtype: wire for wire, dtype in _TORCH_DTYPE.items()}
_ID_DTYPES = (torch.int32, torch.int64)
_PROB_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# How far from 1 the sum of a decoded law may be: 16-bit probabilities are rounded per entry.
_SUM_ATOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-4}


# ---------------------------------------------------------------------------------------------
# Tensors


def tensor_to_proto(tensor: Tensor) -> common_pb2.Tensor:
    """Copy `tensor` (any device, any strides) into a Tensor message: row-major, little-endian."""
    wire = _WIRE_DTYPE.get(tensor.dtype)
    if wire is None:
        allowed = ", ".join(str(d) for d in _WIRE_DTYPE)
        raise ValueError(f"dtype {tensor.dtype} cannot travel; expected one of {allowed}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # [numel]
    data = flat.view(torch.uint8).numpy().tobytes()  # [numel * itemsize] raw bytes
    return common_pb2.Tensor(dtype=wire, shape=list(tensor.shape), data=data)


def tensor_from_proto(msg: common_pb2.Tensor, name: str = "tensor") -> Tensor:
    """A new CPU tensor holding a copy of msg's data; ValueError when dtype, shape and data disagree."""
    dtype = _TORCH_DTYPE.get(msg.dtype)
    if dtype is None:
        allowed = ", ".join(common_pb2.DType.Name(w) for w in _TORCH_DTYPE)
        raise ValueError(f"{name}: dtype {_dtype_name(msg.dtype)} is not allowed; expected one of {allowed}")
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{name}: shape {list(shape)} has a negative size")
    numel = math.prod(shape)
    if len(msg.data) != numel * dtype.itemsize:
        raise ValueError(
            f"{name}: shape {list(shape)} of {common_pb2.DType.Name(msg.dtype)} needs "
            f"{numel * dtype.itemsize} bytes, got {len(msg.data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)  # [numel * itemsize], owns a copy
    if dtype == torch.bool and bool((raw > 1).any()):
        raise ValueError(f"{name}: a bool tensor holds bytes other than 0 and 1")
    return raw.view(dtype).reshape(shape)


def _dtype_name(wire: int) -> str:
    try:
        return common_pb2.DType.Name(wire)
    except ValueError:
        return f"<unknown {wire}>"


def _ids_from_proto(msg: common_pb2.Tensor, name: str) -> Tensor:
    """A 1-D int32/int64 Tensor message -> int64 [n]."""
    ids = tensor_from_proto(msg, name)
    if ids.dtype not in _ID_DTYPES or ids.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D int32 or int64 tensor, got {ids.dtype} {list(ids.shape)}")
    return ids.to(torch.int64)


# ---------------------------------------------------------------------------------------------
# Draft trees


def draft_tree_to_proto(tree: DraftTree, *, session_id: str, epoch: int, root_position: int) -> verifier_pb2.DraftTree:
    """The tree with one ProposalLaw per internal node, in increasing node index."""
    vocab_size = tree.draft_probs.shape[-1]  # draft_probs [N, V]
    validate_tree(tree.token_ids, tree.parent_idx, vocab_size)
    internal = torch.unique(tree.parent_idx[1:]).tolist()  # sorted
    rows = tree.draft_probs[internal]  # [I, V]
    supports = nonzero_ids(rows) if rows.dtype in _PROB_DTYPES and rows.dim() == 2 else [None] * len(internal)
    return verifier_pb2.DraftTree(
        session_id=session_id,
        epoch=epoch,
        root_position=root_position,
        token_ids=tensor_to_proto(tree.token_ids),
        parent_idx=tensor_to_proto(tree.parent_idx),
        vocab_size=vocab_size,
        laws=[proposal_law_to_proto(n, row, s) for n, row, s in zip(internal, rows, supports, strict=True)],
    )


def proposal_law_to_proto(node_idx: int, probs: Tensor, support: Tensor | None = None) -> verifier_pb2.ProposalLaw:
    """probs [V] -> the canonical ProposalLaw: sparse (int32 ids, probs) if smaller, else dense.
    support: probs.nonzero().flatten() when the caller has it already."""
    if probs.dtype not in _PROB_DTYPES or probs.dim() != 1:
        raise ValueError(f"law of node {node_idx}: expected a 1-D float tensor, got {probs.dtype} {list(probs.shape)}")
    if support is None:
        support = probs.nonzero().flatten()  # [S] increasing token ids; NaN, inf and negatives are nonzero
    values = probs[support]  # [S]: so checking them checks the law (one pass over V, not three)
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise ValueError(f"law of node {node_idx}: probabilities must be finite and non-negative")
    sparse_bytes = support.numel() * (torch.int32.itemsize + probs.dtype.itemsize)
    if sparse_bytes < probs.numel() * probs.dtype.itemsize:
        return verifier_pb2.ProposalLaw(
            node_idx=node_idx,
            token_ids=tensor_to_proto(support.to(torch.int32)),
            probs=tensor_to_proto(values),  # [S]
        )
    return verifier_pb2.ProposalLaw(node_idx=node_idx, probs=tensor_to_proto(probs))


def draft_tree_from_proto(msg: verifier_pb2.DraftTree, vocab_size: int, max_nodes: int | None = None) -> DraftTree:
    """Decode and fully validate (rsd.tree.validate_draft_tree) an untrusted tree.

    vocab_size is the receiver's V; msg.vocab_size must equal it (so a hostile V cannot size the
    dense [N, V] tensor). Leaf rows of draft_probs are zero.
    """
    if msg.vocab_size != vocab_size:
        raise ValueError(f"vocab_size: expected {vocab_size}, got {msg.vocab_size}")
    token_ids = _ids_from_proto(msg.token_ids, "token_ids")  # [N]
    parent_idx = _ids_from_proto(msg.parent_idx, "parent_idx")  # [N]
    validate_tree(token_ids, parent_idx, vocab_size, max_nodes)
    internal = torch.unique(parent_idx[1:]).tolist()
    law_nodes = [law.node_idx for law in msg.laws]
    if law_nodes != internal:
        raise ValueError(f"laws: expected one per internal node {internal} in that order, got nodes {law_nodes}")
    laws = [_law_from_proto(law, vocab_size) for law in msg.laws]
    dtypes = {probs.dtype for _, probs in laws} or {torch.float32}
    if len(dtypes) > 1:
        raise ValueError(f"laws: every law of a tree must have one probs dtype, got {sorted(map(str, dtypes))}")
    (dtype,) = dtypes
    draft_probs = torch.zeros(token_ids.shape[0], vocab_size, dtype=dtype)  # [N, V]
    for node, (ids, probs) in zip(internal, laws, strict=True):
        if ids is None:
            draft_probs[node] = probs
        else:
            draft_probs[node, ids] = probs
    tree = DraftTree(token_ids, parent_idx, draft_probs)
    validate_draft_tree(tree, max_nodes, atol=_SUM_ATOL[dtype])
    return tree


def _law_from_proto(law: verifier_pb2.ProposalLaw, vocab_size: int) -> tuple[Tensor | None, Tensor]:
    """-> (ids [S] int64 or None for the dense form, probs [S] or [V])."""
    where = f"laws[node {law.node_idx}]"
    probs = tensor_from_proto(law.probs, f"{where}.probs")
    if probs.dtype not in _PROB_DTYPES or probs.dim() != 1:
        raise ValueError(f"{where}.probs: expected a 1-D float tensor, got {probs.dtype} {list(probs.shape)}")
    if not law.HasField("token_ids"):
        if probs.shape[0] != vocab_size:
            raise ValueError(f"{where}.probs: a dense law needs [V={vocab_size}] entries, got {probs.shape[0]}")
        return None, probs
    ids = _ids_from_proto(law.token_ids, f"{where}.token_ids")
    if ids.shape != probs.shape or ids.numel() == 0:
        raise ValueError(f"{where}: token_ids {list(ids.shape)} and probs {list(probs.shape)} must be equal, non-empty")
    if bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError(f"{where}.token_ids: must be strictly increasing")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"{where}.token_ids: must lie in [0, {vocab_size}), got {int(ids[0])}..{int(ids[-1])}")
    if not bool(torch.isfinite(probs).all()) or bool((probs <= 0).any()):
        raise ValueError(f"{where}.probs: the entries of a sparse law must be finite and > 0")
    return ids, probs


# ---------------------------------------------------------------------------------------------
# Verdicts


def verdict_to_proto(
    verdict: Verdict,
    *,
    session_id: str,
    epoch: int,
    root_position: int,
    stats: common_pb2.VerifierStats | None = None,
) -> verifier_pb2.Verdict:
    return verifier_pb2.Verdict(
        session_id=session_id,
        epoch=epoch,
        root_position=root_position,
        accepted_node_idx=verdict.accepted_idx,
        accepted_token_ids=verdict.accepted_ids,
        next_token_id=verdict.next_token,
        is_bonus=verdict.is_bonus,
        stats=stats,
    )


def verdict_from_proto(msg: verifier_pb2.Verdict) -> Verdict:
    accepted_idx, accepted_ids = list(msg.accepted_node_idx), list(msg.accepted_token_ids)
    if len(accepted_idx) != len(accepted_ids):
        raise ValueError(f"verdict: {len(accepted_idx)} accepted_node_idx but {len(accepted_ids)} accepted_token_ids")
    if any(i <= 0 for i in accepted_idx) or any(b <= a for a, b in itertools.pairwise(accepted_idx)):
        raise ValueError(f"verdict: accepted_node_idx must be increasing draft nodes (> 0), got {accepted_idx}")
    if any(t < 0 for t in [*accepted_ids, msg.next_token_id]):
        raise ValueError("verdict: token ids must be >= 0")
    return Verdict(accepted_idx, accepted_ids, msg.next_token_id, msg.is_bonus)


# ---------------------------------------------------------------------------------------------
# Log-probabilities


def token_logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        logprobs=tensor_to_proto(logprobs.logprobs.to(torch.float32)),
        top_token_ids=tensor_to_proto(logprobs.top_ids.to(torch.int64)),
        top_logprobs=tensor_to_proto(logprobs.top_logprobs.to(torch.float32)),
    )


def token_logprobs_from_proto(msg: common_pb2.TokenLogprobs, num_tokens: int, name: str = "logprobs") -> TokenLogprobs:
    """ValueError unless msg holds num_tokens tokens' log-probabilities, [M] and [M, k] with k <= 20."""
    logprobs = tensor_from_proto(msg.logprobs, f"{name}.logprobs")
    top_ids = tensor_from_proto(msg.top_token_ids, f"{name}.top_token_ids")
    top = tensor_from_proto(msg.top_logprobs, f"{name}.top_logprobs")
    shapes = [list(t.shape) for t in (logprobs, top_ids, top)]
    ok = (
        logprobs.dtype == torch.float32
        and top.dtype == torch.float32
        and top_ids.dtype == torch.int64
        and shapes[0] == [num_tokens]
        and shapes[1] == shapes[2]
        and len(shapes[1]) == 2
        and shapes[1][0] == num_tokens
        and shapes[1][1] <= MAX_TOP_LOGPROBS
    )
    if not ok:
        raise ValueError(
            f"{name}: expected float32 [{num_tokens}], int64 and float32 [{num_tokens}, k <= {MAX_TOP_LOGPROBS}], "
            f"got {[str(t.dtype) for t in (logprobs, top_ids, top)]} {shapes}"
        )
    return TokenLogprobs(logprobs, top_ids, top)


def num_top_logprobs(msg: common_pb2.GenerationParams) -> int | None:
    """What params ask of logprobs: None (none), else the number of top tokens per position (0..20)."""
    if not msg.logprobs:
        if msg.top_logprobs:
            raise ValueError("params.top_logprobs: needs params.logprobs")
        return None
    if msg.top_logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(f"params.top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {msg.top_logprobs}")
    return msg.top_logprobs


def logprobs_mode_from_proto(msg: common_pb2.GenerationParams) -> str:
    """params.logprobs_mode, "" read as "raw_logprobs" (rsd.logprobs.LOGPROBS_MODES); ValueError naming the field."""
    try:
        return check_mode(msg.logprobs_mode or RAW_LOGPROBS)
    except ValueError as e:
        raise ValueError(f"params.{e}") from None


# ---------------------------------------------------------------------------------------------
# Sampling parameters and methods


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        logit_bias=dict(params.logit_bias),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
    )


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Absent temperature / top_p / repetition_penalty take SamplingParams' defaults; SamplingParams validates
    the values (NaN and infinities included)."""
    defaults = SamplingParams()
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
    )


def output_start_from_proto(msg: verifier_pb2.AttachRequest | drafter_pb2.RunRequest) -> int:
    """Where the turn's output starts in msg.committed_token_ids (absent: after them, nothing generated yet);
    ValueError past their end."""
    num_committed = len(msg.committed_token_ids)
    if not msg.HasField("output_start_position"):
        return num_committed
    if msg.output_start_position > num_committed:
        raise ValueError(
            f"output_start_position {msg.output_start_position} is past the {num_committed} committed tokens"
        )
    return msg.output_start_position


def method_shape(method: Method) -> str:
    """The shape string Method.parse reads back into `method`: "4", "2,2,1", "3x4"."""
    if not method.branching:
        raise ValueError(f"{method} has no tree shape")
    if method.name in ("sd", "auto") or (method.name == "lookup" and set(method.branching) == {1}):
        shape = str(method.depth)
    elif method.name == "lookup":
        shape = ",".join(str(k) for k in method.branching) + ("," if method.depth == 1 else "")
    elif method.name == "spectr":
        shape = f"{method.branching[0]}x{method.depth}"
    elif method.name == "rsd_s":
        shape = f"{method.beam_width}x{method.depth}"
    else:
        shape = ",".join(str(k) for k in method.branching)
    if method.stop_below:
        shape += f"@{method.stop_below!r}"
    if Method.parse(method.name, shape) != method:
        raise ValueError(f"{method} is not a shape Method.parse can produce (closest: {shape!r})")
    return shape


def method_to_proto(method: Method) -> common_pb2.Method:
    return common_pb2.Method(name=method.name, shape=method_shape(method))


def method_from_proto(msg: common_pb2.Method) -> Method:
    return parse_method(msg.name, msg.shape)


_MAX_SHAPE_CHARS = 64
_MAX_SHAPE_SIZE = 1024  # far above any tree a service takes (max_tree_nodes), far below a memory problem


def parse_method(name: str, shape: str) -> Method:
    """Method.parse for untrusted text: each size is bounded first (Method.parse("sd", "9999999999")
    builds a tuple of 10**10 entries: a MemoryError, or the server's memory)."""
    sizes = re.findall(r"\d+", shape)
    if len(shape) > _MAX_SHAPE_CHARS or any(len(n) > 4 or int(n) > _MAX_SHAPE_SIZE for n in sizes):
        raise ValueError(
            f"shape {shape[:_MAX_SHAPE_CHARS]!r}: at most {_MAX_SHAPE_CHARS} characters, sizes up to {_MAX_SHAPE_SIZE}"
        )
    return Method.parse(name, shape)


def generation_params_from_proto(msg: common_pb2.GenerationParams) -> tuple[SamplingParams, Method, int]:
    """What the drafter and the verifier need of a run's params: (sampling, method, seed).

    Both require method and seed (the gateway sets the seed when the client does not);
    ValueError names the field.
    """
    try:
        sampling = sampling_params_from_proto(msg.sampling)
    except ValueError as e:
        raise ValueError(f"params.sampling: {e}") from None
    if not msg.HasField("method"):
        raise ValueError("params.method is required")
    try:
        method = method_from_proto(msg.method)
    except ValueError as e:
        raise ValueError(f"params.method: {e}") from None
    if not msg.HasField("seed"):
        raise ValueError("params.seed is required (the gateway picks one when the client does not)")
    return sampling, method, msg.seed


def rule_from_proto(msg: common_pb2.GenerationParams, sampling: SamplingParams, method: Method) -> Rule:
    """The acceptance rule params.verification ("" = "token") picks for the method at this temperature;
    ValueError naming params.verification when the value is unknown or not exact for the method."""
    verification = msg.verification or "token"
    if verification not in VERIFICATIONS:  # checked here first: the message quotes at most 64 characters
        raise ValueError(
            f"params.verification: unknown verification {verification[:64]!r}; expected one of "
            f"{', '.join(VERIFICATIONS)}"
        )
    try:
        return method.rule(sampling.greedy, verification)
    except ValueError as e:
        raise ValueError(f"params.verification: {e}") from None


MAX_CONSTRAINT_CHARS = 100_000  # a regex or schema longer than this is refused before anything compiles it


def constraint_from_proto(msg: common_pb2.GenerationParams) -> tuple[Constraint, int] | None:
    """params.constraint as (Constraint, start position), None when unset; ValueError names the field. Whether
    the regex or schema compiles is the runtime's to say (rsd_runtime.constraint)."""
    if not msg.HasField("constraint"):
        return None
    c = msg.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        raise ValueError("params.constraint: set one of regex, json_schema, json_object")
    value = "" if kind == "json_object" else getattr(c, kind)
    if kind == "json_object" and not c.json_object:
        raise ValueError("params.constraint.json_object: must be true when set")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"params.constraint.{kind}: at most {MAX_CONSTRAINT_CHARS} characters, got {len(value)}")
    try:
        return Constraint(kind, value), c.start_position
    except ValueError as e:
        raise ValueError(f"params.constraint.{kind}: {e}") from None


def constraint_to_proto(constraint: Constraint, start_position: int) -> common_pb2.Constraint:
    msg = common_pb2.Constraint(start_position=start_position)
    if constraint.kind == "json_object":
        msg.json_object = True
    else:
        setattr(msg, constraint.kind, constraint.value)
    return msg

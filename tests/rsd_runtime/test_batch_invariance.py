"""The same bits whatever the batch: a row's logits never depend on how many rows share its forward, which
sessions they belong to, or which masked keys lie between its own (rsd_runtime.models.batch_variance).

A tree forward's rows equal one-token forwards of each path bit for bit, and a session's rows equal its lone
forward's when it is packed with 1..7 other sessions (a 70-token prompt among them: above small_gemm's 64 rows),
in float32 and bfloat16, on every linear kernel this CPU runs. Where the machine's kernel choice leaves a path
that is not invariant (no AVX2 kernel, no bf16 one), batch_variance must say so, and the exactness tests skip
with that reason."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen2Config

from rsd_runtime import row_attention, small_gemm
from rsd_runtime.attention import GROUPED_SDPA, ROW_SDPA, check_model
from rsd_runtime.lean import lean_decoder, use_lean_forward
from rsd_runtime.linear import set_linear_kernel
from rsd_runtime.models import batch_variance, load_model
from rsd_runtime.packed import forward_packed
from rsd_runtime.runner import ModelRunner

VOCAB, PROMPT = 256, 37
TREE_IDS = torch.tensor([11, 12, 13, 14, 15, 16, 17])
TREE_PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2, 4])  # two roots; depths 0 0 1 1 1 2 2
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _kernels() -> list:
    """(dtype, small_gemm kernel) for every kernel this CPU runs, so an AMX Xeon tests its AVX512-BF16 one too."""
    out = []
    for dtype in DTYPES:
        for kernel in small_gemm._KERNELS[dtype]:
            runs = small_gemm.available(dtype) and all(f in small_gemm._cpu_flags() for f in kernel.cpu_flags)
            why = f"{kernel.name} does not run here: {dtype} takes a path batch_variance names as not invariant"
            mark = pytest.mark.skipif(not runs, reason=why)
            out.append(pytest.param((dtype, kernel), id=kernel.name, marks=mark))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("invariance")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture
def model(request, model_dir, monkeypatch):
    """The tiny model in `dtype` with its linear layers on `kernel` (built here if the dtype picked another)."""
    dtype, kernel = request.param
    monkeypatch.setitem(small_gemm._libs, dtype, small_gemm._build(kernel))
    model = load_model(model_dir, dtype=DTYPES[dtype])
    assert batch_variance(model) == ""  # a kernel for the dtype and row attention run here
    return model


def _prompt(seed: int, n: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _prefilled(model, seed: int, n: int = PROMPT) -> ModelRunner:
    runner = ModelRunner(model, 256)
    runner.forward(_prompt(seed, n), torch.arange(-1, n - 1))
    runner.commit(list(range(n)))
    return runner


def _path(node: int) -> list[int]:
    chain = []
    while node != -1:
        chain.append(node)
        node = int(TREE_PARENTS[node])
    return chain[::-1]


@pytest.mark.parametrize("model", _kernels(), indirect=True)
def test_a_tree_row_is_the_one_token_step_bit_for_bit(model):
    tree_logits = _prefilled(model, 1).forward(TREE_IDS, TREE_PARENTS)  # [7, V]
    for node in range(len(TREE_IDS)):
        alone = _prefilled(model, 1)
        for i in _path(node):  # the path's tokens one at a time, each committed: autoregressive decoding
            step_logits = alone.forward(TREE_IDS[i : i + 1], torch.tensor([-1]))
            alone.commit([0])
        assert torch.equal(step_logits[0], tree_logits[node]), f"node {node}"


@pytest.mark.parametrize("model", _kernels(), indirect=True)
@pytest.mark.parametrize("others", [1, 3, 7])
def test_a_session_gets_its_lone_bits_packed_with_others(model, others):
    """Session 0's tree packed with `others` sessions' trees of other sizes, and a 70-token prompt among them."""
    lone = _prefilled(model, 1).forward(TREE_IDS, TREE_PARENTS)
    plan = check_model(model, 8 * 256)
    steps = [(_prefilled(model, 1), None)]
    for s in range(1, others + 1):
        if s == 2:  # a prefill of 70 rows: the packed forward runs above small_gemm.MAX_ROWS rows
            steps.append((ModelRunner(model, 256), (_prompt(100 + s, 70), torch.arange(-1, 69))))
        else:
            n = 1 + s % 5
            steps.append((_prefilled(model, 100 + s, PROMPT + 3 * s), (_prompt(200 + s, n), torch.arange(-1, n - 1))))
    prepared = [(r, r.prepare(TREE_IDS, TREE_PARENTS) if ids is None else r.prepare(*ids)) for r, ids in steps]
    assert sum(len(p.parents) for _, p in prepared) > small_gemm.MAX_ROWS or others < 3
    packed = forward_packed(model, plan, prepared)
    assert torch.equal(packed[0], lone)


@pytest.mark.parametrize("model", _kernels(), indirect=True)
def test_the_lean_draft_forward_too(model):
    """A drafter's lean forward (rsd_runtime.lean) attends with row attention: the same two properties."""
    assert use_lean_forward(model) == "" and batch_variance(model) == ""
    test_a_tree_row_is_the_one_token_step_bit_for_bit(model)
    test_a_session_gets_its_lone_bits_packed_with_others(model, 7)
    assert lean_decoder(model).calls > 0


def test_batch_variance_follows_the_machine_and_the_settings(model_dir):
    """What this CPU's kernel choice implies: invariant exactly where a small_gemm kernel for the dtype and the
    row attention kernel run; F.linear, grouped_sdpa and the drafters' fbgemm int8 are named as not invariant."""
    for dtype, name in DTYPES.items():
        model = load_model(model_dir, dtype=name)
        expected = small_gemm.available(dtype) and row_attention.available()
        assert (batch_variance(model) == "") == expected, batch_variance(model)
        assert model.config._attn_implementation == (ROW_SDPA if row_attention.available() else GROUPED_SDPA)
        if small_gemm.available(dtype):
            set_linear_kernel(model, "small_gemm", max_rows=64)  # F.linear above 64 rows
            assert "F.linear" in batch_variance(model)
        model.set_attn_implementation(GROUPED_SDPA)
        assert "grouped_sdpa" in batch_variance(model)


@pytest.mark.skipif(not row_attention.available(), reason="row attention needs AVX2 + FMA and a compiler")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_row_attention_is_sdpa_to_rounding_and_each_row_its_own(dtype):
    """Against sdpa in float64: rounding only. A row alone, its visible keys gathered side by side, with another
    thread count: the same bits (what makes a tree row the one-token step's)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, n, length, dim = 12, 2, 9, 61, 128
    q = torch.randn(1, heads, n, dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, kv_heads, 80, dim, generator=gen).to(dtype)[:, :, :length] for _ in range(2))
    allowed = torch.rand(n, length, generator=gen) < 0.6  # [n, L]
    allowed[:, 0] = True
    out = row_attention.row_attention(q, k, v, allowed, 0.09)  # [1, n, H, D]
    mask = torch.zeros(n, length, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    k64, v64 = (t.repeat_interleave(heads // kv_heads, 1).double() for t in (k, v))  # [1, H, L, D]
    ref = F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=mask, scale=0.09).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for i in range(n):
            keys = allowed[i].nonzero().flatten()
            alone = row_attention.row_attention(
                q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], torch.ones(1, len(keys), dtype=torch.bool), 0.09
            )
            assert torch.equal(alone[0, 0], out[0, i])
    finally:
        torch.set_num_threads(threads)

"""ModelRunner: tree-attention logits equal plain causal runs of each root-to-node path.

References are the model's own forward on the whole sequence (no cache, its default causal
mask), so they share no code with the runner. Tolerance: fp32, 1e-4 absolute on logits (the
observed error is ~5e-6; a wrong mask or position moves logits by far more than 1e-2).
"""

import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never touch the hub

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, Qwen2Config

from rsd_runtime.models import cpu_has_native_bf16, load_model, parse_dtype
from rsd_runtime.runner import ModelRunner
from rsd_runtime.tokenizer import load_tokenizer
from rsd_tools.tiny import build_tiny_pair, build_tiny_vocab_pair

ATOL = 1e-4
FAMILIES = ("llama", "qwen2")
CONFIGS = [(f, a) for f in FAMILIES for a in ("auto", "sdpa", "eager")]


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def pairs(tiny_root) -> dict:
    return {family: build_tiny_pair(tiny_root, family) for family in FAMILIES}


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{f}-{a}" for f, a in CONFIGS])
def model(request, pairs):
    family, attn = request.param
    return load_model(pairs[family][1], attn_implementation=attn)


def causal_logits(model, ids: list[int]) -> Tensor:
    """Next-token logits after `ids` from one plain forward. [V]"""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def path(parents: list[int], node: int) -> list[int]:
    """Tentative indices from the -1-parent ancestor down to `node`."""
    chain = []
    while node != -1:
        chain.append(node)
        node = parents[node]
    return chain[::-1]


def random_tree(gen: torch.Generator, n: int, vocab: int) -> tuple[Tensor, Tensor]:
    """n nodes, several -1 roots and siblings guaranteed (nodes 0, 1 and 2, 3 are siblings)."""
    parents = [-1, -1, 0, 0] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(4, n)]
    return torch.randint(4, vocab, (n,), generator=gen), torch.tensor(parents)


def prefilled(model, prompt: list[int], max_len: int = 128) -> ModelRunner:
    runner = ModelRunner(model, max_len=max_len)
    runner.forward(torch.tensor(prompt), torch.arange(len(prompt)) - 1)
    runner.commit(range(len(prompt)))
    return runner


def assert_matches_paths(model, logits: Tensor, prefix: list[int], tokens: Tensor, parents: list[int]):
    for node in range(len(parents)):
        ref = causal_logits(model, prefix + tokens[path(parents, node)].tolist())
        torch.testing.assert_close(logits[node], ref, atol=ATOL, rtol=0, msg=f"node {node}")


def test_tree_forward_matches_per_path_causal(model):
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for n in (6, 10):
        prompt = torch.randint(4, vocab, (5,), generator=gen).tolist()
        runner = prefilled(model, prompt)
        tokens, parents = random_tree(gen, n, vocab)
        logits = runner.forward(tokens, parents)
        assert logits.shape == (n, vocab) and logits.dtype == torch.float32
        assert_matches_paths(model, logits, prompt, tokens, parents.tolist())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_sdpa_matches_sdpa(pairs, dtype):
    """auto loads a grouped-query model with grouped_sdpa (no repeat_kv copies), as row_sdpa where its AVX2 kernel
    runs (each query row alone: tests/rsd_runtime/test_batch_invariance.py); its tree forwards, prefill and one-token
    forwards give sdpa's logits up to float rounding (GEMMs over 2 x n query rows instead of n may sum in another order:
    1e-6 here, 0 on most shapes)."""
    from rsd_runtime import row_attention

    grouped = load_model(pairs["qwen2"][1], dtype=dtype)
    plain = load_model(pairs["qwen2"][1], dtype=dtype, attn_implementation="sdpa")
    auto = "row_sdpa" if row_attention.available() else "grouped_sdpa"
    assert grouped.config._attn_implementation == auto and grouped.config.num_key_value_heads > 1
    assert plain.config._attn_implementation == "sdpa"
    gen = torch.Generator().manual_seed(3)
    vocab = grouped.config.vocab_size
    prompt = torch.randint(4, vocab, (9,), generator=gen).tolist()
    runners = [prefilled(m, prompt) for m in (grouped, plain)]
    tokens, parents = random_tree(gen, 12, vocab)
    for step in ((tokens[:1], torch.tensor([-1])), (tokens, parents), (tokens[:3], torch.tensor([0, 1, 13]))):
        a, b = (r.forward(*step) for r in runners)
        # bfloat16: a different sum order moves a logit of ~5 by two ulps (1/32 each) after rounding
        torch.testing.assert_close(
            a, b, atol=1e-5 if dtype == "float32" else 5e-2, rtol=0 if dtype == "float32" else 2e-2
        )


def test_prefill_logits_match_causal(model):
    prompt = [5, 9, 7, 30, 4]
    logits = ModelRunner(model).forward(torch.tensor(prompt), torch.arange(5) - 1)  # [5, V]
    for i in range(5):
        torch.testing.assert_close(logits[i], causal_logits(model, prompt[: i + 1]), atol=ATOL, rtol=0)


def test_commit_then_forward_matches_from_scratch(model):
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prefix = [5, 6, 7, 8]
    runner = prefilled(model, prefix)
    keys = runner.cache.layers[0].keys
    for step in range(3):
        tokens, parents = random_tree(gen, 7, vocab)
        logits = runner.forward(tokens, parents)
        assert_matches_paths(model, logits, prefix, tokens, parents.tolist())
        if step == 1:  # a rejected tree: nothing kept
            runner.commit([])
            continue
        # Keep the path to the last node: its indices are rarely contiguous, so K/V really move.
        accepted = path(parents.tolist(), 6)
        runner.commit(torch.tensor(accepted))
        prefix = prefix + tokens[accepted].tolist()
        assert runner.cache_len == len(prefix) and runner.num_tentative == 0
    logits = runner.forward(torch.tensor([9, 10]), torch.tensor([-1, 0]))
    assert_matches_paths(model, logits, prefix, torch.tensor([9, 10]), [-1, 0])
    assert runner.cache.layers[0].keys is keys  # the preallocated buffer was never replaced


def test_level_by_level_equals_single_call(model):
    gen = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompt = [4, 12, 40]
    # Level 0: nodes 0-1 (-1 parents); level 1: nodes 2-4; level 2: nodes 5-7.
    levels = [[-1, -1], [0, 1, 1], [2, 4, 4]]
    tokens = torch.randint(4, vocab, (8,), generator=gen)
    parents = torch.tensor([p for level in levels for p in level])
    single = prefilled(model, prompt)
    single_logits = single.forward(tokens, parents)
    multi = prefilled(model, prompt)
    start, multi_logits = 0, []
    for level in levels:
        stop = start + len(level)
        multi_logits.append(multi.forward(tokens[start:stop], torch.tensor(level)))
        start = stop
    torch.testing.assert_close(torch.cat(multi_logits), single_logits, atol=ATOL, rtol=0)
    assert_matches_paths(model, single_logits, prompt, tokens, parents.tolist())
    for runner in (single, multi):
        runner.commit([1, 4, 7])
    next_token = torch.tensor([11])
    torch.testing.assert_close(
        multi.forward(next_token, torch.tensor([-1])), single.forward(next_token, torch.tensor([-1]))
    )


def test_reset_forgets_everything(model):
    runner = prefilled(model, [5, 6, 7])
    runner.forward(torch.tensor([8]), torch.tensor([-1]))
    runner.reset()
    assert runner.cache_len == 0 and runner.num_tentative == 0
    logits = runner.forward(torch.tensor([9, 10]), torch.tensor([-1, 0]))
    torch.testing.assert_close(logits[1], causal_logits(model, [9, 10]), atol=ATOL, rtol=0)


def test_crop_keeps_a_prefix(model):
    """crop(length) drops later committed tokens and every tentative one; the kept prefix still serves."""
    runner = prefilled(model, [5, 6, 7, 8, 9])
    runner.forward(torch.tensor([10]), torch.tensor([-1]))
    runner.crop(3)
    assert runner.cache_len == 3 and runner.num_tentative == 0
    logits = runner.forward(torch.tensor([20, 21]), torch.tensor([-1, 0]))
    assert_matches_paths(model, logits, [5, 6, 7], torch.tensor([20, 21]), [-1, 0])
    with pytest.raises(ValueError, match="crop length"):
        runner.crop(4)


def test_tokenizer_module_imports_no_torch():
    """The gateway loads tokenizers and holds no model: rsd_runtime.tokenizer must not pull torch in."""
    code = "import sys, rsd_runtime.tokenizer; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trips(pairs, family):
    for model_dir in pairs[family]:
        tokenizer = load_tokenizer(model_dir)
        ids = tokenizer.encode("w1 w2 w3", add_special_tokens=False)
        assert ids == [5, 6, 7]
        assert tokenizer.decode(ids) == "w1 w2 w3"
        assert tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0


@pytest.fixture(scope="module")
def llama(pairs):
    return load_model(pairs["llama"][1])


@pytest.fixture
def busy_runner(llama) -> ModelRunner:
    """max_len 10, three committed tokens and a tentative chain 0 <- 1."""
    runner = prefilled(llama, [5, 6, 7], max_len=10)
    runner.forward(torch.tensor([8, 9]), torch.tensor([-1, 0]))
    return runner


@pytest.mark.parametrize(
    ("tokens", "parents"),
    [
        ([10], [2]),  # its own index: parents must come earlier
        ([10], [-2]),
        ([10, 11], [-1]),  # lengths differ
        ([[10]], [-1]),  # 2-D
        ([], []),
        ([256], [-1]),  # outside the vocabulary
        ([-1], [-1]),
        ([10] * 6, [-1] * 6),  # 3 committed + 2 tentative + 6 > max_len
        ([1.0], [-1]),  # not integers
    ],
)
def test_bad_forward_raises(busy_runner, tokens, parents):
    with pytest.raises(ValueError):
        busy_runner.forward(torch.tensor(tokens), torch.tensor(parents))
    assert busy_runner.num_tentative == 2 and busy_runner.cache_len == 3  # nothing changed


@pytest.mark.parametrize("keep", [[1], [0, 0], [2], [1, 0], [-1]])  # not from a root, repeated, ...
def test_bad_commit_raises(busy_runner, keep):
    with pytest.raises(ValueError, match="commit"):
        busy_runner.commit(keep)
    busy_runner.commit([0, 1])  # the failed call changed nothing
    assert busy_runner.cache_len == 5


def test_refuses_layers_a_tree_mask_cannot_express():
    """Sliding windows are exact (tests/rsd_runtime/test_architectures.py); layers that are not attention, or
    chunked attention, are refused with the reason rather than run with a wrong mask."""
    from rsd_runtime.attention import UnsupportedModelError

    config = Qwen2Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=8, max_window_layers=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert ModelRunner(model, max_len=64).plan.windows == {"sliding_attention": 8}
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        ModelRunner(model, max_len=64)
    model.config.layer_types = ["full_attention", "full_attention"]
    model.config.attention_chunk_size = 4
    with pytest.raises(UnsupportedModelError, match="chunked"):
        ModelRunner(model, max_len=64)


def test_tiny_pairs_are_deterministic_and_reused(tiny_root, tmp_path, pairs):
    draft_dir, target_dir = pairs["llama"]
    stamp = (target_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_pair(tiny_root, "llama") == (draft_dir, target_dir)
    assert (target_dir / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    _, other_target = build_tiny_pair(tmp_path, "llama")
    a, b = load_model(target_dir).state_dict(), load_model(other_target).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The draft differs from the target but tends to agree with it.
    draft, target = load_model(draft_dir), load_model(target_dir)
    ids = torch.randint(4, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p, q = target(ids).logits[0].softmax(-1), draft(ids).logits[0].softmax(-1)  # [32, V]
    tv = 0.5 * (p - q).abs().sum(-1).mean()
    assert 0.05 < tv < 0.5


def test_tiny_vocab_pair(tiny_root):
    draft_dir, target_dir = build_tiny_vocab_pair(tiny_root)
    runner = prefilled(load_model(target_dir), [4, 5])
    assert runner.vocab_size == 8
    assert load_tokenizer(draft_dir).encode("w3 w4", add_special_tokens=False) == [7, 3]  # w4 is unknown


def test_dtype_strings():
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("fp8")
    # auto: the fastest native dtype of the device; this CPU's answer follows its instruction set
    assert parse_dtype("auto", "cpu") is (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_batch_linear_path_per_dtype(dtype):
    """Up to max_rows rows a layer takes rsd_runtime.small_gemm where it runs for the dtype; else fp32 takes
    weight @ x.T (rows > 4 padded to a multiple of 8) and bf16 keeps F.linear (oneDNN) up to 8 rows and only
    then transposes; beyond max_rows, F.linear."""
    from rsd_runtime import small_gemm
    from rsd_runtime.linear import SmallBatchLinear, set_small_batch_rows, use_small_batch_linear

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48)).to(dtype)
    weight = model[0].weight
    assert use_small_batch_linear(model, max_rows=16) == 1
    layer = model[0]  # the nn.Linear replaced by a SmallBatchLinear over the same Parameters
    assert type(layer) is SmallBatchLinear and layer.weight is weight
    for rows in (1, 3, 8, 13, 16, 40):
        x = torch.randn(2, rows, 32, dtype=dtype)[:1]  # [1, R, in]: a batch of one, as the runner uses
        plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
        out = layer(x)
        assert out.shape == plain.shape == (1, rows, 48) and out.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out, plain, atol=tol, rtol=tol)
        kernel = rows <= 16 and small_gemm.supports(x[0], layer.weight)
        if kernel:
            assert torch.equal(out, small_gemm.small_gemm(x[0], layer.weight)[None] + layer.bias)
        elif (dtype == torch.bfloat16 and rows <= 8) or rows > 16:
            assert torch.equal(out, plain)  # the very same kernel
    set_small_batch_rows(model, 0)
    x = torch.randn(1, 5, 32, dtype=dtype)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_small_batch_linear_replaces_children_and_keeps_shared_and_tied_weights():
    """use_small_batch_linear swaps modules, it patches none: a layer held twice stays one layer, a head tied to
    the embeddings stays tied (the same Parameter), and plain_linear swaps nn.Linear back the same way."""
    from rsd_runtime.linear import SmallBatchLinear, plain_linear, use_small_batch_linear

    emb, shared, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "a": shared, "b": shared, "head": head})
    assert use_small_batch_linear(model, 16) == 2
    assert type(model["a"]) is SmallBatchLinear and model["a"] is model["b"] and model["a"].weight is shared.weight
    assert model["head"].weight is emb.weight and model["head"].small_batch_rows == 16
    assert use_small_batch_linear(model, 0, "torch") == 2 and not model["a"].small_gemm  # set again, not wrapped
    assert plain_linear(model) == 2
    assert type(model["head"]) is torch.nn.Linear and model["head"].weight is emb.weight and model["a"] is model["b"]


def test_set_linear_kernel_switches_one_loaded_model(pairs):
    """forward_cost's switch: each kernel gives a tiny target's logits within float rounding of a model that
    was never patched (f_linear: exactly), back and forth on one model; a bad name or an unpatched model
    is refused."""
    from rsd_runtime.linear import set_linear_kernel

    plain = load_model(pairs["qwen2"][1], small_batch_rows=0)  # nn.Linear's own forward everywhere
    model = load_model(pairs["qwen2"][1], small_batch_rows=64)
    patched = [m for m in model.modules() if hasattr(m, "small_batch_rows")]
    ids = torch.randint(0, plain.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    expected = plain(input_ids=ids).logits  # [1, 6, V]
    for kernel, state in [("small_gemm", (64, True)), ("f_linear", (0, False)), ("torch", (64, False))] * 2:
        assert set_linear_kernel(model, kernel, 64) == len(patched) > 0
        assert {(m.small_batch_rows, m.small_gemm) for m in patched} == {state}
        logits = model(input_ids=ids).logits
        if kernel == "f_linear":
            assert torch.equal(logits, expected)
        else:
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-5)
    with pytest.raises(ValueError, match="kernel must be one of f_linear, torch, small_gemm, got 'mkl'"):
        set_linear_kernel(model, "mkl")
    with pytest.raises(ValueError, match="no linear layer of this model is patched"):
        set_linear_kernel(plain, "small_gemm")
    assert set_linear_kernel(plain, "f_linear") == 0  # already F.linear everywhere


def output_layer_rows(model) -> tuple[list[int], object]:
    """A list that records how many rows each forward sends through the model's output layer, and the hook."""
    rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    return rows, hook


@pytest.mark.parametrize("takes_logits_to_keep", [True, False])
def test_catch_up_computes_logits_for_the_tree_only(model, monkeypatch, takes_logits_to_keep):
    """A prefill chain before a tree (forward_with_catch_up: a new session, the verifier's in-process twin)
    gets no logits: the output layer runs on the tree's rows alone, and they equal the full forward's. A
    model whose forward has no logits_to_keep gets the same rows by slicing after."""
    import rsd_runtime.runner as runner_mod
    from rsd_runtime.engines import forward_with_catch_up

    if not takes_logits_to_keep:
        monkeypatch.setattr(runner_mod, "_takes_logits_to_keep", lambda cls: False)
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    committed = torch.randint(4, vocab, (12,), generator=gen).tolist()
    tokens = torch.tensor([committed[-1], 9, 10, 11])  # the root and a small tree
    parents = torch.tensor([-1, 0, 0, 1])
    runner = ModelRunner(model, 64)  # before the hook: a model's first runner probes its tree forward
    rows, hook = output_layer_rows(model)
    try:
        logits = forward_with_catch_up(runner, committed, tokens, parents)  # [4, V]
    finally:
        hook.remove()
    assert logits.shape == (4, vocab) and logits.dtype == torch.float32
    assert rows == [4 if takes_logits_to_keep else 11 + 4]
    # the same 15 tokens with every row's logits: the chain (11), then the root and the tree
    all_parents = torch.tensor([*range(-1, 10), 10, 11, 11, 12])
    full = ModelRunner(model, 64).forward(torch.tensor(committed[:-1] + tokens.tolist()), all_parents)[11:]
    torch.testing.assert_close(logits, full, atol=ATOL, rtol=0)
    assert_matches_paths(model, logits, committed[:-1], tokens, parents.tolist())


@pytest.mark.parametrize("logits_rows", [0, 3])
def test_logits_rows_out_of_range_is_refused(busy_runner, logits_rows):
    with pytest.raises(ValueError, match="logits_rows"):
        busy_runner.forward(torch.tensor([10, 11]), torch.tensor([1, 2]), logits_rows=logits_rows)
    assert busy_runner.num_tentative == 2  # nothing ran


def test_prefill_cost_benchmark_smoke(pairs, tmp_path):
    """rsd_bench.prefill_cost on a tiny target: both cases timed, the same logits to rounding."""
    import json

    from rsd_bench import prefill_cost

    argv = ["--target", str(pairs["llama"][1]), "--prompt-tokens", "8,20", "--tree-nodes", "5", "--reps", "1"]
    assert prefill_cost.main([*argv, "--name", "smoke", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["complete"] and "cpu_flags" in result["machine"] and result["placement"]["threads"] >= 1
    assert [r["prompt_tokens"] for r in result["rows"]] == [8, 20]
    assert all(
        r["tree_only_ms"] > 0 and r["every_row_ms"] > 0 and r["max_abs_logit_diff"] < ATOL for r in result["rows"]
    )
    assert "logits for the tree only" in (tmp_path / "smoke.md").read_text()

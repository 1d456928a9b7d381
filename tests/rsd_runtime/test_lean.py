"""The drafter's lean forward (rsd_runtime.lean): the same logits as the model's own forward, the same
cache, packed or alone; refused where the architecture is not a plain Llama-family decoder."""

from __future__ import annotations

import pytest
import torch

from rsd_runtime import small_gemm
from rsd_runtime.lean import LEAN_MODEL_TYPES, lean_decoder, use_lean_forward
from rsd_runtime.models import load_model, prepare_draft, quantize_draft
from rsd_runtime.packed import forward_packed
from rsd_runtime.runner import ModelRunner
from rsd_tools.tiny import build_tiny_pair
from tests.fixtures.architectures import BY_NAME, save_pair
from tests.rsd_runtime.test_runner import random_tree

QUANTIZE = ["none"] + (["int8"] if small_gemm.available(torch.int8) else [])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lean")


def pair_of_drafters(path, quantize: str):
    """Two copies of one drafter: the model's own forward and the lean one."""
    own, lean = load_model(path), load_model(path)
    for m in (own, lean):
        quantize_draft(m, quantize)
    assert use_lean_forward(lean) == ""
    return own, lean


def prefilled(model, prompt: list[int]) -> ModelRunner:
    runner = ModelRunner(model, 64)
    runner.forward(torch.tensor(prompt), torch.arange(len(prompt)) - 1)
    runner.commit(range(len(prompt)))
    return runner


@pytest.mark.parametrize("quantize", QUANTIZE)
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_lean_matches_own_forward(root, family, quantize):
    own, lean = pair_of_drafters(build_tiny_pair(root, family)[0], quantize)
    calls = lean_decoder(lean).calls
    gen = torch.Generator().manual_seed(5)
    vocab = own.config.vocab_size
    prompt = torch.randint(4, vocab, (9,), generator=gen).tolist()
    runners = [prefilled(m, prompt) for m in (own, lean)]
    tokens, parents = random_tree(gen, 10, vocab)
    for step in ((tokens[:4], parents[:4]), (tokens[4:], parents[4:])):  # a tree in two levels
        a, b = (r.forward(*step) for r in runners)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    keep = [0, 2]  # tokens 0 and 2 form a chain (random_tree: 2 is a child of 0)
    for r in runners:
        r.commit(keep)
    a, b = (r.forward(torch.tensor([7]), torch.tensor([-1])) for r in runners)  # after a commit moved the cache
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert lean_decoder(lean).calls == calls + 4  # prefill, two levels, one token: all lean


def test_lean_weights_are_shared_not_copied(root):
    model = load_model(build_tiny_pair(root, "qwen2")[0])
    before = sum(p.numel() for p in model.parameters())
    assert use_lean_forward(model) == ""
    attn = model.model.layers[0].self_attn
    fused = lean_decoder(model).layers[0][1].fused
    assert attn.q_proj.weight.data_ptr() == fused.weight.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    assert not any(type(m).__module__ == "rsd_runtime.lean" for m in model.modules())  # modules() is the model's own


def test_lean_runs_the_layers_swapped_in_after_it(root):
    """The lean forward reads the model's modules at each call: a layer replaced after it was made runs."""
    from rsd_runtime.linear import plain_linear

    own, lean = pair_of_drafters(build_tiny_pair(root, "qwen2")[0], "none")
    assert plain_linear(lean) > 0  # every SmallBatchLinear back to an nn.Linear
    ran = []
    lean.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *_: ran.append(1))
    a, b = (prefilled(m, [5, 6, 7, 8]).forward(torch.tensor([3, 4]), torch.tensor([-1, 0])) for m in (own, lean))
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert len(ran) == 2  # the prefill and the tree, through the new o_proj


def test_lean_packed_forward_matches_alone(root):
    _, lean = pair_of_drafters(build_tiny_pair(root, "qwen2")[0], "none")
    from rsd_runtime.attention import check_model

    runners = [prefilled(lean, p) for p in ([5, 6, 7, 8], [9, 10, 11])]
    alone = [prefilled(lean, p) for p in ([5, 6, 7, 8], [9, 10, 11])]
    steps = [r.prepare(torch.tensor([3, 4]), torch.tensor([-1, 0])) for r in runners]
    packed = forward_packed(lean, check_model(lean, 128), list(zip(runners, steps, strict=True)))
    for logits, r in zip(packed, alone, strict=True):
        torch.testing.assert_close(logits, r.forward(torch.tensor([3, 4]), torch.tensor([-1, 0])), atol=1e-5, rtol=0)


def test_prepare_draft_gives_a_drafter_the_lean_forward(root):
    model = load_model(build_tiny_pair(root, "llama")[0])
    assert prepare_draft(model) == "none" and lean_decoder(model) is not None


@pytest.mark.parametrize("name", ["gemma2", "gpt2", "qwen3"])
def test_lean_refuses_other_architectures(root, name):
    model = load_model(save_pair(BY_NAME[name], root)[0])
    assert model.config.model_type not in LEAN_MODEL_TYPES
    assert "is not one of" in use_lean_forward(model) and lean_decoder(model) is None


def test_lean_can_be_switched_off(root, monkeypatch):
    monkeypatch.setenv("RSD_LEAN_FORWARD", "0")
    model = load_model(build_tiny_pair(root, "qwen2")[0])
    assert use_lean_forward(model) == "RSD_LEAN_FORWARD=0" and lean_decoder(model) is None


def test_lean_windowed_mistral_matches_own_forward(root):
    """Mistral's sliding window lives in the runner's mask (by position), which the lean forward takes as is."""
    own, lean = pair_of_drafters(save_pair(BY_NAME["mistral-window"], root)[0], "none")
    prompt = list(range(3, 23))  # longer than the window of 6
    runners = [prefilled(m, prompt) for m in (own, lean)]
    a, b = (r.forward(torch.tensor([4, 5, 6]), torch.tensor([-1, 0, -1])) for r in runners)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)

"""Batched drafting across sessions (rsd_runtime.packed): one packed forward over many runners equals each
runner's own forward (to float rounding), leaves each runner's cache as its own forward would, and the
thread gatherer packs concurrent drafts without changing what they draft.

References are lone ModelRunner.forward calls, themselves checked against plain causal runs in
tests/rsd_runtime/test_runner.py. Windowed and mixed-layer architectures are included: a packed forward's keys
come from several sessions, so a window applied by key index instead of position would show here.
"""

import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd_runtime.attention import check_model
from rsd_runtime.engines import Drafter
from rsd_runtime.packed import PackedForwards, forward_packed
from rsd_runtime.runner import ModelRunner
from tests.fixtures.architectures import ARCHS, build

ATOL = 1e-4
PACKED_ARCHS = ["llama", "qwen2-sliding", "mistral-window", "cohere2", "gpt2"]
PROMPTS = [[5, 9, 11, 3, 7, 8, 20, 21, 4, 6, 30, 31], [40, 41, 42], [7, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module", params=PACKED_ARCHS)
def model(request):
    arch = next(a for a in ARCHS if a.name == request.param)
    return build(arch, seed=0).eval()


def runners(model, n: int = 3, max_len: int = 64) -> list[ModelRunner]:
    out = []
    for prompt in PROMPTS[:n]:
        r = ModelRunner(model, max_len=max_len)
        r.forward(torch.tensor(prompt), torch.arange(len(prompt)) - 1)
        r.commit(range(len(prompt)))
        out.append(r)
    return out


# Two levels of a tree per session (a root and its children, then grandchildren), of different sizes.
LEVELS = [
    [(torch.tensor([12]), torch.tensor([-1])), (torch.tensor([13, 14, 15]), torch.tensor([0, 0, 0]))],
    [(torch.tensor([50, 51]), torch.tensor([-1, -1])), (torch.tensor([52]), torch.tensor([1]))],
    [(torch.tensor([14, 15, 16, 17]), torch.tensor([-1, 0, 1, 1])), (torch.tensor([18, 19]), torch.tensor([3, 2]))],
]


def test_packed_forward_equals_each_runners_own(model):
    lone, packed = runners(model), runners(model)
    plan = check_model(model, 3 * 64)
    for level in range(2):
        want = [r.forward(*LEVELS[i][level]) for i, r in enumerate(lone)]
        got = forward_packed(model, plan, [(r, r.prepare(*LEVELS[i][level])) for i, r in enumerate(packed)])
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    # The caches hold what lone forwards leave: commit a chain, then a lone forward agrees.
    for lo, pa, keep in zip(lone, packed, ([0, 1], [1, 2], [0, 1, 2]), strict=True):
        lo.commit(keep)
        pa.commit(keep)
        assert (lo.cache_len, lo.num_tentative) == (pa.cache_len, pa.num_tentative)
        nxt = (torch.tensor([60, 61]), torch.tensor([-1, 0]))
        torch.testing.assert_close(pa.forward(*nxt), lo.forward(*nxt), atol=ATOL, rtol=0)


def test_packed_forward_computes_only_the_rows_each_segment_asks_for(model):
    """logits_rows per segment (a catch-up chain before a tree wants no logits): the output layer runs on
    those rows alone, and they equal the last rows of each runner's own full forward."""
    lone, packed = runners(model), runners(model)
    keep = [1, 2, 3]
    want = [r.forward(*LEVELS[i][0])[-keep[i] :] for i, r in enumerate(lone)]
    rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    try:
        steps = [(r, r.prepare(*LEVELS[i][0], logits_rows=keep[i])) for i, r in enumerate(packed)]
        got = forward_packed(model, check_model(model, 3 * 64), steps)
    finally:
        hook.remove()
    assert rows == [sum(keep)] and [g.shape[0] for g in got] == keep
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert [r.num_tentative for r in packed] == [len(LEVELS[i][0][0]) for i in range(3)]  # every token ran


def test_one_step_alone_is_the_runners_own_forward_bit_for_bit(model):
    (lone,), (packed,) = runners(model, 1), runners(model, 1)
    tokens, parents = LEVELS[0][0]
    want = lone.forward(tokens, parents)
    (got,) = forward_packed(model, packed.plan, [(packed, packed.prepare(tokens, parents))])
    assert torch.equal(got, want)


def test_a_failed_packed_forward_leaves_every_runner_as_it_was(model, monkeypatch):
    rs = runners(model)
    before = [(r.cache_len, r.num_tentative, [layer.num_filled for layer in r.cache.layers]) for r in rs]
    steps = [(r, r.prepare(*LEVELS[i][0])) for i, r in enumerate(rs)]

    def boom(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(model, "forward", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        forward_packed(model, check_model(model, 3 * 64), steps)
    assert [(r.cache_len, r.num_tentative, [la.num_filled for la in r.cache.layers]) for r in rs] == before


def test_packed_forward_refuses_a_runner_twice_or_of_another_model(model):
    (r,) = runners(model, 1)
    plan = check_model(model, 128)
    with pytest.raises(ValueError, match="twice"):
        forward_packed(model, plan, [(r, r.prepare(*LEVELS[0][0])), (r, r.prepare(*LEVELS[0][0]))])
    other = build(next(a for a in ARCHS if a.name == "llama"), seed=1).eval()
    with pytest.raises(ValueError, match="packed model"):
        forward_packed(other, plan, [(r, r.prepare(*LEVELS[0][0]))])


def test_bad_input_is_refused_in_the_callers_thread_and_queues_nothing(model):
    (r,) = runners(model, 1)
    packer = PackedForwards(model, 128)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        packer.forward(r, torch.tensor([10_000]), torch.tensor([-1]))
    assert packer._pending == [] and packer.stats.forwards == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_concurrent_drafts_are_packed_and_draft_what_they_draft_alone(model, temperature):
    """Sessions drafting in threads at once share forwards; each tree equals its lone draft (the same
    tokens and parents; laws to float rounding)."""
    method, params = Method.parse("rsd_s", "3x3"), SamplingParams(temperature=temperature)
    alone = []  # fresh runners: each first forward catches up its prompt (chains of different lengths)
    for i, r in enumerate(ModelRunner(model, 64) for _ in PROMPTS):
        gen = StepRandom(i, Stream.DRAFT, len(PROMPTS[i]) - 1)
        alone.append(Drafter(r).draft(PROMPTS[i], method, params, gen))

    packer = PackedForwards(model, 3 * 64, wait_s=5.0)  # long wait: every level packs all three
    rs, trees, errors = [ModelRunner(model, 64) for _ in PROMPTS], [None] * 3, []
    ready = threading.Barrier(3)  # all three are drafting before any asks for a forward

    def draft(i: int) -> None:
        try:
            with packer.drafting():
                ready.wait(timeout=60)
                gen = StepRandom(i, Stream.DRAFT, len(PROMPTS[i]) - 1)
                trees[i] = Drafter(rs[i], forward=packer.forward).draft(PROMPTS[i], method, params, gen)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=draft, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    for want, got in zip(alone, trees, strict=True):
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.parent_idx, want.parent_idx)
        torch.testing.assert_close(got.draft_probs, want.draft_probs, atol=1e-5, rtol=0)
    s = packer.stats
    assert s.calls == 3 * 3 and s.max_calls >= 2 and s.forwards < s.calls


def test_draft_batching_benchmark_smoke(tmp_path):
    """rsd_bench.draft_batching on a tiny draft: every case runs, packed rounds share forwards."""
    import json

    from rsd_bench import draft_batching
    from rsd_tools.tiny import build_tiny_pair

    draft_dir = build_tiny_pair(tmp_path / "models", "qwen2")[0]
    argv = ["--draft", str(draft_dir), "--sessions", "1,3", "--reps", "1", "--prompt-tokens", "12"]
    assert draft_batching.main([*argv, "--shape", "2x2", "--name", "smoke", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["complete"] and "cpu_flags" in result["machine"]
    assert [(r["sessions"], r["packed"]) for r in result["rows"]] == [(1, True), (1, False), (3, True), (3, False)]
    assert all(r["trees_per_s"] > 0 for r in result["rows"])
    assert result["packer"]["forwards"] < result["packer"]["calls"]
    assert "packed ÷ alone" in (tmp_path / "smoke.md").read_text()

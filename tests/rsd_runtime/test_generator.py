"""The in-process generator on tiny real transformers models.

Greedy: every method's output is token for token the target's own greedy output (reference: the
target's plain full-sequence forward, no cache, no runner). Sampling: on a pair with an 8-token
vocabulary the first two generated tokens follow the target's exact law (chi-square).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd_runtime.generator import Finish, SpeculativeGenerator, cut_step, finishes
from rsd_runtime.kvcache import common_prefix_length
from rsd_runtime.models import load_model
from rsd_runtime.runner import ModelRunner
from rsd_tools.tiny import build_tiny_pair, build_tiny_vocab_pair
from tests.fixtures.services import penalised_logits
from tests.fixtures.toy import chi_square_pvalue

GREEDY_METHODS = [
    ("sd", "4"),
    ("specinfer", "2,2"),
    ("spectr", "3x3"),
    ("rsd_c", "2,2,2"),
    ("rsd_c", "3,1"),
    ("rsd_s", "3x4"),
    ("rsd_s", "2x2"),
    ("rsd_s", "3x6@0.3"),  # confidence stop
    ("sd", "8@0.4"),
]
PROMPTS = [[2, 10, 11, 12], [2, 50], [2, 7, 7, 7, 7, 30, 31]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    draft_dir, target_dir = build_tiny_pair(tmp_path_factory.mktemp("tiny"), request.param)
    return load_model(draft_dir), load_model(target_dir)


@torch.inference_mode()
def target_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_autoregressive_greedy_matches_target(pair):
    _, target = pair
    gen = SpeculativeGenerator(ModelRunner(target, 256))
    for prompt in PROMPTS:
        out = gen.generate(prompt, None, SamplingParams(temperature=0), max_new_tokens=12)
        assert out.token_ids == target_greedy(target, prompt, 12)
        assert out.stats.target_calls == 12


@pytest.mark.parametrize(("name", "shape"), GREEDY_METHODS)
def test_every_method_is_target_greedy_at_temperature_zero(pair, name, shape):
    draft, target = pair
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    for prompt in PROMPTS:
        out = gen.generate(prompt, Method.parse(name, shape), SamplingParams(temperature=0), max_new_tokens=20)
        assert out.token_ids == target_greedy(target, prompt, 20)
        assert out.stats.new_tokens == 20
        assert out.stats.block_efficiency > 1.0  # the draft is a noisy copy: speculation must pay


def test_stops_at_eos_and_respects_max_new_tokens(pair):
    draft, target = pair
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    ref = target_greedy(target, PROMPTS[0], 10)
    eos = ref[4]
    out = gen.generate(PROMPTS[0], Method.parse("rsd_c", "2,2"), SamplingParams(0), 10, eos_token_ids=(eos,))
    assert out.token_ids == ref[: ref.index(eos) + 1]
    out = gen.generate(PROMPTS[0], Method.parse("rsd_c", "2,2,2"), SamplingParams(0), max_new_tokens=3)
    assert out.token_ids == ref[:3]


def test_same_seed_same_output_and_stats_add_up(pair):
    draft, target = pair
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    method, params = Method.parse("rsd_s", "3x3"), SamplingParams(temperature=0.8, top_p=0.95)
    a = gen.generate(PROMPTS[1], method, params, max_new_tokens=16, seed=7)
    b = gen.generate(PROMPTS[1], method, params, max_new_tokens=16, seed=7)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    s = a.stats
    assert sum(s.accepted_by_depth) + s.target_calls >= s.new_tokens
    assert all(0 <= r <= 1 for r in s.acceptance_by_depth)


def test_rejects_mismatched_vocabularies(tmp_path):
    _, small = build_tiny_pair(tmp_path, "llama", vocab_size=64)
    _, big = build_tiny_pair(tmp_path, "llama", vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeGenerator(ModelRunner(load_model(big)), ModelRunner(load_model(small)))


# ---- sampling follows the target ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    draft_dir, target_dir = build_tiny_vocab_pair(tmp_path_factory.mktemp("tinyv"), vocab_size=8)
    return load_model(draft_dir), load_model(target_dir)


@torch.inference_mode()
def target_law_two_tokens(model, prompt: list[int], params: SamplingParams) -> dict:
    from rsd.sampling import logits_to_probs

    law = {}
    q1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], params).double()
    for a in q1.nonzero().flatten().tolist():
        q2 = logits_to_probs(model(torch.tensor([[*prompt, a]])).logits[0, -1], params).double()
        for b in q2.nonzero().flatten().tolist():
            law[(a, b)] = float(q1[a] * q2[b])
    return law


@pytest.mark.parametrize(
    ("name", "shape", "params", "verification"),
    [
        ("rsd_c", "2,2", SamplingParams(temperature=1.0), "token"),
        ("rsd_s", "3x2", SamplingParams(temperature=0.7, top_k=6), "token"),
        ("spectr", "2x2", SamplingParams(temperature=1.0, top_p=0.9), "token"),
        ("specinfer", "2,2", SamplingParams(temperature=0.7, top_k=6), "traversal"),
        ("sd", "3", SamplingParams(temperature=1.0), "block"),
    ],
)
def test_first_tokens_follow_target_law(tiny_vocab_pair, name, shape, params, verification):
    """End to end through the runners, one case per rule family (the confidence stop and each method x rule pair
    are proved by enumeration in tests/rsd, and sampled through the pipeline in tests/rsd/test_statistical.py)."""
    draft, target = tiny_vocab_pair
    gen = SpeculativeGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    prompt, n, counts = [2, 5, 6], 1500, {}
    for seed in range(n):
        out = gen.generate(
            prompt, Method.parse(name, shape), params, max_new_tokens=2, seed=seed, verification=verification
        )
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, target_law_two_tokens(target, prompt, params), n) > 1e-4


PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 2.0}


@torch.inference_mode()
def penalised_law_two_tokens(model, prompt: list[int], temperature: float, penalties: dict) -> dict:
    """The law of the first two tokens of the target alone with the penalties (written out, tests.fixtures)."""
    params, law = SamplingParams(temperature, **penalties), {}

    def probs(output):
        logits = model(torch.tensor([prompt + output])).logits[0, -1].double()
        return torch.softmax(penalised_logits(logits, prompt, output, params) / temperature, -1)

    q1 = probs([])
    for a in range(q1.shape[0]):
        q2 = probs([a])
        for b in range(q2.shape[0]):
            law[(a, b)] = float(q1[a] * q2[b])
    return law


def test_first_tokens_follow_the_penalised_target_law(tiny_vocab_pair):
    """With presence, frequency and repetition penalties the first two tokens (one tree: the second token's law
    counts the first, drafted on the same path) follow the penalised target's law; not the plain target's. (One
    method here: tests/rsd/test_penalties.py proves every method and verification by enumeration.)"""
    draft, target = tiny_vocab_pair
    gen = SpeculativeGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    prompt, n, counts = [2, 5, 6], 1500, {}
    params = SamplingParams(1.0, **PENALTIES)
    for seed in range(n):
        out = gen.generate(prompt, Method.parse("rsd_c", "2,2"), params, max_new_tokens=2, seed=seed)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert chi_square_pvalue(counts, penalised_law_two_tokens(target, prompt, 1.0, PENALTIES), n) > 1e-4
    assert chi_square_pvalue(counts, target_law_two_tokens(target, prompt, SamplingParams(1.0)), n) < 1e-8


@torch.inference_mode()
def target_alone_coupled(model, prompt: list[int], params: SamplingParams, seed: int, n: int) -> list[int]:
    """The target alone, each token argmax log q + G with Stream.COUPLED's noise of its position (rsd.coupled)."""
    from rsd.coupled import coupled_token
    from rsd.sampling import logits_to_probs

    ids = list(prompt)
    for _ in range(n):
        q = logits_to_probs(model(torch.tensor([ids])).logits[0, -1], params).double()
        ids.append(coupled_token(q, StepRandom(seed, Stream.COUPLED, len(ids) - 1), 0))
    return ids[len(prompt) :]


@pytest.mark.parametrize(("name", "shape"), [("sd", "4"), ("rsd_c", "2,2,1"), ("rsd_s", "3x4"), ("rsd_s", "3x6@0.3")])
def test_coupled_rule_emits_the_target_alones_gumbel_max_sampling(pair, name, shape):
    """With the coupled rule the output is, token for token, the target alone sampling with the same noise
    (rsd.coupled), through the real runners at T = 0.8 with top-k and top-p; and some drafts are accepted."""
    draft, target = pair
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    for seed, params in enumerate([SamplingParams(0.8), SamplingParams(0.8, top_k=20, top_p=0.9)]):
        for prompt in PROMPTS:
            out = gen.generate(prompt, Method.parse(name, shape), params, 16, seed=seed, verification="coupled")
            assert out.token_ids == target_alone_coupled(target, prompt, params, seed, 16)
            assert out.stats.rule == "coupled"
            alone = gen.generate(prompt, None, params, 16, seed=seed, verification="coupled")  # speculation off
            assert alone.token_ids == out.token_ids


LOOKUP_PROMPTS = [*PROMPTS, [2, 10, 11, 12, 13, 2, 10, 11], [3, 4, 5, 3, 4, 5, 3, 4]]


@pytest.mark.parametrize("shape", ["6", "2,1,1"])
def test_lookup_without_a_draft_model_is_target_greedy_at_temperature_zero(pair, shape):
    """Context drafting (rsd.lookup) needs no draft model; at T = 0 its output is the target's greedy output,
    and on prompts that repeat it proposes (the target then accepts what it would have emitted anyway)."""
    _, target = pair
    gen = SpeculativeGenerator(ModelRunner(target, 256))
    proposed = 0
    for prompt in LOOKUP_PROMPTS:
        out = gen.generate(prompt, Method.parse("lookup", shape), SamplingParams(temperature=0), max_new_tokens=20)
        assert out.token_ids == target_greedy(target, prompt, 20)
        assert out.stats.draft_forwards == 0
        proposed += out.stats.target_calls < 20 or out.stats.new_tokens < 20
    assert proposed > 0


def test_lookup_first_tokens_follow_target_law_and_coupled_is_the_target_alone(tiny_vocab_pair, pair):
    """At T > 0 the first two tokens after a prompt that repeats (so the root proposes) follow the target's law;
    with the coupled rule the output is the target alone's Gumbel-max sampling, token for token."""
    _, target = tiny_vocab_pair
    gen = SpeculativeGenerator(ModelRunner(target, 64))
    prompt, n, counts, params = [2, 5, 6, 2, 5], 1500, {}, SamplingParams(temperature=1.0)
    for seed in range(n):
        out = gen.generate(prompt, Method.parse("lookup", "2,1"), params, max_new_tokens=2, seed=seed)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert chi_square_pvalue(counts, target_law_two_tokens(target, prompt, params), n) > 1e-4
    _, target = pair
    gen = SpeculativeGenerator(ModelRunner(target, 256))
    for seed, prompt in enumerate(LOOKUP_PROMPTS):
        out = gen.generate(
            prompt, Method.parse("lookup", "6"), SamplingParams(0.8), 16, seed=seed, verification="coupled"
        )
        assert out.token_ids == target_alone_coupled(target, prompt, SamplingParams(0.8), seed, 16)


@pytest.mark.parametrize("method", [("sd", "4"), ("rsd_c", "2,1,1"), ("rsd_s", "2x3")])
def test_lookups_merged_into_the_models_tree_keep_the_target_greedy_output(pair, method):
    """--lookup-n 2: nodes whose context repeats take the context's law and cost no draft forward (the model
    runs them only as ancestors of a node that needs it); at T = 0 the output is still the target's greedy
    output, and on prompts that repeat the drafter runs fewer forwards than without lookups."""
    draft, target = pair
    plain = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    hybrid = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256), lookup_n=2)
    saved = 0
    for prompt in LOOKUP_PROMPTS:
        out = hybrid.generate(prompt, Method.parse(*method), SamplingParams(temperature=0), max_new_tokens=20)
        assert out.token_ids == target_greedy(target, prompt, 20)
        base = plain.generate(prompt, Method.parse(*method), SamplingParams(temperature=0), max_new_tokens=20)
        saved += base.stats.draft_forwards / base.stats.target_calls - out.stats.draft_forwards / out.stats.target_calls
    assert saved > 0


@pytest.mark.parametrize("first", [[0], []])
def test_the_model_proposal_runs_the_ancestors_it_has_not_run(pair, first):
    """Asked for a node whose ancestors it never ran (a looked-up law above it, or nothing run yet this step),
    the draft model runs them first in the same forward: the law is the draft model's after the whole path."""
    from rsd.sampling import logits_to_probs
    from rsd_runtime.engines import ModelProposal

    draft, _ = pair
    prompt, params = PROMPTS[0], SamplingParams(temperature=1.0)
    token_ids, parent_idx = torch.tensor([prompt[-1], 7, 9, 4]), torch.tensor([-1, 0, 1, 0])
    proposal = ModelProposal(ModelRunner(draft, 256), prompt, params)
    if first:
        proposal(token_ids, parent_idx, torch.tensor(first))
    law = proposal(token_ids, parent_idx, torch.tensor([2, 3]))  # node 2's parent 1 never ran
    assert sorted(proposal.tentative_of) == [0, 1, 2, 3] and proposal.num_forwards == 1 + len(first)
    fresh = ModelRunner(draft, 256)
    for row, path in enumerate([[7, 9], [4]]):
        ids = prompt + path
        fresh.reset()
        logits = fresh.forward(torch.tensor(ids), torch.arange(-1, len(ids) - 1), logits_rows=1)
        assert torch.allclose(law[row], logits_to_probs(logits, params)[0], atol=1e-5)


def test_verification_is_recorded_and_a_pairing_that_is_not_exact_is_refused(tiny_vocab_pair):
    draft, target = tiny_vocab_pair
    gen = SpeculativeGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    params = SamplingParams(temperature=1.0)
    out = gen.generate([2, 5, 6], Method.parse("spectr", "2x2"), params, max_new_tokens=4, verification="traversal")
    assert out.stats.rule == "traversal_with_replacement"
    assert gen.generate([2, 5, 6], Method.parse("sd", "3"), params, max_new_tokens=4).stats.rule == "rrs"
    with pytest.raises(ValueError, match="one chain only"):
        gen.generate([2, 5, 6], Method.parse("rsd_c", "2,2"), params, max_new_tokens=4, verification="block")


def test_small_batch_linear_keeps_greedy_output(pair):
    """weight @ x.T instead of F.linear changes only float rounding: the tree logits stay within the
    runner's tolerance and greedy speculative output is still the target's own."""
    from rsd_runtime.linear import plain_linear, use_small_batch_linear

    draft, target = pair
    prompt = PROMPTS[0]
    expected = target_greedy(target, prompt, 12)
    plain = ModelRunner(target, 256)
    plain.forward(torch.tensor(prompt), torch.tensor(list(range(-1, len(prompt) - 1))))
    before = plain.forward(torch.tensor([40, 41]), torch.tensor([-1, -1]))
    assert use_small_batch_linear(target, max_rows=64) > 0 and use_small_batch_linear(draft, max_rows=64) > 0
    try:
        fast = ModelRunner(target, 256)
        fast.forward(torch.tensor(prompt), torch.tensor(list(range(-1, len(prompt) - 1))))
        after = fast.forward(torch.tensor([40, 41]), torch.tensor([-1, -1]))
        assert (after - before).abs().max() < 1e-4
        gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
        out = gen.generate(prompt, Method.parse("rsd_s", "3x3"), SamplingParams(0), max_new_tokens=12)
        assert out.token_ids == expected
    finally:
        for model in (target, draft):
            plain_linear(model)  # nn.Linear again for the other tests


def test_pruned_draft_vocabulary_stays_exact(tmp_path):
    """A drafter that scores only the first K ids proposes only them (law 0 elsewhere), and
    verification with that law keeps greedy output the target's own and T > 0 on the target's law."""
    from rsd_runtime.models import prune_draft_vocab

    draft_dir, target_dir = build_tiny_pair(tmp_path, "qwen2")
    draft, target = load_model(draft_dir), load_model(target_dir)
    prune_draft_vocab(draft, 100)  # of 256
    assert draft.get_input_embeddings().weight.shape[0] == 256  # the embeddings keep every id
    runner = ModelRunner(draft, 256)
    logits = runner.forward(torch.tensor(PROMPTS[2]), torch.tensor(list(range(-1, len(PROMPTS[2]) - 1))))
    assert logits.shape[-1] == 256 and torch.isinf(logits[:, 100:]).all() and torch.isfinite(logits[:, :100]).all()
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    for prompt in PROMPTS:
        out = gen.generate(prompt, Method.parse("rsd_c", "3,2,1"), SamplingParams(0), max_new_tokens=10)
        assert out.token_ids == target_greedy(target, prompt, 10)
    gen.drafter.runner.reset()
    tree = gen.drafter.draft(
        PROMPTS[0], Method.parse("rsd_s", "3x3"), SamplingParams(1.0), StepRandom(0, Stream.DRAFT, 0)
    )
    assert (tree.draft_probs[:, 100:] == 0).all() and (tree.token_ids[1:] < 100).all()


def test_cut_step_budget_and_eos():
    """One cut for the in-process loop and the drafter service: at the budget, after the first EOS."""
    assert cut_step([5, 6, 7], 5, {9}) == ([5, 6, 7], None)
    assert cut_step([5, 6, 7], 2, {9}) == ([5, 6], Finish.LENGTH)
    assert cut_step([5, 9, 7], 5, {9}) == ([5, 9], Finish.EOS)
    assert cut_step([5, 9], 2, {9}) == ([5, 9], Finish.EOS)  # EOS wins over a budget it also spends
    assert cut_step([5, 6, 9], 2, {9}) == ([5, 6], Finish.LENGTH)  # an EOS past the budget is never committed
    assert [finishes(t, 3, (9,)) for t in ([5], [5, 9], [5, 6, 7, 8])] == [False, True, True]


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0

"""The batched verifier engine against the single-session path (rsd_runtime.engines.Verifier).

Reference for every check: each session run alone through ModelRunner + Verifier (or the whole
SpeculativeGenerator). The packed forward must give the same logits (1e-4) and the same verdicts.
"""

import pytest
import torch

from rsd.acceptance import RULES
from rsd.constraint import Guide
from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd.tree import DraftTree
from rsd_runtime.engines import Drafter, Verifier, forward_with_catch_up
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import batch_variance, load_model
from rsd_runtime.runner import ModelRunner
from rsd_tools.tiny import build_tiny_pair
from tests.fixtures.services import processed_scores
from verifier_service.engine import (
    BatchVerifyError,
    PoolFullError,
    UnknownSessionError,
    VerifierPool,
    VerifyRequest,
)

ATOL = 1e-4
PROMPTS = [[2, 10, 11, 12], [2, 50], [2, 7, 7, 7, 7, 30, 31]]
SHAPES = [[-1, 0, 0, 1, 1, 2], [-1], [-1, 0, 1, 2, 0, 4, 4]]  # parent_idx of three tree shapes
# (rule, params) per session: greedy, RSD at T=1, K-SEQ at T=0.7 with top-k.
RULE_PARAMS = [
    (RULES["greedy"], SamplingParams(0)),
    (RULES["rrs"], SamplingParams(1.0)),
    (RULES["kseq"], SamplingParams(0.7, top_k=50)),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    draft_dir, target_dir = build_tiny_pair(tmp_path_factory.mktemp("tiny"), request.param)
    return load_model(draft_dir), load_model(target_dir)


def random_tree(root: int, parents: list[int], vocab: int, seed: int) -> DraftTree:
    """Distinct draft tokens (so siblings are valid without-replacement draws) under `root`, and a
    full-support proposal law per node."""
    gen = torch.Generator().manual_seed(seed)
    n = len(parents)
    tokens = torch.cat([torch.tensor([root]), 4 + torch.randperm(vocab - 4, generator=gen)[: n - 1]])
    probs = torch.softmax(2 * torch.randn(n, vocab, generator=gen), -1)
    return DraftTree(tokens, torch.tensor(parents), probs)


def _rng(seed: int = 0) -> StepRandom:
    return StepRandom(seed, Stream.VERIFY, 0)


def requests_for(committed: dict[str, list[int]], trees: dict[str, DraftTree], seed: int) -> list[VerifyRequest]:
    return [VerifyRequest(s, committed[s], trees[s], *RULE_PARAMS[i], _rng(seed + i)) for i, s in enumerate(committed)]


def test_packed_step_matches_each_session_alone(pair):
    _, target = pair
    vocab = target.config.vocab_size
    engine = VerifierPool(target, num_slots=4, max_len=64)
    sessions = ["a", "b", "c"]
    committed = dict(zip(sessions, [list(p) for p in PROMPTS], strict=True))
    alone = {s: ModelRunner(target, 64) for s in sessions}
    for s in sessions:
        assert engine.attach(s, committed[s]) == 0
    for step in range(3):  # step 0 prefills every prompt as a catch-up chain inside the packed forward
        trees = {
            s: random_tree(committed[s][-1], SHAPES[(i + step) % 3], vocab, 10 * step + i)
            for i, s in enumerate(sessions)
        }
        reqs = requests_for(committed, trees, seed=100 * step)
        packed = engine.score_batch(reqs)  # nothing committed
        verdicts = engine.verify_batch(requests_for(committed, trees, seed=100 * step))
        for i, (s, req) in enumerate(zip(sessions, reqs, strict=True)):
            runner = alone[s]
            ref_logits = forward_with_catch_up(runner, committed[s], req.tree.token_ids, req.tree.parent_idx)
            runner.commit(list(range(runner.num_tentative - req.tree.num_nodes)))  # keep the chain only
            torch.testing.assert_close(packed[i], ref_logits, atol=ATOL, rtol=0)
            ref = Verifier(runner).verify(committed[s], req.tree, req.rule, req.params, _rng(100 * step + i))
            assert verdicts[i].verdict == ref
            committed[s] = committed[s] + ref.token_ids
            assert engine.cached_length(s) == runner.cache_len == len(committed[s]) - 1


def test_sessions_joining_and_leaving_match_generator(pair):
    """Four sessions through a 3-slot pool: drafted by one Drafter each, verified together; the last
    one waits for a released slot. Each output equals SpeculativeGenerator run alone (same seed)."""
    draft, target = pair
    jobs = {  # session: (prompt, method, params, seed, step it arrives at)
        "a": ([2, 10, 11, 12], Method.parse("rsd_c", "2,2"), SamplingParams(0), 0, 0),
        "b": ([2, 50], Method.parse("rsd_c", "2,2"), SamplingParams(1.0), 1, 0),
        "c": ([2, 7, 7, 7, 7, 30, 31], Method.parse("spectr", "3x3"), SamplingParams(0), 2, 1),
        "d": ([2, 9, 40], Method.parse("spectr", "2x3"), SamplingParams(0.8), 3, 1),
    }
    new_tokens = 16
    expected = {
        s: SpeculativeGenerator(ModelRunner(target, 128), ModelRunner(draft, 128))
        .generate(p, m, params, max_new_tokens=new_tokens, seed=seed)
        .token_ids
        for s, (p, m, params, seed, _) in jobs.items()
    }
    engine = VerifierPool(target, num_slots=3, max_len=128)
    engine.attach("warm-up", [2, 3])  # materialise the pool buffers, then check they are never replaced
    engine.verify_batch(
        [
            VerifyRequest(
                "warm-up", [2, 3], random_tree(3, [-1, 0], target.config.vocab_size, 0), *RULE_PARAMS[0], _rng()
            )
        ]
    )
    engine.release("warm-up")
    keys = engine.cache.layers[0].keys
    state: dict[str, tuple] = {}  # active session: (committed, drafter, seed)
    done: dict[str, list[int]] = {}
    waited = False
    step = 0
    while len(done) < len(jobs):
        for s, (prompt, _, _, seed, arrives) in jobs.items():
            if s in state or s in done or arrives > step:
                continue
            try:
                assert engine.attach(s, prompt) == 0
            except PoolFullError:
                waited = True
                continue
            state[s] = (list(prompt), Drafter(ModelRunner(draft, 128)), seed)
        reqs, before = [], {}
        for s, (committed, drafter, seed) in state.items():
            _, method, params, _, _ = jobs[s]
            draft_gen = StepRandom(seed, Stream.DRAFT, len(committed) - 1)
            verify_gen = StepRandom(seed, Stream.VERIFY, len(committed) - 1)
            tree = drafter.draft(committed, method, params, draft_gen)
            reqs.append(VerifyRequest(s, committed, tree, method.rule(params.greedy), params, verify_gen))
            before[s] = list(committed)
        for req, verdict in zip(reqs, engine.verify_batch(reqs), strict=True):
            committed, drafter, *_ = state[req.session_id]
            drafter.accept(before[req.session_id], verdict)
            prompt_len = len(jobs[req.session_id][0])
            committed += verdict.token_ids[: new_tokens - (len(committed) - prompt_len)]
            if len(committed) - prompt_len == new_tokens:
                done[req.session_id] = committed[prompt_len:]
                del state[req.session_id]
                engine.release(req.session_id)
        step += 1
    assert waited, "the fourth session should have waited for a free slot"
    assert done == expected
    assert engine.num_free_slots == 3
    assert engine.cache.layers[0].keys is keys  # K/V were written and moved in place


def test_pool_full_unknown_session_and_release(pair):
    _, target = pair
    engine = VerifierPool(target, num_slots=2, max_len=32)
    assert engine.attach("a", [2, 5, 6]) == 0
    assert engine.attach("b", [2, 7]) == 0
    with pytest.raises(PoolFullError):
        engine.attach("c", [2])
    for call in (lambda: engine.cached_length("x"), lambda: engine.release("x")):
        with pytest.raises(UnknownSessionError):
            call()
    tree = random_tree(3, [-1, 0], target.config.vocab_size, 0)
    with pytest.raises(UnknownSessionError):
        engine.verify_batch([VerifyRequest("x", [2, 3], tree, RULES["greedy"], SamplingParams(0), _rng())])
    engine.release("a")
    assert engine.num_free_slots == 1
    assert engine.attach("c", [2]) == 0
    with pytest.raises(UnknownSessionError):
        engine.cached_length("a")


def test_attach_crops_and_bad_requests(pair):
    _, target = pair
    vocab = target.config.vocab_size
    engine = VerifierPool(target, num_slots=2, max_len=16)
    committed = [2, 5, 6, 7, 8]
    engine.attach("a", committed)
    greedy = (RULES["greedy"], SamplingParams(0), _rng())
    verdict = engine.verify_batch([VerifyRequest("a", committed, random_tree(8, [-1, 0], vocab, 1), *greedy)])[0]
    committed = committed + verdict.token_ids
    assert engine.cached_length("a") == len(committed) - 1
    assert engine.attach("a", committed) == len(committed) - 1  # already attached: kept
    assert engine.attach("a", [2, 5, 6]) == 2  # shorter truth: cropped to committed - 1
    assert engine.attach("a", [2, 5, 9, 9]) == 2  # diverging truth: cropped to the common prefix
    # After cropping the cache still gives the single-session logits.
    tree = random_tree(9, [-1, 0, 1], vocab, 2)
    packed = engine.score_batch([VerifyRequest("a", [2, 5, 9, 9], tree, *greedy)])[0]
    ref = forward_with_catch_up(ModelRunner(target, 16), [2, 5, 9, 9], tree.token_ids, tree.parent_idx)
    torch.testing.assert_close(packed, ref, atol=ATOL, rtol=0)

    engine.attach("b", [2, 4])
    with pytest.raises(ValueError, match="root"):
        engine.verify_batch([VerifyRequest("b", [2, 4], random_tree(5, [-1], vocab, 0), *greedy)])
    with pytest.raises(ValueError, match="max_len"):
        engine.verify_batch([VerifyRequest("b", [2] * 13, random_tree(2, [-1, 0, 0, 0, 0], vocab, 0), *greedy)])
    with pytest.raises(ValueError, match="twice"):
        req = VerifyRequest("b", [2, 4], random_tree(4, [-1], vocab, 0), *greedy)
        engine.verify_batch([req, req])
    # A tree its rule refuses (RSD needs distinct siblings) fails alone; the other session commits.
    dup = DraftTree(torch.tensor([4, 9, 9]), torch.tensor([-1, 0, 0]), torch.full((3, vocab), 1 / vocab))
    good = VerifyRequest("a", [2, 5, 9, 9], tree, *greedy)
    with pytest.raises(BatchVerifyError) as info:
        engine.verify_batch([good, VerifyRequest("b", [2, 4], dup, RULES["rrs"], SamplingParams(1.0), _rng())])
    assert set(info.value.errors) == {"b"} and info.value.verdicts[1] is None
    assert engine.cached_length("a") == 4 + len(info.value.verdicts[0].accepted_ids)
    assert engine.cached_length("b") == 0


def test_eager_attention_packed_logits(tmp_path_factory):
    """eager adds the mask as is: the float block-diagonal mask must work there too."""
    _, target_dir = build_tiny_pair(tmp_path_factory.mktemp("tiny_eager"), "llama")
    target = load_model(target_dir, attn_implementation="eager")
    vocab = target.config.vocab_size
    engine = VerifierPool(target, num_slots=3, max_len=32)
    reqs = []
    for i, (prompt, shape) in enumerate(zip(PROMPTS, SHAPES, strict=True)):
        engine.attach(str(i), prompt)
        reqs.append(VerifyRequest(str(i), prompt, random_tree(prompt[-1], shape, vocab, i), *RULE_PARAMS[0], _rng()))
    for req, packed in zip(reqs, engine.score_batch(reqs), strict=True):
        t = req.tree
        ref = forward_with_catch_up(ModelRunner(target, 32), req.committed_ids, t.token_ids, t.parent_idx)
        torch.testing.assert_close(packed, ref, atol=ATOL, rtol=0)


def test_draws_are_needed_only_when_sampling(pair):
    """VerifyRequest.rng None is greedy's: same verdict as with draws; sampling without them is refused."""
    _, target = pair
    vocab = target.config.vocab_size
    engine = VerifierPool(target, num_slots=2, max_len=32)
    tree = random_tree(6, [-1, 0, 0, 1], vocab, 3)
    for s in ("none", "gen"):
        engine.attach(s, [2, 5, 6])
    greedy = (RULES["greedy"], SamplingParams(0))
    with_none, with_gen = engine.verify_batch(
        [VerifyRequest("none", [2, 5, 6], tree, *greedy), VerifyRequest("gen", [2, 5, 6], tree, *greedy, _rng(7))]
    )
    assert with_none == with_gen
    assert engine.cached_length("none") == engine.cached_length("gen")
    with pytest.raises(ValueError, match="needs its draws"):
        engine.verify_batch([VerifyRequest("none", [2, 5, 6], tree, RULES["rrs"], SamplingParams(1.0))])


def test_prefill_chains_get_no_logits(pair):
    """A packed step whose sessions catch up their prompts (chains of 3, 1 and 6 tokens) runs the output
    layer on the trees' nodes alone; the logits equal each session's own full forward (score_batch)."""
    _, target = pair
    vocab = target.config.vocab_size
    engine = VerifierPool(target, num_slots=4, max_len=64)
    sessions = ["a", "b", "c"]
    committed = dict(zip(sessions, [list(p) for p in PROMPTS], strict=True))
    trees = {s: random_tree(committed[s][-1], SHAPES[i], vocab, seed=i) for i, s in enumerate(sessions)}
    for s in sessions:
        engine.attach(s, committed[s])
    rows: list[int] = []
    hook = target.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    try:
        got = engine.score_batch(requests_for(committed, trees, seed=0))
    finally:
        hook.remove()
    assert rows == [sum(len(p) for p in SHAPES)]
    for s, g in zip(sessions, got, strict=True):
        tree = trees[s]
        want = ModelRunner(target, 64).forward(
            torch.tensor(committed[s][:-1] + tree.token_ids.tolist()),
            torch.tensor(
                [*range(-1, len(committed[s]) - 2)]
                + [p + len(committed[s]) - 1 if p >= 0 else len(committed[s]) - 2 for p in tree.parent_idx.tolist()]
            ),
        )[len(committed[s]) - 1 :]
        torch.testing.assert_close(g, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("params", [SamplingParams(0), SamplingParams(1.0), SamplingParams(0.7, top_k=5)])
def test_logprobs_are_the_plain_forwards_log_softmax(pair, params):
    """Each emitted token's logprob (and the top 5) is log_softmax of the target's own logits at its position,
    as one plain forward of the whole sequence gives them: raw, whatever the temperature, packed or not."""
    _, target = pair
    vocab = target.config.vocab_size
    engine = VerifierPool(target, num_slots=2, max_len=64)
    committed = {"a": list(PROMPTS[0]), "b": list(PROMPTS[2])}
    for s in committed:
        engine.attach(s, committed[s])
    rule = RULES["greedy" if params.greedy else "rrs"]
    for step in range(3):
        reqs = [
            VerifyRequest(
                s, committed[s], random_tree(committed[s][-1], SHAPES[i], vocab, step), rule, params, _rng(step), 5
            )
            for i, s in enumerate(committed)
        ]
        for req, verdict in zip(reqs, engine.verify_batch(reqs), strict=True):
            before = req.committed_ids
            seq = before + verdict.token_ids
            with torch.no_grad():
                logits = target(torch.tensor([seq])).logits[0, len(before) - 1 : len(seq) - 1].float()  # [M, V]
            want = torch.log_softmax(logits, -1)
            lp = verdict.logprobs
            assert len(lp) == len(verdict.token_ids)
            assert torch.allclose(lp.logprobs, want[torch.arange(len(lp)), torch.tensor(verdict.token_ids)], atol=1e-4)
            assert torch.allclose(lp.top_logprobs, want.topk(5, -1).values, atol=1e-4)
            committed[req.session_id] = seq
    plain = VerifyRequest("a", committed["a"], random_tree(committed["a"][-1], [-1], vocab, 9), rule, params, _rng())
    assert engine.verify_batch([plain])[0].logprobs is None  # not asked


def test_sessions_of_one_prompt_share_its_prefill(pair):
    """Three sessions of one prompt (OpenAI's n) and one other in a packed step: the prompt's K/V are computed
    once (the input holds one copy of it) and the others attend to that slot's; a session attached later reads
    them off a slot that holds them. Each session's verdicts and logits are those it gets alone in a pool of its
    own, step after step (its cache is its own once copied), at T = 1 with its own draws."""
    _, target = pair
    vocab = target.config.vocab_size
    prompts = {"a": PROMPTS[2], "b": PROMPTS[2], "c": PROMPTS[2], "d": PROMPTS[0], "e": PROMPTS[2]}
    params, rule = SamplingParams(1.0), RULES["rrs"]
    invariant = batch_variance(target) == ""  # then bit for bit: a row's logits depend on its own keys alone
    engine = VerifierPool(target, num_slots=5, max_len=64)
    alone = {s: VerifierPool(target, num_slots=1, max_len=64) for s in prompts}
    committed = {s: list(p) for s, p in prompts.items()}
    for s in prompts:
        alone[s].attach(s, committed[s])
    rows: list[int] = []
    hook = target.get_input_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-1]))
    try:
        for step, batch in enumerate([["a", "b", "c", "d"], ["a", "b", "c", "d"], ["e", "a"], ["e", "b"]]):
            for s in batch:
                if step == 0 or (s == "e" and step == 2):
                    assert engine.attach(s, committed[s]) == 0
            trees = {s: random_tree(committed[s][-1], SHAPES[i % 3], vocab, 10 * step + i) for i, s in enumerate(batch)}
            reqs = [VerifyRequest(s, committed[s], trees[s], rule, params, _rng(100 * step + ord(s))) for s in batch]
            rows.clear()
            packed = engine.score_batch(reqs)
            got = engine.verify_batch(reqs)
            new_rows = rows[0]
            for s, req, lg, verdict in zip(batch, reqs, packed, got, strict=True):
                want_logits = alone[s].score_batch([req])[0]
                torch.testing.assert_close(lg, want_logits, atol=0 if invariant else ATOL, rtol=0)
                assert verdict == alone[s].verify_batch([req])[0]
                committed[s] = committed[s] + verdict.token_ids
            nodes = sum(t.num_nodes for t in trees.values())
            if step == 0:  # one prompt chain for a, b, c (not three); d's but its first token (2, as a's)
                assert new_rows == len(PROMPTS[2]) - 1 + len(PROMPTS[0]) - 2 + nodes
            elif step == 2:  # e's prompt from a's slot: the trees alone
                assert new_rows == nodes
    finally:
        hook.remove()
    assert engine.cached_length("e") == len(committed["e"]) - 1


class ParityAutomaton:
    """A toy constraint: after an even number of generated tokens `forbidden[0]` is banned, after an odd one
    `forbidden[1]`, so the mask of a tree node depends on its own path's length."""

    initial_state = 0

    def __init__(self, vocab: int, forbidden: tuple[list[int], list[int]]):
        self.masks = torch.ones(2, vocab, dtype=torch.bool)  # [2, V]
        for state, ids in enumerate(forbidden):
            self.masks[state, ids] = False

    def allowed(self, state):
        return self.masks[state]

    def next_state(self, state, token):
        return 1 - state if self.masks[state, token] else None


PROCESSED = [
    SamplingParams(0, logit_bias=((40, 3.0),), presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
    SamplingParams(0.8, 20, 0.9, ((7, -2.0), (40, 3.0)), 0.5, 0.3, 1.3),
    SamplingParams(1.0, logit_bias=((12, 1.5),), frequency_penalty=-0.4),
]


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits", "raw_logits"])
@pytest.mark.parametrize("params", PROCESSED)
@pytest.mark.parametrize("num_sessions", [1, 2])
def test_processed_logprobs_are_the_law_sampled_from(pair, params, mode, num_sessions):
    """logprobs_mode's figures of each emitted token (and the top 5) equal a plain forward's logits with the
    constraint mask, logit_bias, penalties of the token's own path, temperature, top-k and top-p written out
    by hand; one session alone and two packed in one forward."""
    _, target = pair
    vocab = target.config.vocab_size
    trees = {  # the draft tokens (all but the roots) are known up front: the constraint must allow them
        (i, step): random_tree(0, SHAPES[i], vocab, 20 + step) for i in range(num_sessions) for step in range(3)
    }
    drafted = {int(t) for tree in trees.values() for t in tree.token_ids[1:]}
    free = [t for t in range(4, vocab) if t not in drafted and t not in (40, 7, 12)]
    forbidden = (free[:30], free[30:60])
    engine = VerifierPool(target, num_slots=2, max_len=64)
    committed = {s: list(PROMPTS[2 * i]) for i, s in enumerate("ab"[:num_sessions])}
    starts = {s: len(committed[s]) for s in committed}
    guides = {s: Guide(ParityAutomaton(vocab, forbidden), starts[s]) for s in committed}
    for s in committed:
        engine.attach(s, committed[s])
    rule = RULES["greedy" if params.greedy else "rrs"]
    for step in range(3):
        reqs = []
        for i, s in enumerate(committed):
            tree = random_tree(committed[s][-1], SHAPES[i], vocab, 20 + step)  # trees[i, step] under this root
            reqs.append(VerifyRequest(s, committed[s], tree, rule, params, _rng(step), 5, guides[s], starts[s], mode))
        for req, verdict in zip(reqs, engine.verify_batch(reqs), strict=True):
            before, s = req.committed_ids, req.session_id
            seq = before + verdict.token_ids
            with torch.no_grad():
                raw = target(torch.tensor([seq])).logits[0, len(before) - 1 : len(seq) - 1].float()  # [M, V]
            if mode == "raw_logits":
                want = raw.double()
            else:
                prompt, rows = seq[: starts[s]], []
                for j in range(len(verdict.token_ids)):  # by hand, each with its own output so far
                    output = seq[starts[s] : len(before) + j]
                    rows.append(processed_scores(raw[j], prompt, output, params, mode, forbidden[len(output) % 2]))
                want = torch.stack(rows)  # [M, V]
            lp = verdict.logprobs
            got_top = lp.top_logprobs.double()
            want_top = want.topk(5, -1).values
            assert torch.equal(torch.isinf(got_top), torch.isinf(want_top))
            finite = torch.isfinite(want_top)
            torch.testing.assert_close(got_top[finite], want_top[finite], atol=1e-4, rtol=0)
            chosen = want[torch.arange(len(lp)), torch.tensor(verdict.token_ids)]
            assert torch.isfinite(chosen).all()  # a token is emitted only where its law has mass
            torch.testing.assert_close(lp.logprobs.double(), chosen, atol=1e-4, rtol=0)
            if mode == "processed_logprobs" and params.greedy:
                assert torch.equal(lp.top_ids[:, 0], torch.tensor(verdict.token_ids))  # the argmax, emitted
            committed[s] = seq


def test_logit_bias_moves_the_greedy_token_and_is_checked(pair):
    _, target = pair
    vocab = target.config.vocab_size
    engine = VerifierPool(target, num_slots=1, max_len=64)
    committed = list(PROMPTS[0])
    engine.attach("a", committed)
    forced = SamplingParams(0, logit_bias=((33, 100.0),))
    tree = random_tree(committed[-1], SHAPES[0], vocab, 1)
    verdict = engine.verify_batch([VerifyRequest("a", committed, tree, RULES["greedy"], forced, _rng())])[0]
    assert set(verdict.token_ids) == {33}  # +100: the argmax at every node
    committed += verdict.token_ids
    outside = SamplingParams(0, logit_bias=((vocab, 1.0),))
    tree = random_tree(33, SHAPES[0], vocab, 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.verify_batch([VerifyRequest("a", committed, tree, RULES["greedy"], outside, _rng())])

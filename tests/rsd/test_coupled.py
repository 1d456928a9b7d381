"""The coupled rule (rsd.coupled): the output is the target alone's Gumbel-max sampling with the noise of
Stream.COUPLED, token for token, whatever was drafted; that sampling follows the target's law.

The first test is the rule's proof in this code base: it checks the equality over many seeds, tables,
methods, shapes (confidence stops and top-k included) and step boundaries; the second checks the
Gumbel-max lemma on Philox's noise by chi-square; the negative control reads the wrong position's noise.
The noise is drawn in blocks (StepRandom.arrivals): its tests check that the arrivals are i.i.d. Exp(1) and
that the verifier's pruned search picks the token a draw of every arrival picks.
"""

from __future__ import annotations

import pytest
import torch

from rsd.acceptance import RULES, accepted_length_law, step_law, verify
from rsd.coupled import coupled_token, coupled_walk
from rsd.methods import Method
from rsd.random import COUPLED_BLOCK, StepRandom, Stream
from tests.fixtures import toy

V = 4
SHAPES = [("sd", "3"), ("rsd_c", "2,2"), ("rsd_c", "3,1,1@0.3"), ("rsd_s", "2x3"), ("rsd_s", "3x2@0.3")]


def _proposal(table, committed):
    """The table's laws below the committed tokens (committed[0] is the toy root)."""
    return toy.TableProposal(lambda path: table((*committed[1:], *path)))


def speculative(method, draft, target, seed, length, rule=RULES["coupled"], draft_stream=Stream.COUPLED):
    """`length` tokens of the draft + verify loop with `rule`; the laws of toy tables over the whole sequence."""
    committed, steps = [0], 0
    while len(committed) - 1 < length:
        root = len(committed) - 1
        tree = method.draft(_proposal(draft, committed), committed[-1], StepRandom(seed, draft_stream, root), False)
        q = toy.target_probs_for(tree, lambda path, c=tuple(committed[1:]): target((*c, *path)))
        verdict = verify(tree, q, rule, StepRandom(seed, Stream.VERIFY, root))
        committed += verdict.token_ids
        steps += 1
    return tuple(committed[1 : length + 1]), steps


def target_alone(target, seed, length, stale=False):
    """The target's own Gumbel-max sampling with Stream.COUPLED's noise (stale: token t reads token t - 1's)."""
    out: list[int] = []
    for _ in range(length):
        root = max(len(out) - 1, 0) if stale else len(out)
        out.append(coupled_token(target(tuple(out)), StepRandom(seed, Stream.COUPLED, root), 0))
    return tuple(out)


@pytest.mark.parametrize(("name", "shape"), SHAPES)
@pytest.mark.parametrize("top_k", [0, 2])
def test_output_is_the_target_alones_gumbel_max_sampling(name, shape, top_k):
    method = Method.parse(name, shape)
    assert method.rule(False, "coupled") is RULES["coupled"]
    accepted = 0
    for seed in range(40):
        draft = toy.transformed(toy.random_table(100 + seed % 3, V), top_k=top_k)
        target = toy.transformed(toy.random_table(200 + seed % 3, V), top_k=top_k)
        out, steps = speculative(method, draft, target, seed, 8)
        assert out == target_alone(target, seed, 8)
        accepted += 8 - steps
    assert accepted > 0  # the trees do get accepted


def test_the_draft_model_and_its_noise_change_how_much_is_accepted_never_the_output():
    """A draft far from the target, or drawn from other noise (Stream.DRAFT), still yields the same tokens."""
    target, close, far = toy.random_table(7, V), toy.random_table(7, V), toy.random_table(8, V)
    method = Method.parse("rsd_c", "2,2")
    steps = {}
    for label, draft, stream in [
        ("close", close, Stream.COUPLED),
        ("far", far, Stream.COUPLED),
        ("other", close, Stream.DRAFT),
    ]:
        total = 0
        for seed in range(30):
            out, n = speculative(method, draft, target, seed, 6, draft_stream=stream)
            assert out == target_alone(target, seed, 6)
            total += n
        steps[label] = total
    assert steps["close"] == 60  # the draft is the target: every step accepts a path of 2, emits a bonus (3 tokens)
    assert steps["far"] > steps["close"] and steps["other"] > steps["close"]


def test_gumbel_max_sampling_with_the_philox_noise_follows_the_target_law():
    target, n = toy.random_table(32, V), 6000
    counts: dict = {}
    for seed in range(n):
        key = target_alone(target, seed, 3)
        counts[key] = counts.get(key, 0) + 1
    assert toy.chi_square_pvalue(counts, toy.extend((), target, 3), n) > 1e-4


def test_negative_control_reading_the_previous_positions_noise_is_detected():
    """Picking token t with the noise that picked token t - 1 couples the two: the law is wrong."""
    target, n = toy.random_table(32, V), 6000
    counts: dict = {}
    for seed in range(n):
        key = target_alone(target, seed, 3, stale=True)
        counts[key] = counts.get(key, 0) + 1
    assert toy.chi_square_pvalue(counts, toy.extend((), target, 3), n) < 1e-8


def test_pairings_refusals_and_laws():
    for name, shape in [("specinfer", "2,2"), ("spectr", "2x3")]:
        with pytest.raises(ValueError, match="Gumbel-Top-K"):
            Method.parse(name, shape).rule(False, "coupled")
    assert Method.parse("rsd_s", "2x2").rule(True, "coupled") is RULES["greedy"]  # T = 0: greedy matching
    assert RULES["coupled"].draft_stream is Stream.COUPLED and RULES["rrs"].draft_stream is Stream.DRAFT
    method, table = Method.parse("rsd_c", "2,2"), toy.random_table(3, V)
    tree = method.draft(toy.TableProposal(table), 0, StepRandom(0, Stream.COUPLED, 0), False)
    q = toy.target_probs_for(tree, table)
    for law in (step_law, accepted_length_law):
        with pytest.raises(ValueError, match="noise the tree was drawn with"):
            law(tree, q, RULES["coupled"])
    with pytest.raises(ValueError, match=r"Stream\.COUPLED"):
        coupled_walk(tree, lambda n: q[n], StepRandom(0, Stream.VERIFY, 0))


def test_every_node_at_one_depth_shares_its_positions_noise():
    rng = StepRandom(5, Stream.COUPLED, 10)
    a = rng.gumbel(torch.tensor([1, 4]), None, 9, depth=2)  # [2, 9]
    assert torch.equal(a[0], a[1])
    assert torch.equal(a[0], StepRandom(5, Stream.COUPLED, 12).gumbel(torch.tensor([0]), None, 9)[0])  # by position
    assert not torch.equal(a[0], rng.gumbel(torch.tensor([1]), None, 9, depth=1)[0])
    ids = torch.tensor([[3, 7]])
    assert torch.equal(rng.gumbel(torch.tensor([1]), ids, 9, depth=2)[0], a[0, [3, 7]])  # keyed by token id


@pytest.mark.parametrize(("name", "shape"), [("sd", "3"), ("rsd_c", "3,1")])
def test_exact_acceptance_of_rule_gap_matches_the_code(name, shape):
    """rsd_bench.rule_gap.coupled_accepted (closed form) against what the rule accepts in 2,000 seeded steps."""
    from rsd_bench.rule_gap import coupled_accepted
    from rsd_bench.spectr_rsd_toy import at_context, pair

    method = Method.parse(name, shape)
    draft, target = (at_context(t, 0) for t in pair(V, 2.5, 1.0, 1.0))
    exact, first = coupled_accepted(method, draft, target, V)
    n, accepted, any_accepted = 2000, [], 0
    for seed in range(n):
        tree = method.draft(toy.TableProposal(draft), 0, StepRandom(seed, Stream.COUPLED, 0), False)
        verdict = verify(tree, toy.target_probs_for(tree, target), RULES["coupled"], StepRandom(seed, Stream.VERIFY, 0))
        accepted.append(len(verdict.accepted_idx))
        any_accepted += bool(verdict.accepted_idx)
    mean = sum(accepted) / n
    sd = (sum((a - mean) ** 2 for a in accepted) / (n - 1)) ** 0.5
    assert abs(mean - exact) < 4.5 * sd / n**0.5, (mean, exact)
    assert abs(any_accepted / n - first) < 4.5 * (first * (1 - first) / n) ** 0.5 + 1e-9


def _every_arrival(q, noise, depth):
    """coupled_token by drawing every token's arrival: argmin T / q, the smallest id on a tie."""
    ratio = noise.arrivals(torch.arange(q.numel()), depth) / q  # [V]
    return int(torch.nonzero(ratio == ratio.min())[0, 0])


def _laws(vocab_size, generator):
    """Laws [V] float64 of every kind the search meets: peaked to flat softmaxes, a top-k cut, one token."""
    logits = torch.randn(vocab_size, generator=generator, dtype=torch.float64)
    for scale in (0.3, 2.0, 8.0):
        yield torch.softmax(logits * scale, 0)
    cut = torch.softmax(logits * 2, 0)
    cut[cut < cut.topk(5).values[-1]] = 0
    yield cut / cut.sum()
    yield torch.nn.functional.one_hot(torch.tensor(vocab_size // 2), vocab_size).double()


@pytest.mark.parametrize("vocab_size", [7, 3 * COUPLED_BLOCK + 5, 5000])
def test_the_pruned_search_picks_the_token_every_arrival_picks(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    for seed in range(25):
        for q in _laws(vocab_size, generator):
            noise = StepRandom(seed, Stream.COUPLED, 3 * seed)
            assert coupled_token(q, noise, seed % 3) == _every_arrival(q, noise, seed % 3)


def test_a_real_vocabularys_search_picks_the_token_every_arrival_picks():
    generator = torch.Generator().manual_seed(0)
    for seed, q in enumerate(_laws(151_936, generator)):
        noise = StepRandom(seed, Stream.COUPLED, 100)
        assert coupled_token(q, noise, 0) == _every_arrival(q, noise, 0)


def test_arrivals_are_independent_exponentials():
    """T(v) ~ Exp(1) for a block's first-arrival id and the others alike, independent within and across blocks;
    each block's first arrival is its smallest T."""
    from scipy import stats

    n, ids = 4000, torch.arange(2 * COUPLED_BLOCK)
    t = torch.stack([StepRandom(7, Stream.COUPLED, p).arrivals(ids, 0) for p in range(n)])  # [n, 2B]
    for v in (0, 1, COUPLED_BLOCK + 3):
        assert stats.kstest(t[:, v].numpy(), "expon").pvalue > 1e-3
    first = t.view(n, 2, COUPLED_BLOCK).min(-1)  # [n, 2]
    assert stats.kstest((first.values * COUPLED_BLOCK).flatten().numpy(), "expon").pvalue > 1e-3
    where = torch.bincount(first.indices.flatten(), minlength=COUPLED_BLOCK).numpy()
    assert stats.chisquare(where).pvalue > 1e-3  # the first arrival falls anywhere in its block
    assert torch.equal(StepRandom(7, Stream.COUPLED, 0).arrivals(None, 0, len(ids)), t[0])  # counters once
    blocks = torch.arange(2)
    m, a = StepRandom(7, Stream.COUPLED, 0).first_arrivals(blocks, 0)
    assert torch.equal(t[0].view(2, COUPLED_BLOCK)[blocks, a], m) and torch.equal(first.values[0], m)
    corr = torch.corrcoef(t[:, [0, 1, COUPLED_BLOCK + 3]].T)
    assert (corr - torch.eye(3)).abs().max() < 0.07  # about 4.5 standard errors at n = 4000

"""rsd.sampling: the transforms (logit bias, temperature, top-k, top-p), the proposal laws, supports and the
samplers."""

import pytest
import torch

from rsd.random import Draw, StepRandom, Stream
from rsd.sampling import (
    SamplingParams,
    gumbel_top_k,
    logits_to_probs,
    nonzero_ids,
    proposal_probs,
    sample,
    support,
    top_k_indices,
    truncate,
    without_replacement,
)
from tests.fixtures.toy import chi_square_pvalue


def test_truncate_top_k_top_p():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert torch.allclose(truncate(probs, top_k=2), torch.tensor([0, 4 / 7, 0, 3 / 7]))
    assert torch.allclose(truncate(probs, top_p=0.7), torch.tensor([0, 4 / 7, 0, 3 / 7]))
    assert torch.allclose(truncate(probs, top_p=0.71), torch.tensor([0, 4 / 9, 2 / 9, 3 / 9]))
    assert torch.equal(truncate(probs, top_p=0.01), torch.tensor([0.0, 1, 0, 0]))


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3  # [F, V]
    logits[0, vocab // 3 :] = float("-inf")  # a pruned draft head (rsd_runtime.models.PrunedLMHead)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie at the top
    return logits


@pytest.mark.parametrize("vocab", [1000, 40_000, 151_936, 151_937])
@pytest.mark.parametrize("k", [1, 5, 256])
def test_top_k_indices_is_the_top_k_set(vocab, k):
    logits = _logits(4, vocab)
    fast = top_k_indices(logits, k)
    assert fast.shape == (4, k)
    want = torch.topk(logits, k, dim=-1).values
    assert torch.equal(logits.gather(-1, fast), want)  # the same k values, largest first
    assert all(len(set(row)) == k for row in fast.tolist())


@pytest.mark.parametrize(
    "params, top_k, top_p",
    [
        (SamplingParams(1.0), 256, 1.0),
        (SamplingParams(0.6, top_k=40), 256, 1.0),
        (SamplingParams(1.3, top_k=500), 256, 1.0),
        (SamplingParams(0.7), 0, 1.0),  # no truncation: the softmax
        (SamplingParams(1.0, top_p=0.9), 256, 1.0),  # top-p: the general path
        (SamplingParams(1.0), 256, 0.95),
        (SamplingParams(0.0), 256, 1.0),  # greedy: one-hot
        (SamplingParams(0.8, top_k=40, logit_bias=((3, 8.0), (7, -100.0), (151_935, 5.5))), 256, 1.0),
        (SamplingParams(0.0, logit_bias=((11, 100.0),)), 256, 1.0),
    ],
)
def test_proposal_probs_is_the_truncated_law(params, top_k, top_p):
    logits = _logits(5, 151_936)
    want = truncate(logits_to_probs(logits, params), top_k, top_p)
    got = proposal_probs(logits, params, top_k, top_p)
    assert got.dtype == want.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert torch.equal(got > 0, want > 0)  # the same support: ties at the cut aside, none here
    assert torch.allclose(got.sum(-1), torch.ones(5), atol=1e-4)  # the wire's float32 tolerance


def test_support_and_nonzero_ids_of_sparse_and_dense_rows():
    probs = proposal_probs(_logits(4, 151_937), SamplingParams(1.0), 256)  # [4, V], 256 positives a row
    probs[2] = 0.0
    probs[2, [3, 151_936]] = 0.5  # a short support, one entry in the tail past the last full block
    values, ids = support(probs)
    top = torch.topk(probs, 256, dim=-1)
    assert torch.equal(values, top.values) and torch.equal(probs.gather(-1, ids), values)
    assert set(ids[2, :2].tolist()) == {3, 151_936} and values[2, 2:].eq(0).all()
    assert [t.tolist() for t in nonzero_ids(probs)] == [row.nonzero().flatten().tolist() for row in probs]
    dense = torch.softmax(_logits(3, 500).clamp_min(-50), -1)  # every entry positive: itself, no ids
    assert support(dense)[1] is None and torch.equal(support(dense)[0], dense)
    bad = probs.clone()
    bad[1, 5], bad[3, 9] = -0.1, float("nan")  # nonzero too: found, for the caller to refuse
    assert [t.tolist() for t in nonzero_ids(bad)] == [row.nonzero().flatten().tolist() for row in bad]


def test_logits_to_probs_temperature_and_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert logits_to_probs(logits, SamplingParams(temperature=0)).tolist() == [[0, 1, 0]]
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_sample_and_the_samplers_without_replacement_respect_support():
    rng = StepRandom(0, Stream.DRAFT, 0)
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).expand(200, -1)
    assert set(sample(probs, rng.uniform(Draw.IID, 0, torch.arange(200))).tolist()) == {1, 2}
    for sampler in (gumbel_top_k, without_replacement):
        ids, valid = sampler(probs[:1], 3, rng, torch.tensor([0]))
        assert valid.tolist() == [[True, True, False]] and set(ids[0, :2].tolist()) == {1, 2}
    # rows of different support sizes in one call: each keeps its own count of children
    ids, valid = without_replacement(torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]), 3, rng, torch.tensor([0, 1]))
    assert valid.tolist() == [[True, False, False], [True, True, True]]
    assert ids[0, 0] == 1 and sorted(ids[1].tolist()) == [0, 1, 2]


def _plackett_luce(law: list[float], order: tuple[int, ...]) -> float:
    """The chance that sampling without replacement from law draws `order` first, in that order."""
    chance, left = 1.0, 1.0
    for t in order:
        chance, left = chance * law[t] / left, left - law[t]
    return chance


def test_without_replacement_draws_the_plackett_luce_law():
    """Sequential inversion samples the law Gumbel-top-k samples: x_1 ~ p, x_2 ~ p without x_1, ... (2 of 4
    tokens, 20,000 keys: one per step position; fixed seeds)."""
    law = [0.1, 0.4, 0.2, 0.3]
    probs = torch.tensor([law, law[::-1]])  # two rows, two nodes: each its own draws
    n = 20_000
    counts = [{}, {}]
    for position in range(n):
        ids, _ = without_replacement(probs, 2, StepRandom(5, Stream.DRAFT, position), torch.tensor([0, 3]))
        for row, c in zip(ids.tolist(), counts, strict=True):
            c[tuple(row)] = c.get(tuple(row), 0) + 1
    for row_law, c in zip((law, law[::-1]), counts, strict=True):
        expected = {(a, b): _plackett_luce(row_law, (a, b)) for a in range(4) for b in range(4) if a != b}
        assert chi_square_pvalue(c, expected, n) > 1e-3


def test_without_replacement_draws_by_inversion_and_keeps_the_coupled_noise():
    """Its first child is sample()'s draw with the (ORDERED, node, 0) uniform; under Stream.COUPLED the
    children are the Gumbel-top-k of the position's shared noise (rsd.coupled needs that noise)."""
    probs = torch.softmax(_logits(3, 500), -1)
    nodes = torch.tensor([0, 4, 7])
    rng = StepRandom(11, Stream.DRAFT, 40)
    ids, _ = without_replacement(probs, 1, rng, nodes)
    assert ids[:, 0].tolist() == sample(probs, rng.uniform(Draw.ORDERED, nodes[:, None], torch.zeros(1))[:, 0]).tolist()
    coupled = StepRandom(11, Stream.COUPLED, 40)
    assert torch.equal(without_replacement(probs, 3, coupled, nodes)[0], gumbel_top_k(probs, 3, coupled, nodes)[0])


def test_sample_inverts_the_cumulative_law():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]], dtype=torch.float64).expand(6, -1)
    u = torch.tensor([1e-16, 0.2499, 0.2501, 0.9, 1 - 2**-53, 1.0], dtype=torch.float64)  # 1.0: u * mass rounding up
    assert sample(probs, u).tolist() == [1, 1, 3, 3, 3, 3]  # never a zero-probability id
    with pytest.raises(ValueError, match="one uniform per row"):
        sample(probs, u[:2])


@pytest.mark.parametrize(
    "row",
    [[0.0, 0.0, 0.0, 0.0], [0.5, float("nan"), 0.5, 0.0], [0.5, float("inf"), 0.0, 0.0], [1.5, -0.5, 0.0, 0.0]],
)
def test_samplers_refuse_a_row_that_is_not_a_law(row):
    """argmax over an all-zero or NaN row would silently return token 0."""
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], row])
    with pytest.raises(ValueError, match=r"row 1 of \(2,\)\) is not a law"):
        sample(probs, torch.full((2,), 0.5, dtype=torch.float64))
    for sampler in (gumbel_top_k, without_replacement):
        with pytest.raises(ValueError, match="not a law"):
            sampler(probs, 2, StepRandom(0, Stream.DRAFT, 0), torch.tensor([0, 1]))


def test_logit_bias_is_added_to_the_logits_before_the_rest():
    logits = _logits(3, 50)
    bias = ((2, 1.5), (9, -100.0), (49, 100.0))
    got = logits_to_probs(logits, SamplingParams(0.7, logit_bias=bias))
    shifted = logits.clone()
    for t, b in bias:
        shifted[:, t] += b
    assert torch.allclose(got, torch.softmax(shifted / 0.7, -1), atol=1e-7, rtol=0)
    assert torch.equal(logits, _logits(3, 50))  # the caller's logits are left alone
    greedy = logits_to_probs(logits, SamplingParams(0.0, logit_bias=((5, 100.0),)))
    assert greedy.argmax(-1).tolist() == [5, 5, 5]
    assert float(got[:, 9].max()) < 1e-40  # -100: banned in practice


@pytest.mark.parametrize(
    "bias, message",
    [
        (((3, 100.5),), "logit_bias values must be in"),
        (((3, float("nan")),), "logit_bias values must be in"),
        (((-1, 1.0),), "logit_bias token ids"),
        (((4, 1.0), (3, 1.0)), "logit_bias token ids"),  # not increasing
        (((3, 1.0), (3, 2.0)), "logit_bias token ids"),  # twice
    ],
)
def test_logit_bias_is_validated(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(1.0, logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_refused():
    params = SamplingParams(1.0, logit_bias=((50, 1.0),))
    params.check_vocab(51)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        params.check_vocab(50)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        logits_to_probs(_logits(2, 50), params)
    assert SamplingParams(1.0, logit_bias=((0, -100.0), (2, 100.0))).logit_bias[1] == (2, 100.0)  # the edges

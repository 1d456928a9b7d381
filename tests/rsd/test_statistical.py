"""Statistical checks of the sampling code itself, with fixed seeds and firm thresholds.

test_acceptance.py proves the rules against the *enumerated* tree laws; here the drafting code must
produce trees with exactly those laws, and whole pipelines (draft + verify) must emit text with the
target's law. Pearson chi-square; a correct sampler fails with probability 1e-4 per test, and the
negative control must land far below.
"""

from functools import cache

import pytest
import torch

from rsd.acceptance import RULES, verify
from rsd.drafting import DraftMode, draft_sbs, draft_spectr, draft_tree
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams, logits_to_probs, proposal_probs
from tests.fixtures import toy

WOR, IID = DraftMode.WITHOUT_REPLACEMENT, DraftMode.IID

V = 4
P_MIN = 1e-4
STOP = 0.3  # confidence stop, as in test_acceptance.py


def _key(tree):
    return (tuple(tree.token_ids.tolist()), tuple(tree.parent_idx.tolist()))


DRAFTERS = {
    "rsd_c_2x2": (
        lambda p, g: draft_tree(toy.TableProposal(p), 0, [2, 2], WOR, g),
        lambda p: toy.branching_tree_law(p, V, [2, 2], WOR),
    ),
    "specinfer_2x1": (
        lambda p, g: draft_tree(toy.TableProposal(p), 0, [2, 1], IID, g),
        lambda p: toy.branching_tree_law(p, V, [2, 1], IID),
    ),
    "spectr_k2_l2": (
        lambda p, g: draft_spectr(toy.TableProposal(p), 0, 2, 2, g),
        lambda p: toy.branching_tree_law(p, V, [2, 1], IID),
    ),
    "rsd_s_w2_l2": (
        lambda p, g: draft_sbs(toy.TableProposal(p), 0, 2, 2, g),
        lambda p: toy.sbs_tree_law(p, V, 2, 2),
    ),
    # the confidence stop: the code's trees follow the cut laws that test_acceptance.py proves exact
    "rsd_c_2x1x1_stop": (
        lambda p, g: draft_tree(toy.TableProposal(p), 0, [2, 1, 1], WOR, g, stop_below=STOP),
        lambda p: toy.confidence_cut(toy.branching_tree_law(p, V, [2, 1, 1], WOR), STOP, "node"),
    ),
    "spectr_k2_l3_stop": (
        lambda p, g: draft_spectr(toy.TableProposal(p), 0, 2, 3, g, stop_below=STOP),
        lambda p: toy.confidence_cut(toy.branching_tree_law(p, V, [2, 1, 1], IID), STOP, "node"),
    ),
    "rsd_s_w2_l3_stop": (
        lambda p, g: draft_sbs(toy.TableProposal(p), 0, 2, 3, g, stop_below=STOP),
        lambda p: toy.confidence_cut(toy.sbs_tree_law(p, V, 2, 3), STOP, "level"),
    ),
}


@pytest.mark.parametrize("name", DRAFTERS)
def test_drafted_trees_follow_the_enumerated_law(name):
    sample_tree, tree_law = DRAFTERS[name]
    draft = toy.random_table(21, V)
    law = {}
    for t, p in tree_law(draft):  # several full trees can share a cut
        law[_key(t)] = law.get(_key(t), 0.0) + p
    n, counts = 6000, {}
    for i in range(n):  # trial i draws at root position i: fresh counters, as successive steps are
        k = _key(sample_tree(draft, StepRandom(0, Stream.DRAFT, i)))
        counts[k] = counts.get(k, 0) + 1
    assert toy.chi_square_pvalue(counts, law, n) > P_MIN


PIPELINES = {  # drafter, rule, depth
    "rsd_c_2x2": (lambda p, g: draft_tree(toy.TableProposal(p), 0, [2, 2], WOR, g), "rrs", 2),
    "rsd_s_w3_l2": (lambda p, g: draft_sbs(toy.TableProposal(p), 0, 3, 2, g), "rrs", 2),
    "specinfer_2x2": (lambda p, g: draft_tree(toy.TableProposal(p), 0, [2, 2], IID, g), "rrs_with_replacement", 2),
    "spectr_k3_l2": (lambda p, g: draft_spectr(toy.TableProposal(p), 0, 3, 2, g), "kseq", 2),
    # the whole-path rules (rsd.traversal) through verify's own draws
    "rsd_c_2x2_traversal": (lambda p, g: draft_tree(toy.TableProposal(p), 0, [2, 2], WOR, g), "traversal", 2),
    "rsd_s_w3_l2_traversal": (lambda p, g: draft_sbs(toy.TableProposal(p), 0, 3, 2, g), "traversal", 2),
    "specinfer_2x2_traversal": (
        lambda p, g: draft_tree(toy.TableProposal(p), 0, [2, 2], IID, g),
        "traversal_with_replacement",
        2,
    ),
    "sd_3_block": (lambda p, g: draft_tree(toy.TableProposal(p), 0, [1, 1, 1], WOR, g), "block", 3),
}


def _emitted_counts(drafter, rule, depth, draft, target, n, seed):
    g, counts = torch.Generator().manual_seed(seed), {}  # g: the test's own finishing draws
    for i in range(n):
        tree = drafter(draft, StepRandom(seed, Stream.DRAFT, i))
        rng = StepRandom(seed, Stream.VERIFY, i)
        tokens = tuple(verify(tree, toy.target_probs_for(tree, target), RULES[rule], rng).token_ids)
        while len(tokens) < depth + 1:  # finish with plain target sampling, as the exact test does
            tokens += (int(torch.multinomial(target(tokens), 1, generator=g)),)
        counts[tokens[: depth + 1]] = counts.get(tokens[: depth + 1], 0) + 1
    return counts


@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_output_follows_target(name):
    drafter, rule, depth = PIPELINES[name]
    draft, target = toy.random_table(31, V), toy.random_table(32, V)
    n = 6000
    counts = _emitted_counts(drafter, rule, depth, draft, target, n, seed=1)
    assert toy.chi_square_pvalue(counts, toy.extend((), target, depth + 1), n) > P_MIN


def test_pipeline_negative_control_wrong_rule_is_detected():
    drafter, _, depth = PIPELINES["rsd_c_2x2"]
    draft, target = toy.random_table(31, V), toy.random_table(32, V)
    n = 6000
    counts = _emitted_counts(drafter, "rrs_with_replacement", depth, draft, target, n, seed=1)
    assert toy.chi_square_pvalue(counts, toy.extend((), target, depth + 1), n) < 1e-8


# ---- logit_bias: one transform of both laws keeps the output exact, for the biased target law ----------

BIAS = SamplingParams(0.8, top_k=3, logit_bias=((1, 1.5), (2, -100.0)))  # V = 4: favour 1, ban 2


def _logit_table(seed):
    table = toy.random_table(seed, V)
    return lambda prefix: torch.log(table(prefix))  # [V] float64 logits


def _law_table(logits, law):
    return cache(lambda prefix: law(logits(prefix)[None])[0])


def test_logit_bias_on_both_laws_gives_the_biased_target_law():
    """Drafted with the drafter's law (proposal_probs, its top-k fast path) and verified with the target's
    (logits_to_probs), both biased: the exact law of a step and the emitted counts are the biased target's;
    biasing the draft alone (the target unbiased) gives the plain target's law, which the bias moved."""
    draft = _law_table(_logit_table(41), lambda x: proposal_probs(x, BIAS))
    target_logits = _logit_table(42)
    target = _law_table(target_logits, lambda x: logits_to_probs(x, BIAS))
    plain = _law_table(target_logits, lambda x: logits_to_probs(x, SamplingParams(0.8, top_k=3)))
    depth, rule = 2, RULES["rrs"]
    trees = toy.branching_tree_law(draft, V, [2, 2], WOR)
    want = toy.extend((), target, depth + 1)
    assert toy.max_abs_diff(toy.speculative_law(trees, target, rule, depth + 1), want) < 1e-9
    assert all(2 not in seq for seq, p in want.items() if p > 1e-30)  # -100: banned
    drafter, _, _ = PIPELINES["rsd_c_2x2"]
    n = 6000
    counts = _emitted_counts(drafter, "rrs", depth, draft, target, n, seed=3)
    assert toy.chi_square_pvalue(counts, want, n) > P_MIN
    unbiased_target = _emitted_counts(drafter, "rrs", depth, draft, plain, n, seed=3)
    assert toy.chi_square_pvalue(unbiased_target, want, n) < 1e-8  # negative control

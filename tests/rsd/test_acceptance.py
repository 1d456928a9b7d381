"""Exactness by enumeration: one speculative step followed by target sampling has exactly the
target's law, for every drafting strategy with its acceptance rule, on tiny vocabularies.

Each case enumerates every tree the strategy can draft (with its probability), the exact law of
what the rule emits on it (rsd.acceptance.step_law, built from the same node laws the sampler
uses), and compares the law of the first L+1 tokens with the target's, to 1e-9 in float64.
"""

import pytest
import torch
from torch import Tensor

from rsd.acceptance import RULES, accepted_length_law, rrs, step_law, verify
from rsd.drafting import DraftMode
from rsd.random import StepRandom, Stream
from tests.fixtures import toy

WOR, IID, GREEDY = DraftMode.WITHOUT_REPLACEMENT, DraftMode.IID, DraftMode.GREEDY

V = 4
TOL = 1e-9
RNG = StepRandom(0, Stream.VERIFY, 0)

# (draft table, target table) pairs covering the corner cases the proof must survive.
CASES = {
    "random": lambda: (toy.random_table(1, V), toy.random_table(2, V)),
    "draft_support_below_branching": lambda: (toy.random_table(3, V, support=1), toy.random_table(4, V)),
    "zero_prob_tokens": lambda: (toy.random_table(5, V, zeros=(0,)), toy.random_table(6, V, zeros=(1, 2))),
    "identical": lambda: (toy.random_table(7, V), toy.random_table(7, V)),
    "disjoint_supports": lambda: (toy.random_table(8, V, zeros=(0, 1)), toy.random_table(9, V, zeros=(2, 3))),
    "top_k_top_p_both_sides": lambda: (
        toy.transformed(toy.random_table(10, V), top_k=3, top_p=0.8),
        toy.transformed(toy.random_table(11, V), top_k=3, top_p=0.8),
    ),
}

# method -> (tree law builder, rule, depth)
METHODS = {
    "sd_chain3": (lambda p: toy.branching_tree_law(p, V, [1, 1, 1], WOR), "rrs", 3),
    "rsd_c_2x2": (lambda p: toy.branching_tree_law(p, V, [2, 2], WOR), "rrs", 2),
    "rsd_c_3x1": (lambda p: toy.branching_tree_law(p, V, [3, 1], WOR), "rrs", 2),
    "rsd_c_k_above_vocab": (lambda p: toy.branching_tree_law(p, V, [5], WOR), "rrs", 1),
    "rsd_s_w2_l2": (lambda p: toy.sbs_tree_law(p, V, 2, 2), "rrs", 2),
    "rsd_s_w3_l2": (lambda p: toy.sbs_tree_law(p, V, 3, 2), "rrs", 2),
    "specinfer_2x2": (lambda p: toy.branching_tree_law(p, V, [2, 2], IID), "rrs_with_replacement", 2),
    "spectr_k3_l2": (lambda p: toy.branching_tree_law(p, V, [3, 1], IID), "kseq", 2),
    "spectr_k2_l2": (lambda p: toy.branching_tree_law(p, V, [2, 1], IID), "kseq", 2),
}
# The confidence stop (rsd.drafting): the same strategies' trees, cut where the draft was unsure.
STOP = 0.3
STOP_CASES = {  # name -> (untruncated tree law, cut per "node" or "level", rule, depth)
    "sd_chain3_stop": (lambda p: toy.branching_tree_law(p, V, [1, 1, 1], WOR), "node", "rrs", 3),
    "rsd_c_2x2_stop": (lambda p: toy.branching_tree_law(p, V, [2, 2], WOR), "node", "rrs", 2),
    "rsd_c_2x1x1_stop": (lambda p: toy.branching_tree_law(p, V, [2, 1, 1], WOR), "node", "rrs", 3),
    "rsd_s_w2_l2_stop": (lambda p: toy.sbs_tree_law(p, V, 2, 2), "level", "rrs", 2),
    "specinfer_2x2_stop": (lambda p: toy.branching_tree_law(p, V, [2, 2], IID), "node", "rrs_with_replacement", 2),
    "spectr_k2_l3_stop": (lambda p: toy.branching_tree_law(p, V, [2, 1, 1], IID), "node", "kseq", 3),
}
for _name, (_law, _per, _rule, _depth) in STOP_CASES.items():
    METHODS[_name] = (lambda p, law=_law, per=_per: toy.confidence_cut(law(p), STOP, per), _rule, _depth)


def law_gap(method: str, draft, target, rule: str | None = None) -> float:
    build, default_rule, depth = METHODS[method]
    trees = build(draft)
    assert abs(sum(p for _, p in trees) - 1) < TOL, "the tree law must be a distribution"
    law = toy.speculative_law(trees, target, RULES[rule or default_rule], depth + 1)
    return toy.max_abs_diff(law, toy.extend((), target, depth + 1))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_step_law_equals_target_law(method, case):
    draft, target = CASES[case]()
    assert law_gap(method, draft, target) < TOL


@pytest.mark.parametrize("shape", [[1, 1], [2, 2], [3, 1]])
def test_greedy_rule_emits_target_greedy_path(shape):
    """At temperature 0 the target law is one-hot: any tree + greedy matching emits its argmax path."""
    draft = toy.random_table(12, V)
    target = toy.greedy_table(toy.random_table(13, V))
    trees = toy.branching_tree_law(draft, V, shape, GREEDY)
    law = toy.speculative_law(trees, target, RULES["greedy"], len(shape) + 1)
    assert toy.max_abs_diff(law, toy.extend((), target, len(shape) + 1)) < TOL


def test_greedy_rule_accepts_matching_draft():
    draft, target = toy.random_table(14, V), toy.greedy_table(toy.random_table(14, V))
    trees = toy.branching_tree_law(draft, V, [1, 1], GREEDY)
    ((tree, _),) = trees
    emitted = toy.step_law(tree, toy.target_probs_for(tree, target), RULES["greedy"])
    assert list(emitted.values()) == [1.0] and len(next(iter(emitted))) == 3  # 2 accepted + bonus


# ---- negative controls: the same enumeration must catch a wrong rule --------------------------


def test_negative_control_with_replacement_rule_on_without_replacement_drafts():
    draft, target = CASES["random"]()
    assert law_gap("rsd_c_2x2", draft, target, rule="rrs_with_replacement") > 1e-3


def test_negative_control_siblings_out_of_sampling_order():
    draft, target = CASES["random"]()
    trees = [(children_sorted_by_token(tree), p) for tree, p in toy.branching_tree_law(draft, V, [3, 1], WOR)]
    law = toy.speculative_law(trees, target, RULES["rrs"], 3)
    assert toy.max_abs_diff(law, toy.extend((), target, 3)) > 1e-3


def children_sorted_by_token(tree):
    """The same tree with every node's children re-sorted by token id (rebuilt in BFS order)."""
    old_order, parents, new_index = [0], [-1], {0: 0}
    for node in old_order:
        for child in sorted(tree.children(node), key=lambda c: int(tree.token_ids[c])):
            new_index[child] = len(old_order)
            old_order.append(child)
            parents.append(new_index[node])
    idx = torch.tensor(old_order)
    return toy.DraftTree(tree.token_ids[idx], torch.tensor(parents), tree.draft_probs[idx])


@pytest.mark.parametrize("method", STOP_CASES)
def test_confidence_stop_cases_cut_trees(method):
    """The stop cases are not vacuous: on the random case the cut removes nodes from some trees."""
    law, per, _, _ = STOP_CASES[method]
    draft, _ = CASES["random"]()
    trees = law(draft)
    cut = toy.confidence_cut(trees, STOP, per)
    sizes = [(t.token_ids.numel(), c.token_ids.numel()) for (t, _), (c, _) in zip(trees, cut, strict=True)]
    assert all(c <= n for n, c in sizes) and any(c < n for n, c in sizes)


def test_confidence_stop_rsd_s_three_levels():
    """RSD-S's level stop at both inner levels (W=2, L=3: ~20 s per case, so one case here)."""
    draft, target = CASES["random"]()
    trees = toy.sbs_tree_law(draft, V, 2, 3)
    cut = toy.confidence_cut(trees, STOP, "level")
    depths = {len(t.token_ids) for t, _ in cut}
    assert len(depths) > 1  # the stop fired at some level in some trees
    law = toy.speculative_law(cut, target, RULES["rrs"], 4)
    assert toy.max_abs_diff(law, toy.extend((), target, 4)) < TOL


def unsure_nodes_dropped(trees, tau):
    """The wrong way to stop: remove a node the draft was unsure of (and its subtree) instead of
    only not expanding it. Which siblings survive then depends on their identity."""
    out = []
    for tree, prob in trees:
        tokens, parents = tree.token_ids.tolist(), tree.parent_idx.tolist()
        kept = [0]
        for n in range(1, len(tokens)):
            if parents[n] in kept and float(tree.draft_probs[parents[n], tokens[n]]) >= tau:
                kept.append(n)
        index = {n: i for i, n in enumerate(kept)}
        has_children = {parents[n] for n in kept[1:]}
        draft = torch.stack([tree.draft_probs[n] * (n in has_children) for n in kept])
        parent_idx = torch.tensor([-1] + [index[parents[n]] for n in kept[1:]])
        out.append((toy.DraftTree(tree.token_ids[kept], parent_idx, draft), prob))
    return out


def test_negative_control_stop_that_drops_unsure_siblings():
    draft, target = CASES["random"]()
    trees = unsure_nodes_dropped(toy.branching_tree_law(draft, V, [2, 2], WOR), STOP)
    law = toy.speculative_law(trees, target, RULES["rrs"], 3)
    assert toy.max_abs_diff(law, toy.extend((), target, 3)) > 1e-3


# ---- the worked example of rsd.acceptance, and the assumptions the walk checks ------------------

WORKED_Q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
WORKED_P = torch.tensor([0.15, 0.50, 0.20, 0.15], dtype=torch.float64)


def _one_level_tree(p: Tensor, child_ids: list[int]) -> toy.DraftTree:
    """Root (token 0) with children child_ids drawn from p; leaves carry no law."""
    n = 1 + len(child_ids)
    draft_probs = torch.zeros(n, V, dtype=torch.float64)  # [N, V]
    draft_probs[0] = p
    return toy.DraftTree(torch.tensor([0, *child_ids]), torch.tensor([-1] + [0] * len(child_ids)), draft_probs)


def test_worked_rrs_example_numbers():
    accept_probs, residual = rrs(WORKED_Q, WORKED_P, torch.tensor([1, 2]))
    assert accept_probs == pytest.approx([0.5, 0.5], abs=TOL)
    assert torch.allclose(residual, torch.tensor([0.5, 0.0, 0.0, 0.5], dtype=torch.float64), atol=TOL)
    tree = _one_level_tree(WORKED_P, [1, 2])
    target_probs = torch.stack([WORKED_Q] + [torch.tensor([0.0, 0, 0, 1], dtype=torch.float64)] * 2)  # bonus: 3
    law = step_law(tree, target_probs, RULES["rrs"])
    assert law == pytest.approx({(1, 3): 0.5, (2, 3): 0.25, (0,): 0.125, (3,): 0.125}, abs=TOL)


@pytest.mark.parametrize("rule", ["rrs", "rrs_with_replacement", "kseq"])
@pytest.mark.parametrize("q_of_child", [0.5, 0.0])  # q/0, and 0/0 (min(1, nan) is 1 in Python)
def test_child_outside_its_draft_law_raises(rule, q_of_child):
    p = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)  # token 2 cannot be drawn
    q = torch.tensor([0.5 - q_of_child / 2, 0.5 - q_of_child / 2, q_of_child, 0.0], dtype=torch.float64)
    tree = _one_level_tree(p, [1, 2])
    target_probs = q.expand(3, -1).clone()  # [N, V]
    with pytest.raises(ValueError, match=r"node 2 \(token 2\) has probability 0 under the draft law p at node 0"):
        verify(tree, target_probs, RULES[rule], RNG)
    with pytest.raises(ValueError, match="node 2"):
        step_law(tree, target_probs, RULES[rule])


def test_greedy_rule_does_not_read_the_draft_law():
    tree = _one_level_tree(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), [2])
    target_probs = torch.tensor([[0.0, 0, 1, 0]] * 2, dtype=torch.float64)
    assert verify(tree, target_probs, RULES["greedy"], RNG).accepted_ids == [2]


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("target_root", "target law q at node 0"),
        ("target_leaf", "target law q at node 1"),  # the bonus token's law
        ("draft_root", "draft law p at node 0"),
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_laws_raise(where, message, bad):
    p = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    tree = _one_level_tree(p, [1])
    target_probs = torch.tensor([[0.0, 1, 0, 0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)  # x = 1 accepted
    if where == "draft_root":
        tree.draft_probs[0, 3] = bad
    else:
        target_probs[0 if where == "target_root" else 1, 3] = bad
    with pytest.raises(ValueError, match=message):
        verify(tree, target_probs, RULES["rrs"], RNG)
    with pytest.raises(ValueError, match=message):
        step_law(tree, target_probs, RULES["rrs"])


def test_verify_needs_its_draws_matching_shapes_and_one_device():
    tree = _one_level_tree(WORKED_P, [1])
    target_probs = WORKED_Q.expand(2, -1).clone()
    with pytest.raises(ValueError, match="needs the step's random stream"):
        verify(tree, target_probs, RULES["rrs"], None)
    assert verify(tree, target_probs.new_tensor([[0.0, 1, 0, 0]] * 2), RULES["greedy"], None).token_ids == [1, 1]
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        verify(tree, target_probs[:, :3], RULES["rrs"], RNG)
    with pytest.raises(ValueError, match="one device"):  # meta: a second device on a CPU-only machine
        verify(tree, target_probs.to("meta"), RULES["rrs"], RNG)


# ---- the accepted length's law, scalable: the same as step_law's -------------------------------


def _exact_rules(method: str) -> list[str]:
    """Every rule exact on `method`'s trees (rsd.methods pairs them): its own, the traversal variant for its
    siblings, block verification on chains."""
    iid = method.startswith(("specinfer", "spectr"))
    return [METHODS[method][1], "traversal_with_replacement" if iid else "traversal"] + (
        ["block"] if method.startswith("sd_chain") else []
    )


MAX_TREES = 48  # per family and case, spread over its enumeration (i.i.d. families hold hundreds of trees)


@pytest.mark.parametrize("case", ["random", "zero_prob_tokens", "draft_support_below_branching"])
@pytest.mark.parametrize("method", [m for m in METHODS if m != "rsd_s_w3_l2"])  # w3: ~10 s, nothing new here
def test_accepted_length_law_is_step_laws_emitted_length(method, case):
    """accepted_length_law (vector ops, any V) against step_law's enumeration of emitted sequences: on the
    method's trees and every rule exact on them, P(accepted = d) agrees to 1e-9 and sums to 1."""
    draft, target = CASES[case]()
    trees = METHODS[method][0](draft)
    for tree, _ in trees[:: -(-len(trees) // MAX_TREES)]:
        target_probs = toy.target_probs_for(tree, target)
        for rule in _exact_rules(method):
            got = accepted_length_law(tree, target_probs, RULES[rule])
            want = [0.0] * len(got)
            for emitted, p in step_law(tree, target_probs, RULES[rule]).items():
                want[len(emitted) - 1] += p
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL, (rule, tree)
            assert abs(sum(got) - 1) < TOL


@pytest.mark.parametrize("shape", [[1, 1], [2, 2], [3, 1]])
def test_accepted_length_law_greedy(shape):
    """Greedy matching on greedy trees: one length, with probability 1, as step_law says."""
    draft, target = toy.random_table(12, V), toy.greedy_table(toy.random_table(13, V))
    for tree, _ in toy.branching_tree_law(draft, V, shape, GREEDY):
        target_probs = toy.target_probs_for(tree, target)
        ((emitted, p),) = step_law(tree, target_probs, RULES["greedy"]).items()
        got = accepted_length_law(tree, target_probs, RULES["greedy"])
        assert got[len(emitted) - 1] == p == 1.0 and sum(got) == 1.0


def test_accepted_length_law_no_rule_wins_on_every_tree():
    """docs/algorithm.md's chain: q/p = 0.5 at both drafts and no residual mass at the first draft's node. RRS
    accepts 0.75 drafts on average, block verification (optimal over the chain's law) 0.5 on this tree."""
    p = torch.tensor([[0.6, 0.2, 0.2], [0.2, 0.6, 0.2], [1 / 3] * 3], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.35, 0.35], [0.35, 0.3, 0.35], [1 / 3] * 3], dtype=torch.float64)
    chain = toy.DraftTree(torch.tensor([2, 0, 1]), torch.tensor([-1, 0, 1]), p)
    assert accepted_length_law(chain, q, RULES["rrs"]) == pytest.approx([0.5, 0.25, 0.25], abs=TOL)
    for rule in ("block", "traversal"):
        assert accepted_length_law(chain, q, RULES[rule]) == pytest.approx([0.75, 0.0, 0.25], abs=TOL)

"""Traversal Verification and block verification (rsd.traversal) proved exact the way RRS is
(tests/rsd/test_acceptance.py): every tree a strategy can draft, with its probability, times the exact
law of what the rule emits on it, against the target's law of the first L+1 tokens, to 1e-9.

Each variant is proved on the tree families rsd.methods pairs it with, and each has negative controls
the same enumeration catches: the other variant's sibling law, siblings out of sampling order, and the
next token drawn from q where the rule's residual belongs.
"""

from functools import partial

import pytest
import torch

from rsd.acceptance import RULES, Rule, step_law
from rsd.methods import METHOD_NAMES, Method
from rsd.traversal import block_tests, traversal_tests
from tests.fixtures import toy
from tests.rsd.test_acceptance import CASES, METHODS, TOL, V, children_sorted_by_token, law_gap


def tempered(table, temperature: float):
    """The table's laws at another temperature: p^(1/T), renormalised (zeros stay zeros)."""

    def law(prefix):
        probs = table(prefix) ** (1 / temperature)
        return probs / probs.sum()

    return law


LAWS = {  # the corner cases of test_acceptance.py, and two temperatures on both sides
    **CASES,
    "T=0.5": lambda: (tempered(toy.random_table(41, V), 0.5), tempered(toy.random_table(42, V), 0.5)),
    "T=2": lambda: (tempered(toy.random_table(43, V), 2.0), tempered(toy.random_table(44, V, zeros=(3,)), 2.0)),
}
IID_TREES = {m for m in METHODS if m.startswith(("specinfer", "spectr"))}  # siblings drawn i.i.d.
SLOW = {"rsd_s_w3_l2"}  # ~10 s a case: proved on two cases below


def traversal_for(method: str) -> str:
    return "traversal_with_replacement" if method in IID_TREES else "traversal"


@pytest.mark.parametrize("case", LAWS)
@pytest.mark.parametrize("method", [m for m in METHODS if m not in SLOW])
def test_traversal_is_exact_on_every_tree_family(method, case):
    draft, target = LAWS[case]()
    assert law_gap(method, draft, target, rule=traversal_for(method)) < TOL


@pytest.mark.parametrize("case", ["random", "zero_prob_tokens"])
def test_traversal_is_exact_on_wider_and_deeper_beam_search_trees(case):
    draft, target = LAWS[case]()
    assert law_gap("rsd_s_w3_l2", draft, target, rule="traversal") < TOL
    if case == "zero_prob_tokens":  # W = 2, L = 3: three levels of beam competition (~4 s)
        law = toy.speculative_law(toy.sbs_tree_law(draft, V, 2, 3), target, RULES["traversal"], 4)
        assert toy.max_abs_diff(law, toy.extend((), target, 4)) < TOL


CHAINS = {"sd_chain3": [1, 1, 1], "sd_chain1": [1]}


@pytest.mark.parametrize("case", LAWS)
@pytest.mark.parametrize("method", ["sd_chain3", "sd_chain3_stop"])
def test_block_verification_is_exact_on_chains(method, case):
    draft, target = LAWS[case]()
    assert law_gap(method, draft, target, rule="block") < TOL


@pytest.mark.parametrize("case", ["random", "zero_prob_tokens", "T=0.5"])
def test_block_verification_is_traversal_on_a_chain(case):
    """Sun et al.'s h_i and the traversal's updated alpha are one rule on a chain: the same tests."""
    draft, target = LAWS[case]()
    for tree, _ in toy.branching_tree_law(draft, V, [1, 1, 1], toy.DraftMode.WITHOUT_REPLACEMENT)[:20]:
        target_probs = toy.target_probs_for(tree, target)
        laws = _plain_laws(tree, target_probs)
        block, traversal = list(block_tests(tree, laws)), list(traversal_tests(tree, laws))
        assert [(n, pytest.approx(a, abs=TOL)) for n, a, _ in block] == [(n, a) for n, a, _ in traversal]
        for (_, _, law_b), (_, _, law_t) in zip(block, traversal, strict=True):
            assert torch.allclose(law_b, law_t, atol=TOL)


@pytest.mark.parametrize("case", ["random", "zero_prob_tokens", "disjoint_supports"])
@pytest.mark.parametrize(
    ("variant", "token_rule", "mode"),
    [("traversal", "rrs", "WOR"), ("traversal_with_replacement", "rrs_with_replacement", "IID")],
)
def test_one_level_traversal_is_recursive_rejection(case, variant, token_rule, mode):
    draft, target = LAWS[case]()
    draft_mode = toy.DraftMode.WITHOUT_REPLACEMENT if mode == "WOR" else toy.DraftMode.IID
    for tree, _ in toy.branching_tree_law(draft, V, [3], draft_mode):
        target_probs = toy.target_probs_for(tree, target)
        same = step_law(tree, target_probs, RULES[variant]), step_law(tree, target_probs, RULES[token_rule])
        assert toy.max_abs_diff(*same) < TOL


def test_traversal_accepts_at_least_as_much_as_rrs_on_chains():
    """Optimal for chains (Weng et al.; Sun et al.): never below token-level RRS, and above it here."""
    gains = []
    for case in ("random", "T=0.5", "T=2"):
        draft, target = LAWS[case]()
        lengths = {}
        for rule in ("rrs", "traversal"):
            trees = toy.branching_tree_law(draft, V, [1, 1, 1], toy.DraftMode.WITHOUT_REPLACEMENT)
            lengths[rule] = sum(
                p * sum(m * (len(e) - 1) for e, m in step_law(t, toy.target_probs_for(t, target), RULES[rule]).items())
                for t, p in trees
            )
        gains.append(lengths["traversal"] - lengths["rrs"])
    assert min(gains) > -TOL and max(gains) > 1e-3


# ---- negative controls: the same enumeration must catch a wrong rule --------------------------


def test_negative_control_kept_draft_law_on_without_replacement_siblings():
    draft, target = LAWS["random"]()
    assert law_gap("rsd_c_2x2", draft, target, rule="traversal_with_replacement") > 1e-3


def test_negative_control_siblings_out_of_sampling_order():
    draft, target = LAWS["random"]()
    trees = toy.branching_tree_law(draft, V, [3, 1], toy.DraftMode.WITHOUT_REPLACEMENT)
    trees = [(children_sorted_by_token(tree), p) for tree, p in trees]
    law = toy.speculative_law(trees, target, RULES["traversal"], 3)
    assert toy.max_abs_diff(law, toy.extend((), target, 3)) > 1e-3


def _next_token_from_q(tests):
    """The bug of drawing the token after an accepted inner node from q, not from the node's residual."""

    def wrong(tree, laws):
        for node, a, law in tests(tree, laws):
            yield node, a, (laws(node)[0] if (tree.parent_idx == node).any() else law)

    return wrong


@pytest.mark.parametrize(
    ("method", "tests"),
    [
        ("rsd_c_2x2", traversal_tests),
        ("specinfer_2x2", partial(traversal_tests, without_replacement=False)),
        ("sd_chain3", block_tests),
    ],
)
def test_negative_control_next_token_from_q_instead_of_the_residual(method, tests):
    draft, target = LAWS["random"]()
    build, _, depth = METHODS[method]
    wrong = Rule("wrong", None, tests=_next_token_from_q(tests))
    law = toy.speculative_law(build(draft), target, wrong, depth + 1)
    assert toy.max_abs_diff(law, toy.extend((), target, depth + 1)) > 1e-3


# ---- refusals ----------------------------------------------------------------------------------


def _plain_laws(tree, target_probs):
    return lambda n: (target_probs[n].to(torch.float64), tree.draft_probs[n].to(torch.float64))


def test_block_verification_refuses_a_tree():
    draft, target = LAWS["random"]()
    tree, _ = toy.branching_tree_law(draft, V, [2, 1], toy.DraftMode.WITHOUT_REPLACEMENT)[0]
    with pytest.raises(ValueError, match="needs a chain"):
        step_law(tree, toy.target_probs_for(tree, target), RULES["block"])


def test_traversal_without_replacement_refuses_repeated_siblings():
    draft, target = LAWS["random"]()
    trees = toy.branching_tree_law(draft, V, [2], toy.DraftMode.IID)
    tree = next(t for t, _ in trees if int(t.token_ids[1]) == int(t.token_ids[2]))
    with pytest.raises(ValueError, match="must be distinct"):
        step_law(tree, toy.target_probs_for(tree, target), RULES["traversal"])


def test_methods_pair_each_verification_with_its_exact_variant():
    assert Method.parse("rsd_c", "2,2,1").rule(False).name == "rrs"  # today's callers: unchanged
    assert Method.parse("spectr", "3x4").rule(False, "token").name == "kseq"
    expected = {"sd": "traversal", "specinfer": "traversal_with_replacement", "spectr": "traversal_with_replacement"}
    for name in METHOD_NAMES:
        method = Method.parse(name, {"sd": "4", "auto": "4", "spectr": "3x4", "rsd_s": "3x4"}.get(name, "2,2,1"))
        assert method.rule(False, "traversal").name == expected.get(name, "traversal")
        assert method.rule(True, "traversal").name == "greedy"
    for name, chain in [("sd", "4"), ("rsd_c", "1,1,1"), ("specinfer", "1,1"), ("spectr", "1x3"), ("rsd_s", "1x3")]:
        assert Method.parse(name, chain).rule(False, "block").name == "block"
    with pytest.raises(ValueError, match="one chain only"):
        Method.parse("rsd_c", "2,2,1").rule(False, "block")
    with pytest.raises(ValueError, match="unknown verification 'oracle'"):
        Method.parse("sd", "4").rule(False, "oracle")


@pytest.mark.parametrize("tests", [traversal_tests, block_tests])
def test_the_root_is_tested_last_with_probability_exactly_one(tests):
    """verify draws no uniform for the root (it has no parent to key one by): its a must be 1.0, not 1 - 1e-16."""
    draft, target = LAWS["T=2"]()
    shape = [2, 2] if tests is traversal_tests else [1, 1, 1]
    for tree, _ in toy.branching_tree_law(draft, V, shape, toy.DraftMode.WITHOUT_REPLACEMENT):
        *_, (node, a, _) = tests(tree, _plain_laws(tree, toy.target_probs_for(tree, target)))
        assert (node, a) == (0, 1.0)

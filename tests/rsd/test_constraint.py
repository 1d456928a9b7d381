"""Structured output (rsd.constraint) proved exact by enumeration: with a hand-made token automaton on V = 4,
one speculative step (every tree each method can draft from the masked draft law, each node's target law
masked by the state after its path) followed by constrained target sampling has exactly the masked target
law, for every method and verification rule, to 1e-9. The negative control masks every node with the
root's state and is caught.
"""

import pytest
import torch

from rsd.acceptance import RULES, step_law
from rsd.constraint import ConstraintError, Guide, mask_logits, node_states, state_masks
from rsd.sampling import SamplingParams, logits_to_probs
from tests.fixtures import toy
from tests.rsd.test_acceptance import METHODS, TOL, V
from tests.rsd.test_traversal import SLOW, traversal_for

EOS = 3


# state -> {token: next state}; the tokens of a state are the ones allowed there. Allowed sets of sizes 3,
# 2, 4 and 1 (EOS forced in the accepting state 3).
TABLE = {0: {0: 1, 1: 2, 2: 0}, 1: {1: 2, EOS: 3}, 2: {0: 0, 1: 1, 2: 2, EOS: 3}, 3: {EOS: 3}}


class TableAutomaton:
    initial_state = 0

    def allowed(self, state):
        mask = torch.zeros(V, dtype=torch.bool)
        mask[list(TABLE[state])] = True
        return mask

    def next_state(self, state, token):
        return TABLE[state].get(token)


AUTOMATON = TableAutomaton()


def state_after(prefix) -> int:
    state = AUTOMATON.initial_state
    for token in prefix:
        state = None if state is None else AUTOMATON.next_state(state, token)
    return state


def masked(probs, mask):
    """The runtime's path: forbidden logits to -inf, then the sampling transform (T = 1)."""
    return logits_to_probs(mask_logits(torch.log(probs), mask), SamplingParams(1.0))


def constrained(table):
    """A toy table under the constraint: the law after prefix, masked by the state after prefix (a prefix
    the constraint forbids has probability 0; the toy enumerations may still ask for its law)."""

    def law(prefix):
        state = state_after(prefix)
        return table(prefix) if state is None else masked(table(prefix), AUTOMATON.allowed(state))

    return law


def constrained_law_gap(method, draft, target, rule=None, per_node=True) -> float:
    """Like test_acceptance.law_gap, with the draft masked while drafting and each tree's target laws
    masked per node (rsd.constraint.node_states); per_node=False: every node gets the root's mask."""
    build, default_rule, depth = METHODS[method]
    law = {}
    for tree, p_tree in build(constrained(draft)):
        states = node_states(AUTOMATON, AUTOMATON.initial_state, tree.token_ids, tree.parent_idx)
        masks = state_masks(AUTOMATON, states if per_node else [states[0]] * len(states), V)  # [N, V]
        target_probs = masked(toy.target_probs_for(tree, target), masks)  # [N, V]
        for emitted, p in step_law(tree, target_probs, RULES[rule or default_rule]).items():
            for seq, p_rest in toy.extend(emitted, constrained(target), depth + 1).items():
                law[seq] = law.get(seq, 0.0) + p_tree * p * p_rest
    return toy.max_abs_diff(law, toy.extend((), constrained(target), depth + 1))


CASES = {
    "random": lambda: (toy.random_table(21, V), toy.random_table(22, V)),
    "identical": lambda: (toy.random_table(23, V), toy.random_table(23, V)),
}
FAST = [m for m in METHODS if m not in SLOW]
UNCUT = [m for m in FAST if not m.endswith("_stop")]  # the confidence stop is proved with the methods' rules


@pytest.mark.parametrize("method", FAST)
def test_constrained_step_has_the_masked_target_law(method):
    draft, target = CASES["random"]()
    assert constrained_law_gap(method, draft, target) < TOL


@pytest.mark.parametrize("method", ["sd_chain3", "rsd_c_2x2", "rsd_s_w2_l2", "spectr_k2_l2"])
def test_constrained_step_is_exact_when_draft_and_target_agree(method):
    draft, target = CASES["identical"]()
    assert constrained_law_gap(method, draft, target) < TOL


@pytest.mark.parametrize("method", UNCUT)
def test_constrained_traversal_is_exact(method):
    draft, target = CASES["random"]()
    assert constrained_law_gap(method, draft, target, rule=traversal_for(method)) < TOL


@pytest.mark.parametrize("method", ["sd_chain3", "sd_chain3_stop"])
def test_constrained_block_verification_is_exact(method):
    draft, target = CASES["random"]()
    assert constrained_law_gap(method, draft, target, rule="block") < TOL


@pytest.mark.parametrize("shape", [[1, 1], [2, 2]])
def test_greedy_is_the_argmax_over_allowed_tokens(shape):
    draft = toy.random_table(24, V)
    target = toy.greedy_table(constrained(toy.random_table(25, V)))
    trees = toy.branching_tree_law(constrained(draft), V, shape, toy.DraftMode.GREEDY)
    law = toy.speculative_law(trees, target, RULES["greedy"], len(shape) + 1)
    assert toy.max_abs_diff(law, toy.extend((), target, len(shape) + 1)) < TOL
    assert all(state_after(seq) is not None for seq in law)  # every output follows the automaton


def test_negative_control_one_mask_for_the_whole_tree():
    draft, target = CASES["random"]()
    assert constrained_law_gap("rsd_c_2x2", draft, target, per_node=False) > 1e-3


def test_guide_advances_over_new_tokens_and_refuses_forbidden_ones():
    guide = Guide(AUTOMATON, start=2)
    assert guide.root_state([9, 9]) == 0  # nothing generated yet
    assert guide.root_state([9, 9, 0, 1]) == 2
    assert guide.root_state([9, 9, 0, 1, EOS]) == 3  # from the remembered state
    assert guide.root_state([9, 9, 1]) == 2  # a different history: recomputed from the start
    with pytest.raises(ConstraintError, match="not allowed"):
        guide.root_state([9, 9, EOS])
    with pytest.raises(ConstraintError, match="tree node 2"):  # state 1 after [0]: 1 may follow, 0 may not
        guide.tree_masks([9, 9, 0], torch.tensor([0, 1, 0]), torch.tensor([-1, 0, 0]), V)
    masks = Guide(AUTOMATON, 0).tree_masks([1], torch.tensor([1, 0, 1]), torch.tensor([-1, 0, 0]), V + 2)
    assert masks.tolist() == [
        [True, True, True, True, False, False],  # state 2: every token, and ids past the automaton forbidden
        [True, True, True, False, False, False],  # after 0: state 0
        [False, True, False, True, False, False],  # after 1: state 1
    ]


def test_a_state_without_allowed_tokens_fails_clearly():
    with pytest.raises(ConstraintError, match="allows no token"):
        mask_logits(torch.zeros(2, V), torch.tensor([[True] * V, [False] * V]))

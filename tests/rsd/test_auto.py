"""The auto method (rsd.auto): its cost model, its decisions, and exactness of every plan it can make.

A context chain grows through a gate that reads each node's law before its child is drawn; the enumeration cuts
every untruncated chain where the gate says stop and proves the rules exact on what is left, as
test_lookup.py does for ungated trees; a statistical test checks draft_tree's gate against that law. A plan chosen
from a first step's outcome keeps the two-step law the target's (the chain rule), as for adaptive shapes.
"""

import pytest
import torch

from rsd.acceptance import RULES, step_law, verify
from rsd.auto import (
    CATCH_UP_TOKENS,
    CONTEXT,
    MODEL,
    PLAIN,
    AutoPolicy,
    Plan,
    RowCosts,
    chain_tops,
    plan_method,
    refuse,
    root_top,
    top_bucket,
)
from rsd.drafting import DraftMode, draft_tree
from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd.tree import DraftTree
from rsd_wire.convert import method_shape
from tests.fixtures import toy

V, TOL = 4, 1e-9
WOR, GREEDY = DraftMode.WITHOUT_REPLACEMENT, DraftMode.GREEDY


def test_row_costs_interpolate_continue_the_last_slope_and_never_fall():
    costs = RowCosts(decay=0.5)
    assert costs(7) == costs.prior_ms  # nothing seen: every size alike
    costs.observe(1, 10.0)
    assert costs(4) == 10.0  # one size seen: flat
    costs.observe(3, 14.0)
    assert costs(2) == pytest.approx(12.0)  # between two sizes: the line
    assert costs(5) == pytest.approx(18.0)  # past the largest: its slope continued
    costs.observe(3, 6.0)  # a noisy cheap reading: the mean moves halfway, and no size costs less than a smaller one
    assert costs.means[3] == pytest.approx(10.0)
    assert costs(3) == pytest.approx(10.0) and costs(2) == pytest.approx(10.0)


def _policy(verify: dict[int, float], overhead=2.0, draft_level=None, depth=4, **kw) -> AutoPolicy:
    policy = AutoPolicy(depth, explore=0.0, **kw)
    for rows, ms in verify.items():
        policy.verify.observe(rows, ms)
    policy.overhead_ms, policy.draft_level_ms = overhead, draft_level
    return policy


def test_plain_where_rows_are_dear_and_acceptance_low():
    policy = _policy({1: 50, 2: 90, 5: 250}, draft_level=30)
    policy.model_counts = [1.0, 9.0]  # a level accepted 1 time in 10
    policy.context_counts = [[1.0, 9.0] for _ in policy.context_counts]
    assert policy.plan(root_top=1.0) == Plan(PLAIN)
    assert policy.plan(root_top=None) == Plan(PLAIN)


def test_a_context_chain_where_its_row_is_cheap_and_it_is_often_right():
    policy = _policy({1: 50, 2: 52, 5: 60}, draft_level=30)
    policy.model_counts = [1.0, 9.0]
    policy.context_counts[top_bucket(1.0)] = [9.0, 1.0]
    assert policy.plan(root_top=1.0) == Plan(CONTEXT, 4)
    assert policy.plan(root_top=None) == Plan(PLAIN)  # nothing repeats at the root: no context chain


def test_the_model_depth_is_the_best_expected_rate():
    policy = _policy({1: 50, 2: 52, 3: 54, 4: 60, 5: 75}, draft_level=6)
    policy.model_counts = [8.0, 2.0]  # p = 0.8 a level
    rates = {d: policy.model_rate(d) for d in range(1, 5)}
    best = max(rates, key=rates.get)
    assert rates[best] > policy.plain_rate()
    assert policy.plan(root_top=None) == Plan(MODEL, best)


def test_the_gate_grows_a_chain_while_each_node_pays_for_its_row():
    # rows 1..3 cost 50, 51, 52 ms and 4 rows 200: the 1st and 2nd nodes pay (a = 0.9), the 3rd does not
    policy = _policy({1: 50, 2: 51, 3: 52, 4: 200}, overhead=0.0)
    policy.context_counts[top_bucket(1.0)] = [9.0, 1.0]
    gate, point = policy.gate(Plan(CONTEXT, 4)), torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    assert [gate(torch.tensor([n]), point) for n in range(4)] == [[True], [True], [False], [False]]
    # a law the context rarely gets right is not worth a row, even a cheap one
    policy.context_counts[top_bucket(0.5)] = [1.0, 99.0]
    gate = policy.gate(Plan(CONTEXT, 4))
    assert gate(torch.tensor([0]), torch.tensor([[0.5, 0.5, 0.0, 0.0]])) == [False]
    with pytest.raises(ValueError, match="chain gate"):
        policy.gate(Plan(PLAIN))


def test_the_model_gate_cuts_a_chain_where_the_draft_is_unsure():
    # verify rows 50, 52, 54, 56, 58 ms and a 10 ms draft forward: a node pays where its child is accepted often,
    # and the draft model's confidence (its law's top) says how often
    policy = _policy({1: 50, 2: 52, 3: 54, 4: 56, 5: 58}, overhead=0.0, draft_level=10)
    policy.model_counts = [6.0, 4.0]  # pooled: 0.6 a level
    policy.model_top_counts[top_bucket(0.9)] = [95.0, 5.0]
    policy.model_top_counts[top_bucket(0.3)] = [5.0, 95.0]
    assert policy.model_acceptance(0.9) == pytest.approx((95 + 1.2) / 102)
    assert policy.model_acceptance(0.6) == pytest.approx(0.6)  # an untried bucket: the pooled acceptance
    sure, unsure = torch.tensor([[0.9, 0.1, 0.0, 0.0]]), torch.tensor([[0.3, 0.3, 0.2, 0.2]])
    gate = policy.gate(Plan(MODEL, 4))
    assert [gate(torch.tensor([n]), law) for n, law in enumerate([sure, sure, unsure])] == [[True], [True], [False]]
    assert policy.gate(Plan(MODEL, 4))(torch.tensor([0]), unsure) == [False]  # the root alone, drafted once
    # the last level's child needs no forward: a node that would not pay with it does without it
    policy = _policy({1: 50, 2: 52}, overhead=0.0, draft_level=100)
    policy.model_top_counts[top_bucket(0.9)] = [60.0, 40.0]
    assert policy.gate(Plan(MODEL, 1))(torch.tensor([0]), sure) == [True]
    assert policy.gate(Plan(MODEL, 2))(torch.tensor([0]), sure) == [False]


def test_a_switch_to_the_model_pays_for_its_catch_up():
    policy = _policy({1: 50, 2: 52, 3: 54}, draft_level=6, depth=2)
    policy.model_counts = [6.0, 4.0]
    assert policy.plan(root_top=None) == Plan(MODEL, 2)
    policy.catch_up_ms = 5.0
    assert policy.switch_ms(3) == 15.0 and policy.switch_ms(100) == 5.0 * CATCH_UP_TOKENS
    assert policy.plan(root_top=None, behind=0) == Plan(MODEL, 2)
    assert policy.plan(root_top=None, behind=8) == Plan(PLAIN)  # 40 ms to catch up: more than a chain saves


def test_observe_learns_costs_and_acceptance_per_plan():
    policy = AutoPolicy(4)
    policy.observe(Plan(CONTEXT, 4), [1.0, 1.0, 0.4], accepted=1, forward_ms=60, round_trip_ms=64, draft_ms=3)
    assert policy.context_counts[top_bucket(1.0)] == [2.0, 2.0]  # node 1 accepted, node 2 rejected
    assert policy.context_counts[top_bucket(0.4)] == [1.0, 1.0]  # node 3 never judged
    assert policy.verify.means == {4: 60} and policy.overhead_ms == 4 and policy.look_up_ms == 1
    policy.observe(Plan(MODEL, 2), [0.9, 0.7], accepted=2, forward_ms=55, round_trip_ms=58, draft_ms=40)
    assert policy.model_counts == [3.0, 1.0] and policy.draft_level_ms == 20  # both levels accepted: no failure
    assert policy.model_top_counts[top_bucket(0.9)] == [1.0, 0.0] and policy.model_top_counts[top_bucket(0.7)] == [1, 0]
    # a chain the gate cut after one node drafted two laws (the root's, the node's): 2 forwards
    policy.observe(Plan(MODEL, 4), [0.9], accepted=0, forward_ms=52, round_trip_ms=54, draft_ms=40)
    assert policy.draft_level_ms == pytest.approx(20) and policy.model_top_counts[top_bucket(0.9)] == [1.0, 1.0]
    # 2 tokens behind: what the forwards cost beyond a level each is the catch-up, per token
    policy.observe(Plan(MODEL, 2), [0.9, 0.9], accepted=1, forward_ms=55, round_trip_ms=58, draft_ms=50, behind=2)
    assert policy.draft_level_ms == pytest.approx(20) and policy.catch_up_ms == pytest.approx(5)
    policy.observe(Plan(PLAIN), [], accepted=0, forward_ms=50, round_trip_ms=52, draft_ms=0.5, rows=6)
    assert policy.verify.means[6] == 50  # another session's tree shared the forward: 3 rows
    with pytest.raises(ValueError, match="outside"):
        policy.observe(Plan(MODEL, 1), [0.9], accepted=2, forward_ms=1, round_trip_ms=1, draft_ms=1)


def test_auto_parses_as_a_depth_and_drafts_only_through_its_plans():
    method = Method.parse("auto", "3")
    assert method.branching == (1, 1, 1) and method.max_draft_tokens == 3 and method_shape(method) == "3"
    assert method.planned and not Method.parse("sd", "3").planned
    assert method.rule(False).name == "rrs" and method.rule(True).name == "greedy"
    assert method.rule(False, "coupled").name == "coupled" and method.rule(False, "block").name == "block"
    for bad in ("2,2", "3@0.4", "0"):
        with pytest.raises(ValueError):
            Method.parse("auto", bad)
    with pytest.raises(ValueError, match="plan"):
        method.draft(toy.TableProposal(toy.random_table(1, V)), 0, StepRandom(0, Stream.DRAFT, 0), False)
    assert plan_method(Plan(MODEL, 2)) == Method.parse("sd", "2")
    assert plan_method(Plan(CONTEXT, 3)) == Method.parse("lookup", "3")
    assert plan_method(Plan(PLAIN)).draft_free


def test_root_top_is_the_context_laws_top_or_none():
    assert root_top([1, 0, 2, 1, 0], V) == 1.0  # "1 0" was followed by 2 once
    assert root_top([1, 0, 2, 3, 1, 0, 3, 2, 1, 0], V) == 0.5  # by 2 and by 3
    assert root_top([1, 2, 3, 0], V) is None


# ---- exactness --------------------------------------------------------------------------------------------


def _gated_policy(grows: set[int]) -> AutoPolicy:
    """A policy whose gates (context and model) grow a node whose law's top falls in a bucket of `grows` and
    stop elsewhere: the chain's cut then depends on the drawn path (through its laws), which is what the
    enumeration must prove harmless."""
    policy = _policy({1: 10, 2: 11, 3: 12, 4: 13}, overhead=0.0, draft_level=0.5, depth=3)
    for b in range(len(policy.context_counts)):
        policy.context_counts[b] = [9.0, 1.0] if b in grows else [1.0, 99.0]
        policy.model_top_counts[b] = [900.0, 100.0] if b in grows else [1.0, 999.0]
    return policy


def _gated_law(trees: list[tuple[DraftTree, float]], policy: AutoPolicy, kind=CONTEXT) -> list[tuple[DraftTree, float]]:
    """Each untruncated chain cut where a fresh gate, asked node by node with its law, stops it."""
    out = []
    for tree, prob in trees:
        gate, n = policy.gate(Plan(kind, policy.max_depth)), 0
        while n < tree.num_nodes - 1 and gate(torch.tensor([n]), tree.draft_probs[n : n + 1])[0]:
            n += 1
        draft = tree.draft_probs[: n + 1].clone()
        draft[n] = 0  # the leaf's law was never drawn from
        out.append((DraftTree(tree.token_ids[: n + 1], tree.parent_idx[: n + 1], draft), prob))
    return out


def _laws():
    """(draft table, the top buckets that grow): the root grows, and the nodes below it on some paths only."""
    return {
        "spread": (toy.random_table(3, V), {top_bucket(0.3)}),  # the root's top is 0.44, its children's 0.39-0.64
        "other": (toy.random_table(5, V), {top_bucket(0.3), top_bucket(0.6)}),  # 0.35; 0.51-0.84
    }


@pytest.mark.parametrize("rule", ["rrs", "traversal", "block"])
@pytest.mark.parametrize("draft", ["spread", "other"])
@pytest.mark.parametrize("target_seed", [1, 2])
@pytest.mark.parametrize("kind", [CONTEXT, MODEL])
def test_a_gated_chain_is_exact_for_every_rule(rule, draft, target_seed, kind):
    table, grows = _laws()[draft]
    trees = _gated_law(toy.branching_tree_law(table, V, [1, 1, 1], WOR), _gated_policy(grows), kind)
    assert len({t.num_nodes for t, _ in trees}) > 1  # the gate does cut some chains and not others
    target = toy.random_table(target_seed, V, zeros=(2,) if target_seed == 2 else ())
    law = toy.speculative_law(trees, target, RULES[rule], 4)
    assert toy.max_abs_diff(law, toy.extend((), target, 4)) < TOL


def test_a_gated_greedy_chain_emits_the_target_greedy_path():
    target = toy.greedy_table(toy.random_table(5, V))
    table, grows = _laws()["spread"]
    trees = _gated_law(toy.branching_tree_law(table, V, [1, 1, 1], GREEDY), _gated_policy(grows))
    law = toy.speculative_law(trees, target, RULES["greedy"], 4)
    assert toy.max_abs_diff(law, toy.extend((), target, 4)) < TOL


def test_draft_tree_with_the_gate_follows_the_enumerated_law():
    (draft, grows), n = _laws()["spread"], 4000
    law = {}
    for t, p in _gated_law(toy.branching_tree_law(draft, V, [1, 1, 1], WOR), _gated_policy(grows)):
        key = tuple(t.token_ids.tolist())
        law[key] = law.get(key, 0.0) + p
    counts: dict[tuple, int] = {}
    for i in range(n):
        rng, gate = StepRandom(7, Stream.DRAFT, i), _gated_policy(grows).gate(Plan(CONTEXT, 3))
        tree = draft_tree(toy.TableProposal(draft), 0, [1, 1, 1], WOR, rng, grow=gate)
        leaf = tree.num_nodes - 1
        assert bool((tree.draft_probs[leaf] == 0).all())  # a refused node carries no law
        key = tuple(tree.token_ids.tolist())
        counts[key] = counts.get(key, 0) + 1
    assert toy.chi_square_pvalue(counts, law, n) > 1e-4


def test_the_plain_gate_drafts_the_root_alone_and_verifies_as_the_target():
    proposal = toy.TableProposal(toy.random_table(1, V))
    tree = draft_tree(proposal, 0, [1], WOR, StepRandom(0, Stream.DRAFT, 0), grow=refuse)
    assert tree.num_nodes == 1 and chain_tops(tree) == []
    target = toy.random_table(2, V)
    law = step_law(tree, toy.target_probs_for(tree, target), RULES["rrs"])
    assert toy.max_abs_diff(law, toy.extend((), target, 1)) < TOL
    verdict = verify(tree, toy.target_probs_for(tree, target), RULES["rrs"], StepRandom(0, Stream.VERIFY, 0))
    assert len(verdict.token_ids) == 1


def test_a_plan_chosen_from_the_first_steps_outcome_keeps_the_law_exact():
    """Step 1: a model chain of 2; step 2: the plan the policy makes after observing step 1 (plain, or a model
    chain of some depth); then the target alone. The emitted law of 4 tokens is the target's."""
    draft, target = toy.random_table(1, V), toy.random_table(2, V)
    shifted = lambda table, prefix: lambda p: table((*prefix, *p))  # noqa: E731
    rule, law, plans = RULES["rrs"], {}, set()

    def second_plan(accepted: int) -> Plan:
        policy = _policy({1: 50, 2: 55, 3: 60, 4: 65}, draft_level=8, depth=3)
        policy.observe(Plan(MODEL, 2), [0.5, 0.5], accepted, 60, 62, 16)
        return policy.plan(root_top=None)

    def trees(prefix: tuple, plan: Plan):
        if plan.kind == PLAIN:
            return [(DraftTree(torch.tensor([0]), torch.tensor([-1]), torch.zeros(1, V, dtype=torch.float64)), 1.0)]
        return toy.branching_tree_law(shifted(draft, prefix), V, [1] * plan.depth, WOR)

    for tree1, p1 in trees((), Plan(MODEL, 2)):
        for e1, q1 in step_law(tree1, toy.target_probs_for(tree1, target), rule).items():
            plan = second_plan(len(e1) - 1)
            plans.add(plan)
            for tree2, p2 in trees(e1, plan):
                for e2, q2 in step_law(tree2, toy.target_probs_for(tree2, shifted(target, e1)), rule).items():
                    for seq, p_rest in toy.extend((*e1, *e2), target, 4).items():
                        law[seq] = law.get(seq, 0.0) + p1 * q1 * p2 * q2 * p_rest
    assert len(plans) > 1  # the second plan does depend on the first step's outcome
    assert toy.max_abs_diff(law, toy.extend((), target, 4)) < TOL


def test_negative_control_a_gate_that_reads_the_drawn_child_is_not_exact():
    """The gate must decide before the child is drawn: dropping a drawn child by its token (here: token 0) is
    caught by the same enumeration."""
    table, _ = _laws()["spread"]
    cut = []
    for tree, prob in toy.branching_tree_law(table, V, [1], WOR):
        if int(tree.token_ids[1]) == 0:
            tree = DraftTree(tree.token_ids[:1], tree.parent_idx[:1], torch.zeros_like(tree.draft_probs[:1]))
        cut.append((tree, prob))
    target = toy.random_table(1, V)
    law = toy.speculative_law(cut, target, RULES["rrs"], 2)
    assert toy.max_abs_diff(law, toy.extend((), target, 2)) > 1e-3

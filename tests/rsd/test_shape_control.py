"""The shape controller (rsd.shape_control): its cost model on synthetic costs, what it learns, and that a
shape chosen from past outcomes keeps the output law exact (enumeration over two steps)."""

import random

import pytest

from rsd.acceptance import step_law
from rsd.drafting import DraftMode
from rsd.methods import Method
from rsd.shape_control import Costs, Shape, ShapeController, best_fixed, expected_tokens, family
from tests.fixtures import toy

V = 3


def test_expected_tokens_and_step_time_closed_forms():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 3) == 4 and expected_tokens(0.0, 5) == 1
    costs = Costs(one_way_ms=10, draft_ms_per_level=3, draft_ms_per_row=1, verify_ms=20, verify_ms_per_node=0.5)
    shape = Shape(2, 4)  # draft 4 * (3 + 2) = 20, verify 20 + 0.5 * 9 = 24.5, wait 44.5
    assert costs.draft(shape) == 20 and costs.verify(shape) == 24.5
    assert costs.step(shape) == 64.5
    assert Costs(**{**costs.__dict__, "predraft_hit_rate": 1.0}).step(shape) == 44.5  # the draft hides in the wait


def test_shape_strings_follow_each_methods_family():
    assert [Shape(3, 4).spec(m) for m in ("rsd_s", "spectr", "rsd_c")] == ["3x4", "3x4", "3,1,1,1"]
    assert Shape(1, 5).spec("sd") == "5"
    for m in ("rsd_s", "spectr", "rsd_c", "specinfer", "sd"):
        assert Method.parse(m, Shape(1 if m == "sd" else 2, 3).spec(m)).depth == 3
    with pytest.raises(ValueError, match="one chain"):
        Shape(2, 3).spec("sd")


def test_a_longer_round_trip_buys_deeper_chains():
    ctl = ShapeController(family([1], range(1, 11)), prior=(80, 20), explore=0)  # p = 0.8, sure of it
    depths = [ctl.choose(Costs(one_way_ms=d, draft_ms_per_level=5, verify_ms=20)).depth for d in (0, 10, 50, 200)]
    assert depths == sorted(depths) and depths[-1] > depths[0]


def test_a_width_never_tried_borrows_the_pooled_one_draft_rate():
    ctl = ShapeController(family([1, 2], [2]), prior=(1, 1))
    for _ in range(500):
        ctl.observe(Shape(1, 2), 1)  # one success then one failure: p_1 = 0.5
    p2, _ = ctl.acceptance(2)
    assert p2 == pytest.approx(0.75, abs=0.01)  # 1 - (1 - 0.5)^2
    with pytest.raises(ValueError, match="outside"):
        ctl.observe(Shape(1, 2), 3)


def test_learns_the_best_shape_from_outcomes():
    truth = {1: 0.55, 2: 0.7, 4: 0.8}  # p_W per width
    costs = Costs(one_way_ms=25, draft_ms_per_level=4, draft_ms_per_row=1, verify_ms=30, verify_ms_per_node=0.8)
    shapes = family(truth, range(1, 9))
    ctl, rng = ShapeController(shapes), random.Random(0)
    for _ in range(3000):
        shape = ctl.choose(costs)
        accepted = 0
        while accepted < shape.depth and rng.random() < truth[shape.width]:
            accepted += 1
        ctl.observe(shape, accepted)
    best = best_fixed(shapes, truth, costs)
    chosen = ctl.choose(costs)
    rate = lambda s: expected_tokens(truth[s.width], s.depth) / costs.step(s)  # noqa: E731
    assert rate(chosen) >= 0.97 * rate(best)


def _two_step_law(draft, target, first: Shape, choose, length: int) -> tuple[dict, set]:
    """Law of the first `length` tokens: a step of rsd_c with shape `first`, a second whose shape is
    choose(first step's emitted tokens), then plain target sampling. -> (law, the second shapes used)."""
    rule, law, used = Method.parse("rsd_c", "2").rule(False), {}, set()
    shifted = lambda table, prefix: lambda p: table((*prefix, *p))  # noqa: E731

    def trees(prefix: tuple, shape: Shape):
        branching = list(Method.parse("rsd_c", shape.spec("rsd_c")).branching)
        return toy.branching_tree_law(shifted(draft, prefix), V, branching, DraftMode.WITHOUT_REPLACEMENT)

    for tree1, p1 in trees((), first):
        for e1, q1 in step_law(tree1, toy.target_probs_for(tree1, target), rule).items():
            second = choose(e1)
            used.add(second)
            for tree2, p2 in trees(e1, second):
                for e2, q2 in step_law(tree2, toy.target_probs_for(tree2, shifted(target, e1)), rule).items():
                    for seq, p_rest in toy.extend((*e1, *e2), target, length).items():
                        law[seq] = law.get(seq, 0.0) + p1 * q1 * p2 * q2 * p_rest
    return law, used


def test_a_shape_chosen_from_past_outcomes_keeps_the_law_exact():
    draft, target = toy.random_table(1, V), toy.random_table(2, V)
    first = Shape(1, 2)
    costs = Costs(one_way_ms=2, draft_ms_per_level=1, verify_ms=1, verify_ms_per_node=0.6)

    def choose(emitted: tuple) -> Shape:  # the controller after seeing step 1's outcome
        ctl = ShapeController(family([1, 2], [1, 2]), prior=(1, 1), explore=0)
        ctl.observe(first, len(emitted) - 1)
        return ctl.choose(costs)

    law, used = _two_step_law(draft, target, first, choose, length=3)
    assert len(used) > 1  # the second shape does depend on the first step's outcome
    assert toy.max_abs_diff(law, toy.extend((), target, 3)) < 1e-9
    # negative control: a shape chosen from the second step's own draft (peeking) is not exact
    peek = _peeking_law(draft, target, first, 3)
    assert toy.max_abs_diff(peek, toy.extend((), target, 3)) > 1e-3


def _peeking_law(draft, target, first: Shape, length: int) -> dict:
    """As _two_step_law, but the second tree (rsd_c "2") keeps only its second child whenever its first
    child's token is 0: a width chosen after the step's own draws."""
    rule, law = Method.parse("rsd_c", "2").rule(False), {}
    shifted = lambda table, prefix: lambda p: table((*prefix, *p))  # noqa: E731
    mode = DraftMode.WITHOUT_REPLACEMENT
    for tree1, p1 in toy.branching_tree_law(draft, V, [first.width] + [1] * (first.depth - 1), mode):
        for e1, q1 in step_law(tree1, toy.target_probs_for(tree1, target), rule).items():
            for tree2, p2 in toy.branching_tree_law(shifted(draft, e1), V, [2], mode):
                if len(tree2.token_ids) == 3 and int(tree2.token_ids[1]) == 0:
                    keep = [0, 2]
                    tree2 = type(tree2)(tree2.token_ids[keep], tree2.parent_idx[keep], tree2.draft_probs[keep])
                for e2, q2 in step_law(tree2, toy.target_probs_for(tree2, shifted(target, e1)), rule).items():
                    for seq, p_rest in toy.extend((*e1, *e2), target, length).items():
                        law[seq] = law.get(seq, 0.0) + p1 * q1 * p2 * q2 * p_rest
    return law


def test_the_cost_meter_recovers_a_linear_verify_cost_and_the_delay():
    from rsd.shape_control import CostMeter

    meter = CostMeter()
    for i in range(40):
        shape = Shape(1 + i % 3, 2 + i % 2)
        verify = 100 + 5 * (1 + shape.num_nodes)
        costs = meter.observe(shape, 30.0 * shape.depth, verify, verify + 2 * 25 + 4, 4, hit=False)
    assert costs.verify_ms == pytest.approx(100) and costs.verify_ms_per_node == pytest.approx(5)
    assert costs.one_way_ms == pytest.approx(25) and costs.draft_ms_per_level == pytest.approx(30)
    assert costs.predraft_hit_rate == 0
    assert meter.observe(Shape(1, 2), None, 110, 164, 4, hit=True).draft_ms_per_level == pytest.approx(30)

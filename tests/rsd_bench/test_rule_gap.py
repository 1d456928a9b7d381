"""The optimum of rsd_bench.rule_gap: its LP agrees with Hu et al.'s at depth 1, bounds every exact rule, and
is reached by Traversal Verification (and block verification) on chains, the optimality both papers prove."""

import pytest

from rsd.methods import Method
from rsd_bench.rule_gap import optimal_accepted, optimal_first_level, rule_figures, tree_law
from tests.fixtures import toy

pytest.importorskip("scipy")

V = 4
TOL = 1e-7  # the LP solver's tolerance
PAIRS = {
    "random": lambda: (toy.random_table(51, V), toy.random_table(52, V)),
    "zeros_both_sides": lambda: (toy.random_table(53, V, zeros=(0,)), toy.random_table(54, V, zeros=(1, 2))),
}


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("shape", ["2", "3"])
def test_traversal_and_block_reach_the_optimum_on_chains(pair, shape):
    draft, target = PAIRS[pair]()
    method = Method.parse("sd", shape)
    trees = tree_law(method, draft, V)
    optimum = optimal_accepted(trees, target, method.depth, V)
    for verification in ("traversal", "block"):
        assert rule_figures(trees, target, method.rule(False, verification))[0] == pytest.approx(optimum, abs=TOL)
    token = rule_figures(trees, target, method.rule(False, "token"))[0]
    assert token <= optimum + TOL and (pair != "random" or token < optimum - 1e-3)  # token-level RRS falls short


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize(("name", "shape"), [("rsd_c", "3"), ("specinfer", "2")])
def test_at_depth_one_the_lp_is_hu_et_al_and_bounds_the_rules(pair, name, shape):
    draft, target = PAIRS[pair]()
    method = Method.parse(name, shape)
    trees = tree_law(method, draft, V)
    optimum = optimal_accepted(trees, target, 1, V)
    assert optimum == pytest.approx(optimal_first_level(trees, target), abs=TOL)
    for verification in ("token", "traversal"):
        accepted, first = rule_figures(trees, target, method.rule(False, verification))
        assert accepted == pytest.approx(first, abs=1e-12)  # depth 1: accepted tokens = P(one accepted)
        assert accepted <= optimum + TOL


@pytest.mark.parametrize(("name", "shape"), [("rsd_c", "2,2"), ("rsd_s", "2x2"), ("spectr", "2x2")])
def test_every_rule_stays_below_the_optimum_on_trees(name, shape):
    draft, target = PAIRS["random"]()
    method = Method.parse(name, shape)
    trees = tree_law(method, draft, V)
    optimum = optimal_accepted(trees, target, method.depth, V)
    for verification in ("token", "traversal"):
        assert rule_figures(trees, target, method.rule(False, verification))[0] <= optimum + TOL

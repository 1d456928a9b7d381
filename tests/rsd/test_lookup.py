"""Context drafting (rsd.lookup): the n-gram law, its trees, and exactness of every rule on them.

The lookup law misses most of the vocabulary (a point mass, or the few tokens that followed an n-gram) and
is a zero row where nothing recurs: the enumeration proves each rule exact on such trees, as
test_acceptance.py does for model drafts, and the statistical tests check the drafting code against it.
"""

import pytest
import torch

from rsd.acceptance import RULES, verify
from rsd.drafting import DraftMode, draft_tree
from rsd.lookup import MAX_N, HybridProposal, LookupProposal, continuation, continuation_law
from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd_wire.convert import method_shape
from tests.fixtures import toy

WOR, GREEDY = DraftMode.WITHOUT_REPLACEMENT, DraftMode.GREEDY
V = 4
TOL = 1e-9

# Contexts ending in the root token 0: "1 0" was followed by 2 and by 3 (a two-token law at the root, point
# masses below it); "0 3" once (a chain); nothing recurs (no proposal: the tree is the root alone).
CONTEXTS = {
    "two_followers": [1, 0, 2, 3, 1, 0, 3, 2, 1, 0],
    "one_follower": [2, 1, 0, 3, 3, 1, 0, 2, 1, 0],
    "no_repeat": [1, 2, 3, 0],
}


def lookup_table(context: list[int]) -> toy.Table:
    return lambda path: continuation_law(torch.tensor([*context, *path]), V)


def test_continuation_law_counts_what_followed_the_longest_ngram():
    law = continuation_law(torch.tensor([5, 6, 7, 5, 6, 8, 5, 6]), 10)
    assert law.tolist() == [0] * 7 + [0.5, 0.5, 0]  # "5 6" was followed by 7 and 8
    law = continuation_law(torch.tensor([1, 2, 3, 9, 2, 3, 4, 1, 2, 3]), 10)
    assert int(law.argmax()) == 9 and float(law.max()) == 1.0  # "1 2 3" (n = 3) wins over "2 3" (9 or 4)
    assert continuation_law(torch.tensor([1, 2, 3, 4]), 10).sum() == 0  # no repeat: no proposal
    assert continuation_law(torch.tensor([3]), 10).sum() == 0
    with pytest.raises(ValueError, match="n-gram sizes"):
        continuation_law(torch.tensor([1, 2]), 10, min_n=3, max_n=2)


def test_lookup_proposal_is_the_table_of_its_context():
    context = CONTEXTS["two_followers"]
    tree = draft_tree(toy.TableProposal(lookup_table(context)), 0, [2, 1, 1], WOR, StepRandom(0, Stream.DRAFT, 0))
    got = LookupProposal(context, V)(tree.token_ids, tree.parent_idx, torch.arange(tree.num_nodes))
    assert torch.equal(got, toy.target_probs_for(tree, lookup_table(context)))


def test_no_repeat_drafts_the_root_alone():
    tree = draft_tree(LookupProposal(CONTEXTS["no_repeat"], V), 0, [2, 1], WOR, StepRandom(0, Stream.DRAFT, 0))
    assert tree.num_nodes == 1
    verdict = verify(tree, toy.random_table(3, V)(())[None], RULES["rrs"], StepRandom(0, Stream.VERIFY, 0))
    assert verdict.accepted_ids == [] and verdict.is_bonus


SHAPES = {"chain3": [1, 1, 1], "tree2x1x1": [2, 1, 1], "wide3": [3]}
RULES_T1 = ["rrs", "traversal", "block"]


@pytest.mark.parametrize("rule", RULES_T1)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("target_seed", [1, 2])
def test_lookup_trees_are_exact_for_every_rule(context, shape, rule, target_seed):
    branching = SHAPES[shape]
    if rule == "block" and branching != [1] * len(branching):
        pytest.skip("block verification is for chains")
    trees = toy.branching_tree_law(lookup_table(CONTEXTS[context]), V, branching, WOR)
    assert abs(sum(p for _, p in trees) - 1) < TOL
    target = toy.random_table(target_seed, V, zeros=(2,) if target_seed == 2 else ())  # 2: a drafted token q bans
    law = toy.speculative_law(trees, target, RULES[rule], len(branching) + 1)
    assert toy.max_abs_diff(law, toy.extend((), target, len(branching) + 1)) < TOL


@pytest.mark.parametrize("context", CONTEXTS)
def test_lookup_at_temperature_0_emits_the_target_greedy_path(context):
    target = toy.greedy_table(toy.random_table(4, V))
    trees = toy.branching_tree_law(lookup_table(CONTEXTS[context]), V, [2, 1, 1], GREEDY)
    law = toy.speculative_law(trees, target, RULES["greedy"], 4)
    assert toy.max_abs_diff(law, toy.extend((), target, 4)) < TOL


def test_drafted_lookup_trees_follow_the_enumerated_law_and_the_output_the_target():
    context, n = CONTEXTS["two_followers"], 4000
    law = {}
    for t, p in toy.branching_tree_law(lookup_table(context), V, [2, 1], WOR):
        law[(tuple(t.token_ids.tolist()), tuple(t.parent_idx.tolist()))] = p
    target, g = toy.random_table(5, V), torch.Generator().manual_seed(0)
    trees, emitted = {}, {}
    for i in range(n):
        tree = draft_tree(LookupProposal(context, V), 0, [2, 1], WOR, StepRandom(1, Stream.DRAFT, i))
        key = (tuple(tree.token_ids.tolist()), tuple(tree.parent_idx.tolist()))
        trees[key] = trees.get(key, 0) + 1
        tokens = tuple(
            verify(tree, toy.target_probs_for(tree, target), RULES["rrs"], StepRandom(1, Stream.VERIFY, i)).token_ids
        )
        while len(tokens) < 3:
            tokens += (int(torch.multinomial(target(tokens), 1, generator=g)),)
        emitted[tokens[:3]] = emitted.get(tokens[:3], 0) + 1
    assert toy.chi_square_pvalue(trees, law, n) > 1e-4
    assert toy.chi_square_pvalue(emitted, toy.extend((), target, 3), n) > 1e-4


@pytest.mark.parametrize("shape,branching", [("6", (1,) * 6), ("2,1,1", (2, 1, 1)), ("3,", (3,)), ("1", (1,))])
def test_lookup_shapes_parse_and_round_trip(shape, branching):
    method = Method.parse("lookup", shape)
    assert method.branching == branching and method.draft_free
    assert Method.parse("lookup", method_shape(method)) == method
    assert method.rule(False).name == "rrs" and method.rule(True).name == "greedy"
    assert method.rule(False, "coupled").coupled  # the coupled rule is exact for any drafter's draws
    with pytest.raises(ValueError):
        Method.parse("lookup", ",")


# ---- the model's tree with lookups merged in (HybridProposal, --lookup-n)


def hybrid_table(context: list[int], model: toy.Table, lookup_n: int) -> toy.Table:
    """HybridProposal's law at a path: the context's where an n-gram of >= lookup_n recurs, else the model's."""

    def law(path):
        found = continuation(torch.tensor([*context, *path]), V, lookup_n, max(MAX_N, lookup_n))
        return found[0] if found[1] else model(path)

    return law


class CountingTable(toy.TableProposal):
    """A model Proposal that records the nodes it was asked for."""

    def __init__(self, table):
        super().__init__(table)
        self.asked: list[int] = []
        self.num_forwards, self.tentative_of = 0, {}

    def __call__(self, token_ids, parent_idx, node_idx):
        self.asked += node_idx.tolist()
        return super().__call__(token_ids, parent_idx, node_idx)


@pytest.mark.parametrize("lookup_n", [2, 3])
def test_hybrid_proposal_states_the_lookup_law_where_the_context_repeats_else_the_models(lookup_n):
    context, model = CONTEXTS["two_followers"], toy.random_table(7, V)
    proposal = CountingTable(model)
    hybrid = HybridProposal(proposal, context, V, lookup_n, torch.float64, "cpu")
    tree = draft_tree(hybrid, 0, [2, 1, 1], WOR, StepRandom(0, Stream.DRAFT, 0))
    expected = hybrid_table(context, model, lookup_n)
    expanded = [n for n in range(tree.num_nodes) if tree.draft_probs[n].sum() > 0]
    for n in expanded:
        assert torch.equal(tree.draft_probs[n], expected(toy.path_tokens(tree.token_ids, tree.parent_idx, n)))
    looked_up = [n for n in expanded if n not in proposal.asked]  # the model ran nowhere else
    assert sorted(proposal.asked) == [n for n in expanded if n not in looked_up]
    assert hybrid.looked_up == len(looked_up)
    assert (0 in looked_up) == (lookup_n == 2)  # "1 0" recurs before the root; no 3-gram ending there does
    with pytest.raises(ValueError, match="lookup_n"):
        HybridProposal(proposal, context, V, 0, torch.float64, "cpu")


@pytest.mark.parametrize("rule", RULES_T1)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("context", ["two_followers", "one_follower"])
@pytest.mark.parametrize("target_seed", [1, 2])
def test_hybrid_trees_are_exact_for_every_rule(context, shape, rule, target_seed):
    branching = SHAPES[shape]
    if rule == "block" and branching != [1] * len(branching):
        pytest.skip("block verification is for chains")
    table = hybrid_table(CONTEXTS[context], toy.random_table(8, V, support=3), 2)
    trees = toy.branching_tree_law(table, V, branching, WOR)
    assert abs(sum(p for _, p in trees) - 1) < TOL
    target = toy.random_table(target_seed, V, zeros=(2,) if target_seed == 2 else ())
    law = toy.speculative_law(trees, target, RULES[rule], len(branching) + 1)
    assert toy.max_abs_diff(law, toy.extend((), target, len(branching) + 1)) < TOL


@pytest.mark.parametrize("target_seed", [1, 2])
def test_hybrid_beam_search_trees_are_exact(target_seed):
    table = hybrid_table(CONTEXTS["two_followers"], toy.random_table(9, V), 2)
    trees = toy.sbs_tree_law(table, V, 2, 2)
    target = toy.random_table(target_seed, V, zeros=(2,) if target_seed == 2 else ())
    law = toy.speculative_law(trees, target, RULES["rrs"], 3)
    assert toy.max_abs_diff(law, toy.extend((), target, 3)) < TOL

"""Penalties (rsd.penalties) as exact transforms of the sampling law.

The transform is vLLM's apply_penalties (checked against its formula written out by hand). Exactness: inside a
draft tree the law at a node is penalised with the session's counts plus the draft tokens on the node's path;
the draft laws (the toy drafters' tables) and the target laws (computed per tree as the verifiers do, by
rsd.penalties.counts_at over the tree) both follow it, and then every method under every verification emits,
by exact enumeration (tests/fixtures/toy.py), the law of sampling the penalised target token by token. A
verifier that penalises every node with the session's counts alone (ignoring the path) is caught.
"""

from functools import cache

import pytest
import torch

from rsd.acceptance import RULES, step_law
from rsd.drafting import DraftMode
from rsd.penalties import Penalties, TokenCounts, counts_at, node_counts, penalised, session_counts
from rsd.sampling import SamplingParams, logits_to_probs, proposal_probs
from tests.fixtures import toy
from tests.rsd.test_acceptance import METHODS, V

TOL = 1e-6
# The session before the step: the tree's root is its last token (toy trees root at token 0). Prompt [3, 1],
# output [0, 2, 0]: 3 and 1 are seen (repetition only), 0 twice and 2 once in the output.
COMMITTED, OUTPUT_START = [3, 1, 0, 2, 0], 2
PARAMS = {
    "all_three": SamplingParams(0.9, presence_penalty=0.6, frequency_penalty=0.8, repetition_penalty=1.7),
    "negative_with_bias_top_k": SamplingParams(
        1.2, top_k=3, logit_bias=((1, 0.5),), presence_penalty=-0.7, frequency_penalty=-0.4, repetition_penalty=0.6
    ),
}


# ---- the transform ------------------------------------------------------------------------------


def test_transform_is_vllms():
    logits = torch.tensor([[2.0, -1.0, 0.0, 3.0, -2.0]], dtype=torch.float64)
    prompt, output = [0, 1], [3, 3, 4]
    counts = session_counts(prompt + output, len(prompt))
    assert counts.token_ids.tolist() == [0, 1, 3, 4]  # the tokens that occur; no other logit changes
    assert counts.seen_mask.tolist() == [[True] * 4]
    assert counts.output_counts.tolist() == [[0, 0, 2, 1]]
    out = penalised(logits, Penalties(presence=0.5, frequency=0.25, repetition=2.0), counts)
    # repetition on prompt and output tokens (positive / 2, non-positive * 2); then -0.25 * count - 0.5 * present
    want = [2.0 / 2, -1.0 * 2, 0.0, 3.0 / 2 - 0.25 * 2 - 0.5, -2.0 * 2 - 0.25 - 0.5]
    assert out[0].tolist() == pytest.approx(want)
    assert penalised(logits, Penalties(), counts).equal(logits)


def test_penalties_come_after_logit_bias_and_before_temperature():
    logits = torch.tensor([[-0.5, 1.0, 0.2]], dtype=torch.float64)
    counts = session_counts([0], 0)  # token 0 generated once
    params = SamplingParams(0.5, logit_bias=((0, 1.0),), repetition_penalty=2.0)
    biased = torch.tensor([[0.5 / 2, 1.0, 0.2]], dtype=torch.float64)  # -0.5 + 1 = 0.5 > 0: divided
    assert logits_to_probs(logits, params, counts).allclose(torch.softmax(biased / 0.5, -1))
    greedy = SamplingParams(0, frequency_penalty=2.0)
    assert logits_to_probs(torch.tensor([[1.0, 0.5]]), greedy, session_counts([0], 0)).tolist() == [[0.0, 1.0]]


def test_a_law_with_penalties_needs_its_counts():
    with pytest.raises(ValueError, match="token counts"):
        logits_to_probs(torch.zeros(2, 4), SamplingParams(presence_penalty=0.1))
    with pytest.raises(ValueError, match="token counts"):
        proposal_probs(torch.zeros(2, 4), SamplingParams(frequency_penalty=0.1), top_k=2)
    with pytest.raises(ValueError, match="output starts"):
        counts_at(Penalties(repetition=1.1), [1], None, torch.tensor([1]), torch.tensor([-1]), torch.tensor([0]))
    assert counts_at(Penalties(), [1], None, torch.tensor([1]), torch.tensor([-1]), torch.tensor([0])) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", float("nan")),
    ],
)
def test_out_of_range_penalties_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_node_counts_add_each_nodes_own_path():
    session = session_counts([5, 1], 1)  # prompt [5], output [1]
    token_ids = torch.tensor([1, 2, 3, 2, 4])  # root 1; 1 -> {2, 3}; 2 -> 2 -> 4
    parent_idx = torch.tensor([-1, 0, 0, 1, 3])
    counts = node_counts(session, token_ids, parent_idx, torch.tensor([0, 2, 4]))
    assert counts.token_ids.tolist() == [1, 2, 3, 4, 5]  # the session's tokens and the tree's
    assert counts.output_counts.tolist() == [
        [1, 0, 0, 0, 0],  # the root: the session's
        [1, 0, 1, 0, 0],  # node 2: path [3]
        [1, 2, 0, 1, 0],  # node 4: path [2, 2, 4]
    ]
    assert counts.seen_mask.tolist() == [
        [True, False, False, False, True],
        [True, False, True, False, True],
        [True, True, False, True, True],
    ]


# ---- exactness by enumeration -------------------------------------------------------------------


def logit_table(seed: int):
    """Logits per prefix with both signs (the repetition penalty treats them differently)."""
    table = toy.random_table(seed, V)
    return cache(lambda prefix: torch.log(table(prefix)) + 1.5)  # [V] float64


def chain_counts(prefix: tuple[int, ...]) -> TokenCounts:
    """The counts after the session and prefix, through the tree code on the chain root -> prefix."""
    token_ids = torch.tensor([COMMITTED[-1], *prefix])
    parent_idx = torch.arange(-1, len(prefix))
    session = session_counts(COMMITTED, OUTPUT_START)
    return node_counts(session, token_ids, parent_idx, torch.tensor([len(prefix)]))


def penalised_table(logits, params: SamplingParams):
    """The penalised law after each prefix: what sampling the penalised model token by token draws from."""
    return cache(lambda prefix: logits_to_probs(logits(prefix)[None], params, chain_counts(prefix))[0])


def verifier_target_probs(tree, logits, params, ignore_path=False):
    """q at every node [N, V] as the verifiers compute it: the tree's logits, counts_at over the whole tree
    (ignore_path: the session's counts at every node, the negative control)."""
    rows = torch.stack([logits(toy.path_tokens(tree.token_ids, tree.parent_idx, n)) for n in range(tree.num_nodes)])
    nodes = torch.arange(tree.num_nodes)
    counts = counts_at(params.penalties, COMMITTED, OUTPUT_START, tree.token_ids, tree.parent_idx, nodes)
    if ignore_path:
        session = session_counts(COMMITTED, OUTPUT_START)
        num_rows = tree.num_nodes
        seen, output = session.seen_mask.expand(num_rows, -1), session.output_counts.expand(num_rows, -1)
        counts = TokenCounts(session.token_ids, seen, output)
    return logits_to_probs(rows, params, counts)


def output_law_gap(method: str, rule: str, params: SamplingParams, ignore_path=False) -> float:
    build, _, depth = METHODS[method]
    draft_logits, target_logits = logit_table(51), logit_table(52)
    draft, target = penalised_table(draft_logits, params), penalised_table(target_logits, params)
    law: dict[tuple[int, ...], float] = {}
    for tree, p_tree in build(draft):
        q = verifier_target_probs(tree, target_logits, params, ignore_path)
        for emitted, p in step_law(tree, q, RULES[rule]).items():
            for seq, p_rest in toy.extend(emitted, target, depth + 1).items():
                law[seq] = law.get(seq, 0.0) + p_tree * p * p_rest
    return toy.max_abs_diff(law, toy.extend((), target, depth + 1))


# Every method under every verification it pairs with (rsd.methods), on one tree of each family (the wider ones
# cost seconds each and prove nothing more about the counts), the confidence stop included.
CASES = [
    ("sd_chain3", "rrs"),
    ("sd_chain3", "traversal"),
    ("sd_chain3", "block"),
    ("sd_chain3_stop", "block"),
    ("rsd_c_2x2", "rrs"),
    ("rsd_c_2x2", "traversal"),
    ("rsd_c_2x1x1_stop", "traversal"),
    ("rsd_s_w2_l2", "rrs"),
    ("rsd_s_w2_l2_stop", "traversal"),
    ("specinfer_2x2", "rrs_with_replacement"),
    ("specinfer_2x2", "traversal_with_replacement"),
    ("spectr_k2_l2", "kseq"),
    ("spectr_k2_l2", "traversal_with_replacement"),
]


@pytest.mark.parametrize(("method", "rule"), CASES)
def test_output_law_is_the_penalised_targets(method, rule):
    assert output_law_gap(method, rule, PARAMS["all_three"]) < TOL


@pytest.mark.parametrize(("method", "rule"), [("sd_chain3", "block"), ("rsd_s_w2_l2", "rrs"), ("spectr_k2_l2", "kseq")])
def test_output_law_is_the_penalised_targets_with_negative_penalties_bias_and_top_k(method, rule):
    assert output_law_gap(method, rule, PARAMS["negative_with_bias_top_k"]) < TOL


@pytest.mark.parametrize(
    ("method", "rule"), [("rsd_c_2x2", "traversal"), ("spectr_k2_l2", "kseq"), ("sd_chain3", "block")]
)
def test_negative_control_verifier_that_ignores_the_path(method, rule):
    assert output_law_gap(method, rule, PARAMS["all_three"], ignore_path=True) > 1e-3


@pytest.mark.parametrize("branching", [[1, 1, 1], [2, 2], [3, 1]])
def test_greedy_emits_the_penalised_targets_greedy_path(branching):
    """T = 0: the greedy rule on greedy drafts emits the argmax of the penalised target, path by path."""
    params = SamplingParams(0, presence_penalty=1.0, frequency_penalty=1.0, repetition_penalty=1.5)
    draft = penalised_table(logit_table(51), params)
    target_logits = logit_table(52)
    target = penalised_table(target_logits, params)
    ((tree, _),) = toy.branching_tree_law(draft, V, branching, DraftMode.GREEDY)
    q = verifier_target_probs(tree, target_logits, params)
    ((emitted, p),) = step_law(tree, q, RULES["greedy"]).items()
    expected = ()
    for _ in emitted:
        expected += (int(target(expected).argmax()),)
    assert p == 1.0 and emitted == expected

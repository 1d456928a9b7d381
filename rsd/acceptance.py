"""Acceptance rules: walk a draft tree with the target's laws; emit the accepted draft tokens and
one correction or bonus token.

Letters follow the paper (Jeon et al., 2024) and Chen et al. (2023): q is the target's law and p the
draft's law, both [V] and after the same sampling transforms (rsd.sampling). Elsewhere in the code
base they are called target_probs and draft_probs.

A rule is judged node by node. At a node whose children x_1..x_K are stored in sampling order, a
node law returns
    accept_probs [K]  a_k = P(accept x_k | x_1..x_{k-1} were rejected)
    residual     [V]  the law of the correction token if all K are rejected
The walk (`verify`) accepts the first x_k with u_k < a_k (u_k ~ U(0,1), fresh: the verifier stream's
(Draw.ACCEPT, node, k), rsd.random) and descends into it; at a node without children it emits a bonus
token from q there. `step_law` computes the exact
law of what one step emits from the same node laws, for the enumeration proofs in tests/, and
`accepted_length_law` the exact law of how many drafts it accepts on a given tree, in vector ops that
scale to a real vocabulary (to compare rules on the same real trees).

    rule                    drafts it is exact for                     paper
    rrs                     siblings drawn WITHOUT replacement         RSD (recursive rejection sampling)
    rrs_with_replacement    siblings drawn i.i.d.                      SpecInfer (multi-round), SD when K=1
    kseq                    i.i.d. siblings, chains merged by prefix   SpecTr K-SEQ, in rsd.spectr
    greedy                  anything, temperature 0                    greedy matching
    traversal               siblings WITHOUT replacement, per node     Traversal Verification, in rsd.traversal
    traversal_with_replacement  siblings drawn i.i.d.                  the same walk, p kept (rsd.traversal)
    block                   one chain                                  block verification, in rsd.traversal
    coupled                 Gumbel-Top-K children from shared noise    Gumbel coupling, in rsd.coupled

Traversal and block judge whole paths, leaf to root, instead of node by node: a rule with `tests` gives
the list of (node, a, law) tests of rsd.traversal, and the walk takes the first that passes. The coupled
rule samples the target with the drafter's own noise (Rule.draft_stream): no test, no residual.

One RRS node, worked (tests/rsd/test_acceptance.py checks these numbers). V = 4, children x_1 = 1, x_2 = 2:
    q        = [0.25, 0.25, 0.25, 0.25]    target
    p = p_1  = [0.15, 0.50, 0.20, 0.15]    draft; x_1 was drawn from p_1
    k = 1    a_1 = min(1, q(1) / p_1(1)) = 0.25 / 0.50 = 0.5
             q_2 = norm(max(q - p_1, 0)) = norm([0.10, 0, 0.05, 0.10]) = [0.4, 0, 0.2, 0.4]
             p_2 = p_1 without x_1, renormalised = [0.15, 0, 0.20, 0.15] / 0.5 = [0.3, 0, 0.4, 0.3]
    k = 2    a_2 = min(1, q_2(2) / p_2(2)) = 0.2 / 0.4 = 0.5
             q_3 = norm(max(q_2 - p_2, 0)) = norm([0.1, 0, 0, 0.1]) = [0.5, 0, 0, 0.5]    the residual
With these drafts the step accepts 1 with probability 0.5, 2 with 0.5 * 0.5 = 0.25, and otherwise
emits a correction token from q_3: 0 or 3, 0.125 each. Over the draws of the drafts every token
comes out with probability q: P(x_1 = y and accepted) = p(y) min(1, q(y) / p(y)) = min(p(y), q(y)),
and after a rejection what remains is RRS again, on q_2 and p_2.

The proof assumes, and the walk checks at every node it visits (ValueError naming the node):
q and p are laws (finite, non-negative, positive mass), and every child x has p(x) > 0. Both are
taken in float64 and p is renormalised (a sampler draws from p / sum p): a 16-bit draft law is
promoted, never the target's law rounded down to it. Unchecked,
a child outside p's support would be accepted with certainty: min(1, q(x) / 0) is 1, and so is
min(1, 0 / 0) in Python. Deviations from the paper are marked DEVIATION where they are made.
Why each rule is exact, the methods side by side and the tests that prove them: docs/algorithm.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from rsd.coupled import coupled_walk
from rsd.random import Draw, StepRandom, Stream
from rsd.sampling import check_probs, sample
from rsd.spectr import kseq, merged_children
from rsd.traversal import NodeLaws, Test, block_tests, traversal_tests, uniform_column
from rsd.tree import DraftTree, node_depths, path_to

NodeLaw = Callable[[Tensor, Tensor, Tensor], tuple[list[float], Tensor]]  # (q, p, child_ids) -> (a, residual)
ChildrenOf = Callable[[DraftTree, int], Tensor]  # (tree, node) -> child_idx [K]
Tests = Callable[[DraftTree, NodeLaws], Iterator[Test]]  # whole-path rules (rsd.traversal)


def _residual(q: Tensor, p: Tensor) -> Tensor:
    """norm(max(q - p, 0)) [V].

    DEVIATION: the paper divides by Z = sum max(q - p, 0) unguarded. Z = 0 means q <= p everywhere,
    so rejection had probability 0 and any law will do; returning q keeps later arithmetic finite.
    """
    r = (q - p).clamp_min(0)  # [V]
    z = r.sum()
    return r / z if z > 0 else q


def rrs(q: Tensor, p: Tensor, child_ids: Tensor) -> tuple[list[float], Tensor]:
    """Recursive rejection sampling for children drawn without replacement (RSD).

    The k-th child was drawn from p_k = p restricted to tokens not yet drawn, renormalised, so both
    the ratio and the residual use p_k (using p instead is biased; tests/ show it).
    """
    if torch.unique(child_ids).numel() != child_ids.numel():
        raise ValueError(f"children drawn without replacement must be distinct, got {child_ids.tolist()}")
    accept_probs, p_k = [], p  # p_1 = p; q is q_k as the loop goes
    for k, x in enumerate(child_ids.tolist()):
        accept_probs.append(min(1.0, float(q[x] / p_k[x])))  # a_k
        q = _residual(q, p_k)  # q_{k+1}
        if k + 1 < child_ids.numel():
            p_k = p_k.clone()
            p_k[x] = 0
            p_k = p_k / p_k.sum()  # p_{k+1}
    return accept_probs, q


def rrs_with_replacement(q: Tensor, p: Tensor, child_ids: Tensor) -> tuple[list[float], Tensor]:
    """Multi-round speculative sampling (SpecInfer): every child was drawn i.i.d. from p."""
    accept_probs = []
    for x in child_ids.tolist():
        accept_probs.append(min(1.0, float(q[x] / p[x])))
        q = _residual(q, p)
    return accept_probs, q


def greedy(q: Tensor, p: Tensor, child_ids: Tensor) -> tuple[list[float], Tensor]:
    """Temperature 0: accept the child equal to argmax q, else emit argmax q."""
    best = int(q.argmax())
    residual = torch.zeros_like(q)  # [V]
    residual[best] = 1
    return [float(x == best) for x in child_ids.tolist()], residual


def own_children(tree: DraftTree, node: int) -> Tensor:
    """[K] node indices of `node`'s children, in sampling order."""
    return (tree.parent_idx == node).nonzero().flatten()


@dataclass(frozen=True)
class Rule:
    name: str
    node_law: NodeLaw | None  # None for a whole-path rule
    children_of: ChildrenOf = own_children  # K-SEQ: the children of every chain on the same prefix
    reads_draft_law: bool = True  # False for greedy matching: p is never read, so its support is moot
    tests: Tests | None = None  # a whole-path rule's tests in order (rsd.traversal), instead of node_law
    draft_stream: Stream = Stream.DRAFT  # the stream the drafter must draw from; COUPLED: the coupled rule

    @property
    def coupled(self) -> bool:
        return self.draft_stream is Stream.COUPLED


RULES = {
    "rrs": Rule("rrs", rrs),
    "rrs_with_replacement": Rule("rrs_with_replacement", rrs_with_replacement),
    "kseq": Rule("kseq", kseq, children_of=merged_children),
    "greedy": Rule("greedy", greedy, reads_draft_law=False),
    "traversal": Rule("traversal", None, tests=traversal_tests),
    "traversal_with_replacement": Rule(
        "traversal_with_replacement", None, tests=partial(traversal_tests, without_replacement=False)
    ),
    "block": Rule("block", None, tests=block_tests),
    "coupled": Rule("coupled", None, reads_draft_law=False, draft_stream=Stream.COUPLED),
}


@dataclass(frozen=True)
class Verdict:
    """What one verification step emits.

    accepted_idx  tree nodes accepted, root to leaf: one chain (the K/V to keep, after the root)
    accepted_ids  their tokens
    next_token    the correction token, or the bonus token when is_bonus
    """

    accepted_idx: list[int]
    accepted_ids: list[int]
    next_token: int
    is_bonus: bool

    @property
    def token_ids(self) -> list[int]:
        return [*self.accepted_ids, self.next_token]


def _check_shapes(tree: DraftTree, target_probs: Tensor) -> None:
    if target_probs.shape != tree.draft_probs.shape:
        raise ValueError(
            f"target_probs must be [N, V] = {list(tree.draft_probs.shape)} like the tree's draft_probs, "
            f"got {list(target_probs.shape)}"
        )
    devices = {t.device for t in (target_probs, tree.draft_probs, tree.token_ids, tree.parent_idx)}
    if len(devices) > 1:
        raise ValueError(f"the tree and target_probs must be on one device, got {sorted(map(str, devices))}")


def _node_laws(
    tree: DraftTree, target_probs: Tensor, node: int, child_idx: Tensor, rule: Rule
) -> tuple[Tensor, Tensor]:
    """q and p [V] at `node`, float64, p renormalised; ValueError when an assumption of the proof fails there."""
    q, p = target_probs[node].to(torch.float64), tree.draft_probs[node].to(torch.float64)  # [V] each
    check_probs(q, f"target law q at node {node}")
    if rule.reads_draft_law and child_idx.numel():
        check_probs(p, f"draft law p at node {node}")
        p = p / p.sum()
        child_probs = p[tree.token_ids[child_idx]]  # [K]
        if float(child_probs.min()) <= 0:  # a child p could not have drawn
            c = int(child_idx[child_probs <= 0][0])
            raise ValueError(
                f"node {c} (token {int(tree.token_ids[c])}) has probability 0 under the draft law p at node {node}: "
                "it was not drawn from that law, and min(1, q/p) would accept it with certainty"
            )
    return q, p


def _uniforms(rng: StepRandom | None, draw: Draw, node: int, n: int, device: torch.device | str = "cpu") -> Tensor:
    """The step's uniforms (draw, node, 0..n-1) [n]. Greedy matching (rng None) decides by argmaxes
    alone, so any u gives its verdict."""
    if rng is None:
        return torch.full((n,), 0.5, dtype=torch.float64, device=device)
    return rng.uniform(draw, node, torch.arange(n, device=device))


def verify(tree: DraftTree, target_probs: Tensor, rule: Rule, rng: StepRandom | None) -> Verdict:
    """Walk `tree` from the root with `rule`. target_probs [N, V]: q at every node of the tree, on the
    tree's device. rng: the step's Stream.VERIFY draws (None only for greedy matching)."""
    _check_shapes(tree, target_probs)
    if rng is None and rule.name != "greedy":
        raise ValueError(f"rule {rule.name!r} needs the step's random stream")
    if rule.tests is not None:
        return _verify_by_tests(tree, target_probs, rule, rng)
    if rule.coupled:
        return _verify_coupled(tree, target_probs, rule, rng)
    node = 0
    while True:
        child_idx = rule.children_of(tree, node)  # [K], in sampling order
        q, p = _node_laws(tree, target_probs, node, child_idx, rule)
        if child_idx.numel() == 0:  # an accepted leaf: the bonus token
            token, is_bonus = int(sample(q, _uniforms(rng, Draw.TOKEN, node, 1, q.device)[0])), True
            break
        accept_probs, residual = rule.node_law(q, p, tree.token_ids[child_idx])
        u = _uniforms(rng, Draw.ACCEPT, node, len(accept_probs)).tolist()  # [K] fresh, on the CPU like a_k
        hit = next((k for k, a in enumerate(accept_probs) if u[k] < a), None)
        if hit is None:  # every child rejected: the correction token
            token, is_bonus = int(sample(residual, _uniforms(rng, Draw.TOKEN, node, 1, q.device)[0])), False
            break
        node = int(child_idx[hit])
    # With merged chains (K-SEQ) successive accepted nodes may sit on different chains carrying the
    # same tokens; the chain ending at the last one has the same tokens and is a path to keep.
    accepted_idx = path_to(tree.parent_idx, node)
    return Verdict(accepted_idx, tree.token_ids[accepted_idx].tolist(), token, is_bonus)


def _laws(tree: DraftTree, target_probs: Tensor, rule: Rule) -> NodeLaws:
    """node -> (q, p) [V], checked as the top-down walk checks them, for a whole-path rule."""
    return lambda node: _node_laws(tree, target_probs, node, own_children(tree, node), rule)


def _verify_by_tests(tree: DraftTree, target_probs: Tensor, rule: Rule, rng: StepRandom) -> Verdict:
    """A whole-path rule: the first of its tests to pass (u < a) accepts the path to its node. The test of
    node n reads the uniform (Draw.ACCEPT, parent, rank of n among its siblings), RRS's for that node."""
    for node, a, law in rule.tests(tree, _laws(tree, target_probs, rule)):  # the last test has a = 1
        if a >= 1 or float(rng.uniform(Draw.ACCEPT, *_column(tree, node))[0]) < a:
            token = int(sample(law, _uniforms(rng, Draw.TOKEN, node, 1, law.device)[0]))
            break
    accepted_idx = path_to(tree.parent_idx, node)
    is_bonus = not bool((tree.parent_idx == node).any())  # an original leaf: law is q there, unchanged
    return Verdict(accepted_idx, tree.token_ids[accepted_idx].tolist(), token, is_bonus)


def _verify_coupled(tree: DraftTree, target_probs: Tensor, rule: Rule, rng: StepRandom) -> Verdict:
    """The coupled rule (rsd.coupled): the noise is the step's Stream.COUPLED, from the same seed and root."""
    noise = StepRandom(rng.seed, Stream.COUPLED, rng.root_position)
    node, token = coupled_walk(tree, lambda n: _node_laws(tree, target_probs, n, own_children(tree, n), rule)[0], noise)
    accepted_idx = path_to(tree.parent_idx, node)
    is_bonus = not bool((tree.parent_idx == node).any())
    return Verdict(accepted_idx, tree.token_ids[accepted_idx].tolist(), token, is_bonus)


def _column(tree: DraftTree, node: int) -> tuple[int, Tensor]:
    parent, rank = uniform_column(tree, node)
    return parent, torch.tensor([rank], device=tree.parent_idx.device)


def _endings(tree: DraftTree, target_probs: Tensor, rule: Rule) -> Iterator[tuple[int, float, Tensor]]:
    """Where one `verify` step can end, exactly: (node, probability, law [V] of the next token), one entry per
    way of ending (a node may appear more than once). The step accepts the path root -> node; the
    probabilities sum to 1. Vector ops over V per node, nothing enumerated over V."""
    _check_shapes(tree, target_probs)
    if rule.coupled:
        raise ValueError(
            "the coupled rule reads the noise the tree was drawn with: its law on a given tree is not a function "
            "of the tree and the laws (rsd.coupled)"
        )
    if rule.tests is not None:  # the tests in order: reach test j with the mass that failed all before it
        mass = 1.0
        for node, a, probs in rule.tests(tree, _laws(tree, target_probs, rule)):
            if a > 0:
                yield node, mass * min(a, 1.0), probs
            mass *= 1 - min(a, 1.0)
            if mass <= 0:
                return
        return

    def walk(node: int, mass: float) -> Iterator[tuple[int, float, Tensor]]:
        child_idx = rule.children_of(tree, node)  # [K]
        q, p = _node_laws(tree, target_probs, node, child_idx, rule)
        if child_idx.numel() == 0:
            yield node, mass, q
            return
        accept_probs, residual = rule.node_law(q, p, tree.token_ids[child_idx])
        for k, a in enumerate(accept_probs):
            if a > 0:
                yield from walk(int(child_idx[k]), mass * a)
            mass *= 1 - a
        if mass > 0:
            yield node, mass, residual

    yield from walk(0, 1.0)


def step_law(tree: DraftTree, target_probs: Tensor, rule: Rule) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one `verify` step emits: {emitted token ids: probability}."""
    law: dict[tuple[int, ...], float] = {}
    for node, mass, probs in _endings(tree, target_probs, rule):
        prefix = tuple(tree.token_ids[path_to(tree.parent_idx, node)].tolist())
        for y in probs.nonzero().flatten().tolist():
            law[(*prefix, y)] = law.get((*prefix, y), 0.0) + mass * float(probs[y])
    return law


def accepted_length_law(tree: DraftTree, target_probs: Tensor, rule: Rule) -> list[float]:
    """Exact law of the number of draft tokens one `verify` step accepts on this tree, over the rule's own
    draws: [P(accepted = d) for d = 0..depth of the tree]. The law of step_law's emitted length minus one
    (tests/rsd/test_acceptance.py checks it to 1e-9), without enumerating tokens: it scales to any V."""
    depth = node_depths(tree.parent_idx).tolist()
    law = [0.0] * (max(depth) + 1)
    for node, mass, _ in _endings(tree, target_probs, rule):
        law[depth[node]] += mass
    return law

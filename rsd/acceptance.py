"""Acceptance rules: walk a draft tree with the target's laws; emit the accepted draft tokens and
one correction or bonus token.

Letters follow the paper (Jeon et al., 2024) and Chen et al. (2023): q is the target's law and p the
draft's law, both after the same sampling transforms (rsd.sampling). Elsewhere in the code base
they are called target_probs and draft_probs.

A rule is judged node by node. At a node whose children x_1..x_K are stored in sampling order, a
node law returns
    accept_probs [K]  a_k = P(accept x_k | x_1..x_{k-1} were rejected)
    residual     [V]  the law of the correction token if all K are rejected
The walk accepts the first x_k with u_k < a_k (u_k ~ U(0,1), fresh) and descends into it; with no
children it emits a bonus token from q at the node. `step_law` computes the exact law of what one
step emits from the same node laws, for the enumeration proofs in tests/.

    rule                    drafts it is exact for                     paper
    rrs                     siblings drawn WITHOUT replacement         RSD (recursive rejection sampling)
    rrs_with_replacement    siblings drawn i.i.d.                      SpecInfer (multi-round), SD when K=1
    kseq                    i.i.d. siblings, chains merged by prefix   SpecTr K-SEQ
    greedy                  anything, temperature 0                    greedy matching
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rsd.sampling import sample
from rsd.tree import DraftTree, path_to

NodeLaw = Callable[[Tensor, Tensor, Tensor], tuple[list[float], Tensor]]


def _residual(q: Tensor, p: Tensor) -> Tensor:
    """norm(max(q - p, 0)) [V]. A zero residual means rejection had probability 0, so any law
    will do; q keeps later arithmetic finite."""
    r = (q - p).clamp_min(0)
    z = r.sum()
    return r / z if z > 0 else q


def rrs(q: Tensor, p: Tensor, child_ids: Tensor) -> tuple[list[float], Tensor]:
    """Recursive rejection sampling for children drawn without replacement (RSD).

    The k-th child was drawn from p_k = p restricted to tokens not yet drawn, renormalised, so both
    the ratio and the residual use p_k (using p instead is biased; tests/ show it).
    """
    if torch.unique(child_ids).numel() != child_ids.numel():
        raise ValueError(f"children drawn without replacement must be distinct, got {child_ids.tolist()}")
    accept, p_k = [], p
    for k, x in enumerate(child_ids.tolist()):
        accept.append(min(1.0, float(q[x] / p_k[x])))
        q = _residual(q, p_k)
        if k + 1 < child_ids.numel():
            p_k = p_k.clone()
            p_k[x] = 0
            p_k = p_k / p_k.sum()
    return accept, q


def rrs_with_replacement(q: Tensor, p: Tensor, child_ids: Tensor) -> tuple[list[float], Tensor]:
    """Multi-round speculative sampling (SpecInfer): every child was drawn i.i.d. from p."""
    accept = []
    for x in child_ids.tolist():
        accept.append(min(1.0, float(q[x] / p[x])))
        q = _residual(q, p)
    return accept, q


def _kseq_gamma(q: Tensor, p: Tensor, k: int, iters: int = 40) -> float:
    """Smallest gamma in [1, k] (to bisection precision, from above) with gamma >= c(gamma), where
    c = (1 - (1 - beta)^k) / beta and beta = sum min(p, q / gamma). That keeps the residual >= 0."""

    def feasible(gamma: float) -> bool:
        beta = float(torch.minimum(p, q / gamma).sum())
        c = k if beta <= 0 else (1 - (1 - beta) ** k) / beta
        return gamma >= c

    if feasible(1.0):
        return 1.0
    lo, hi = 1.0, float(k)
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


def kseq(q: Tensor, p: Tensor, child_ids: Tensor) -> tuple[list[float], Tensor]:
    """SpecTr's K-SEQ (Sun et al., 2023): K i.i.d. drafts, each accepted with min(1, q/(gamma p)).

    If no draft is accepted, sample from q - min(p, q/gamma) (1 - (1-beta)^K) / beta, normalised.
    """
    k = child_ids.numel()
    gamma = _kseq_gamma(q, p, k)
    m = torch.minimum(p, q / gamma)  # [V] P(a draft is x and accepted)
    beta = float(m.sum())
    c = k if beta <= 0 else (1 - (1 - beta) ** k) / beta
    accept = [min(1.0, float(q[x] / (gamma * p[x]))) for x in child_ids.tolist()]
    return accept, _residual(q, m * c)


def greedy(q: Tensor, p: Tensor, child_ids: Tensor) -> tuple[list[float], Tensor]:
    """Temperature 0: accept the child equal to argmax q, else emit argmax q."""
    best = int(q.argmax())
    residual = torch.zeros_like(q)
    residual[best] = 1
    return [float(x == best) for x in child_ids.tolist()], residual


@dataclass(frozen=True)
class Rule:
    name: str
    node_law: NodeLaw
    merge_equal_children: bool = False  # K-SEQ: after accepting x, every chain whose draft is x stays alive


RULES = {
    "rrs": Rule("rrs", rrs),
    "rrs_with_replacement": Rule("rrs_with_replacement", rrs_with_replacement),
    "kseq": Rule("kseq", kseq, merge_equal_children=True),
    "greedy": Rule("greedy", greedy),
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


def _children(tree: DraftTree, nodes: list[int]) -> Tensor:
    """Children of all `nodes`, in node order (each parent's in sampling order)."""
    return torch.isin(tree.parent_idx, torch.tensor(nodes, device=tree.parent_idx.device)).nonzero().flatten()


def _alive_after(tree: DraftTree, kids: Tensor, k: int, rule: Rule) -> list[int]:
    if not rule.merge_equal_children:
        return [int(kids[k])]
    same = tree.token_ids[kids] == tree.token_ids[kids[k]]
    return kids[same].tolist()


def verify(tree: DraftTree, target_probs: Tensor, rule: Rule, generator: torch.Generator | None = None) -> Verdict:
    """Walk `tree` from the root with `rule`. target_probs [N, V]: q at every node of the tree."""
    if target_probs.shape[0] != tree.num_nodes:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows for a tree of {tree.num_nodes} nodes")
    alive, last = [0], 0
    while True:
        node = alive[0]  # every alive node has the same prefix, hence the same q and p
        kids = _children(tree, alive)
        if kids.numel() == 0:
            token, is_bonus = int(sample(target_probs[node], generator)), True
            break
        accept_probs, residual = rule.node_law(target_probs[node], tree.draft_probs[node], tree.token_ids[kids])
        u = torch.rand(len(accept_probs), dtype=torch.float64, generator=generator)
        hit = next((k for k, a in enumerate(accept_probs) if u[k] < a), None)
        if hit is None:
            token, is_bonus = int(sample(residual, generator)), False
            break
        last = int(kids[hit])
        alive = _alive_after(tree, kids, hit, rule)
    # With merged chains (K-SEQ) successive accepted nodes may sit on different chains carrying the
    # same tokens; the chain ending at the last one has the same tokens and is a path to keep.
    accepted = path_to(tree.parent_idx, last)
    return Verdict(accepted, tree.token_ids[accepted].tolist(), token, is_bonus)


def step_law(tree: DraftTree, target_probs: Tensor, rule: Rule) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one `verify` step emits: {emitted token ids: probability}."""
    law: dict[tuple[int, ...], float] = {}

    def emit(prefix: tuple[int, ...], mass: float, probs: Tensor) -> None:
        for y in probs.nonzero().flatten().tolist():
            law[(*prefix, y)] = law.get((*prefix, y), 0.0) + mass * float(probs[y])

    def walk(alive: list[int], prefix: tuple[int, ...], mass: float) -> None:
        node = alive[0]
        kids = _children(tree, alive)
        if kids.numel() == 0:
            return emit(prefix, mass, target_probs[node])
        accept_probs, residual = rule.node_law(target_probs[node], tree.draft_probs[node], tree.token_ids[kids])
        for k, a in enumerate(accept_probs):
            if a > 0:
                walk(_alive_after(tree, kids, k, rule), (*prefix, int(tree.token_ids[kids[k]])), mass * a)
            mass *= 1 - a
        if mass > 0:
            emit(prefix, mass, residual)

    walk([0], (), 1.0)
    return law

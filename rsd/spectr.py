"""SpecTr's K-SEQ (Sun et al., 2023), kept apart so that rsd.acceptance reads as RRS alone.

SpecTr drafts K i.i.d. chains (rsd.drafting.draft_spectr) and verifies them token by token. It
differs from recursive rejection sampling in two places, both here:

1. The node law (`kseq`). Each of the K i.i.d. drafts x_i is accepted with probability
   min(1, q(x_i) / (gamma p(x_i))), where gamma in [1, K] is the smallest value that keeps the
   residual non-negative. With beta = sum_x min(p(x), q(x) / gamma) and
   c = (1 - (1 - beta)^K) / beta, the correction token, if all K are rejected, is drawn from
   norm(q - c min(p, q / gamma)).
2. The walk (`merged_children`). After accepting token x every chain whose draft was x stays
   alive, so the next node's children are the children of every node on the same prefix.

Letters as in rsd.acceptance: q the target's law, p the draft's, both [V].
"""

from __future__ import annotations

import torch
from torch import Tensor

from rsd.tree import DraftTree, path_to


def _kseq_c(q: Tensor, p: Tensor, k: int, gamma: float) -> tuple[Tensor, float]:
    """m = min(p, q / gamma) [V], P(a draft is x and accepted), and c = (1 - (1 - beta)^k) / beta."""
    m = torch.minimum(p, q / gamma)  # [V]
    beta = float(m.sum())
    return m, (k if beta <= 0 else (1 - (1 - beta) ** k) / beta)


def _kseq_gamma(q: Tensor, p: Tensor, k: int, iters: int = 40) -> float:
    """The smallest gamma in [1, k] with gamma >= c(gamma), which keeps q - c m >= 0.

    DEVIATION from the paper: SpecTr takes the exact root; we bisect `iters` times and return the
    upper end, so gamma is at most (k - 1) 2^-iters above it. The upper end is always feasible, so
    the residual stays non-negative and the rule stays exact; it only accepts that much less often.
    """

    def feasible(gamma: float) -> bool:
        return gamma >= _kseq_c(q, p, k, gamma)[1]

    if feasible(1.0):
        return 1.0
    lo, hi = 1.0, float(k)
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


def kseq(q: Tensor, p: Tensor, child_ids: Tensor) -> tuple[list[float], Tensor]:
    """K-SEQ node law for K = len(child_ids) i.i.d. drafts: (accept_probs [K], residual [V])."""
    k = child_ids.numel()
    gamma = _kseq_gamma(q, p, k)
    m, c = _kseq_c(q, p, k, gamma)
    accept_probs = [min(1.0, float(q[x] / (gamma * p[x]))) for x in child_ids.tolist()]
    r = (q - c * m).clamp_min(0)  # [V]
    z = r.sum()
    # DEVIATION (as in rsd.acceptance.residual): no residual mass means rejection had probability 0.
    return accept_probs, (r / z if z > 0 else q)


def merged_children(tree: DraftTree, node: int) -> Tensor:
    """[K] the children of every node whose path from the root carries the same tokens as `node`'s,
    in node order: the drafts of all chains still alive at `node`.

    Example: chains (a, b), (a, c), (d, e) are nodes 1..6 with parent_idx [-1, 0, 0, 0, 1, 2, 3].
    At the root the drafts are [a, a, d]; after accepting a (node 1 or 2) they are [b, c].
    """
    parents, tokens = tree.parent_idx.tolist(), tree.token_ids.tolist()
    group = {0}  # the nodes on node's prefix, level by level
    for n in path_to(tree.parent_idx, node):
        group = {m for m in range(len(parents)) if parents[m] in group and tokens[m] == tokens[n]}
    child_idx = [m for m in range(len(parents)) if parents[m] in group]
    return torch.tensor(child_idx, dtype=torch.long, device=tree.parent_idx.device)

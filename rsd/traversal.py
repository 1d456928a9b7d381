"""Rules that judge whole draft sequences: Traversal Verification and block verification.

Traversal Verification (Weng et al., NeurIPS 2025, arXiv 2505.12398) visits the tree
from the leaves towards the root and tests a node with the *sequence-level* probability of its whole
path, not token by token; block verification (Sun et al., 2024, arXiv 2403.10444) is the same idea
for one chain, and on a chain the two are one rule (tests/rsd/test_traversal.py checks that).

Letters as in rsd.acceptance: q the target's law at a node (the paper's M_b), p the draft's (M_s),
alpha a node's acceptance probability (the paper's p_alpha). Both rules reduce to a list of tests
taken in order, each `(node, a, law)`: the first test that passes (u < a, u fresh) accepts the path
root -> node, and the next token is drawn from `law`. A failed test only moves to the next one, so
the list is fixed by the tree and the laws (`step_law` enumerates it exactly).

Traversal Verification on our trees. Every node n holds q_n, p_n and alpha_n, where

    alpha_root = 1,    alpha_c = min(1, alpha_n q_n(x_c) / p_n(x_c))    for a child c (token x_c) of n.

Repeat: go from the root to the *first* leaf of what is left of the tree (first children: the
sibling drawn first; a post-order depth-first walk), and test it with alpha_leaf. Pass: accept its
path and draw the next token from q_leaf. Fail: delete the leaf; at its parent n (token x removed)

    S = sum_y max(alpha_n q_n(y) - p_n(y), 0)
    q_n <- max(alpha_n q_n - p_n, 0) / S            the residual, as in RRS but sequence-level
    p_n <- p_n without x, renormalised              the next sibling's law (drawn without replacement)
    alpha_n <- S / (S + 1 - alpha_n)
    and alpha is recomputed down n's remaining subtrees.

When every child of n is deleted, n is a leaf: it is tested with its alpha_n, and on passing the
next token comes from its residual q_n (a correction token). The root's alpha stays 1, so the walk
always ends. With one level this is RRS exactly (alpha_root = 1: S / (S + 1 - 1) = 1).

Which trees it is exact for (proved by enumeration in tests/rsd/test_traversal.py, docs/algorithm.md):
siblings drawn without replacement and stored in sampling order: SD chains, RSD-C, RSD-S's Stochastic
Beam Search trees, with or without the confidence stop. With `without_replacement=False` (p_n kept
after a deletion, as in multi-round RRS) the same walk is exact for i.i.d. siblings: SpecInfer and
SpecTr's chains. Each variant is wrong on the other family (the enumeration catches it), so
rsd.methods pairs them with the methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import Tensor

from rsd.tree import DraftTree

Test = tuple[int, float, Tensor]  # (node, P(pass | earlier tests failed), law [V] of the next token)
NodeLaws = Callable[[int], tuple[Tensor, Tensor]]  # node -> (q, p) [V] each, float64, checked


def _ratio(alpha: float, q: Tensor, p: Tensor, x: int) -> float:
    return min(1.0, alpha * float(q[x] / p[x]))


def traversal_tests(tree: DraftTree, laws: NodeLaws, without_replacement: bool = True) -> Iterator[Test]:
    """The tests of Traversal Verification on `tree`, in order (lazily: verify stops at the first pass).

    laws(n) gives q and p at node n (rsd.acceptance checks them there). without_replacement: siblings
    were drawn without replacement (p loses a deleted sibling's token) or i.i.d. (p is kept).
    """
    parents, tokens = tree.parent_idx.tolist(), tree.token_ids.tolist()
    n = len(tokens)
    alive = [[] for _ in range(n)]  # alive children, in sampling order
    for c in range(1, n):
        alive[parents[c]].append(c)
    q, p = {}, {}
    for node in range(n):
        q[node], p[node] = laws(node)
        if without_replacement and len({tokens[c] for c in alive[node]}) != len(alive[node]):
            raise ValueError(
                f"children of node {node} drawn without replacement must be distinct, "
                f"got {[tokens[c] for c in alive[node]]}"
            )
    alpha = [1.0] * n
    for c in range(1, n):  # parents come first (rsd.tree)
        alpha[c] = _ratio(alpha[parents[c]], q[parents[c]], p[parents[c]], tokens[c])

    node = 0
    while True:
        while alive[node]:  # the first leaf of what is left below node
            node = alive[node][0]
        yield node, alpha[node], q[node]
        if node == 0:  # alpha_root = 1: the root's test always passes
            return
        parent = parents[node]
        alive[parent].remove(node)
        a = alpha[parent]
        r = (a * q[parent] - p[parent]).clamp_min(0)  # [V]
        s = float(r.sum())
        # DEVIATION (as rsd.acceptance._residual): S = 0 means no residual mass; then alpha_parent is 0 and
        # its law is never used (or, with alpha_parent = 1, this rejection had probability 0).
        q[parent] = r / s if s > 0 else q[parent]
        alpha[parent] = s / (s + (1 - a)) if s + (1 - a) > 0 else 1.0  # 1 - a first: exactly 1 at the root
        if without_replacement:
            kept = p[parent].clone()
            kept[tokens[node]] = 0
            p[parent] = kept / kept.sum() if kept.sum() > 0 else kept
        stack = list(alive[parent])
        while stack:  # alpha down the remaining subtrees of parent
            c = stack.pop()
            alpha[c] = _ratio(alpha[parents[c]], q[parents[c]], p[parents[c]], tokens[c])
            stack.extend(alive[c])
        node = parent


def block_tests(tree: DraftTree, laws: NodeLaws) -> Iterator[Test]:
    """Block verification (Sun et al., 2024) of a chain x_1..x_L: the tests i = L, L-1, .., 0.

    With p_0 = 1 and p_i = min(1, p_{i-1} q_{i-1}(x_i) / p_{i-1}(x_i)) (the paper's sequence-level ratio;
    q_i, p_i the laws at node i), test i passes with h_L = p_L and, for i < L,
        h_i = S_i / (S_i + 1 - p_i),   S_i = sum_y max(p_i q_i(y) - p_i(y), 0);
    the paper keeps the largest i with eta_i <= h_i, which is the first pass scanning down from L. The next
    token comes from q_L after a full acceptance, else from norm(max(p_i q_i - p_i, 0)).
    """
    parents = tree.parent_idx.tolist()
    if parents != list(range(-1, len(parents) - 1)):
        raise ValueError(f"block verification needs a chain (parent_idx -1, 0, 1, ...), got {parents}")
    laws_at = [laws(i) for i in range(len(parents))]
    ratio = [1.0]
    for i in range(1, len(parents)):
        q_prev, p_prev = laws_at[i - 1]
        ratio.append(_ratio(ratio[-1], q_prev, p_prev, int(tree.token_ids[i])))
    last = len(parents) - 1
    yield last, ratio[last], laws_at[last][0]
    for i in range(last - 1, -1, -1):
        q_i, p_i = laws_at[i]
        r = (ratio[i] * q_i - p_i).clamp_min(0)  # [V]
        s = float(r.sum())
        h = s / (s + (1 - ratio[i])) if s + (1 - ratio[i]) > 0 else 1.0  # exactly 1 at i = 0
        yield i, h, (r / s if s > 0 else q_i)  # DEVIATION as in traversal_tests: no mass, never used


def uniform_column(tree: DraftTree, node: int) -> tuple[int, int]:
    """(parent, rank among its children): the key of node's test, the counter RRS gives the same node."""
    parent = int(tree.parent_idx[node])
    return parent, int((tree.parent_idx[:node] == parent).sum())

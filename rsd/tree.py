"""Draft trees as flat tensors, their attention masks and position ids, and validation.

A tree of N nodes is two int64 tensors:
    token_ids  [N]  node 0 is the last committed token (the root); nodes 1.. are draft tokens
    parent_idx [N]  parent_idx[0] == -1 and 0 <= parent_idx[i] < i for i >= 1

`parent_idx[i] < i` makes the order topological and rules out cycles. Siblings are stored in the
order they were sampled: the acceptance rules visit children in increasing node index, and
recursive rejection sampling is exact only in that order (a later sibling's law is its parent's
with the earlier siblings removed; docs/algorithm.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    """A drafted tree plus, per node, the proposal law its children were drawn from.

    token_ids    [N]     int64
    parent_idx   [N]     int64, parent_idx[0] == -1
    draft_probs  [N, V]  float; row i is the law node i's children were sampled from (rows of
                         leaves are unused). For siblings drawn without replacement this is the
                         law of the *first* sibling; the rules derive the later ones.
    """

    token_ids: Tensor
    parent_idx: Tensor
    draft_probs: Tensor

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree on `device` (the verifier walks it where the target's laws are)."""
        return DraftTree(self.token_ids.to(device), self.parent_idx.to(device), self.draft_probs.to(device))

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    def children(self, node: int) -> list[int]:
        """Children of `node` in sampling order."""
        return (self.parent_idx == node).nonzero().flatten().tolist()


def node_depths(parent_idx: Tensor) -> Tensor:
    """Depth of every node, root = 0.  parent_idx [N] -> [N] int64."""
    depth = torch.zeros_like(parent_idx)
    for i in range(1, parent_idx.shape[0]):
        depth[i] = depth[parent_idx[i]] + 1
    return depth


def tree_attention_mask(parent_idx: Tensor) -> Tensor:
    """[N, N] bool, True where node i may attend to node j: j is i or an ancestor of i."""
    n = parent_idx.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parent_idx.device)
    for i in range(1, n):
        mask[i] |= mask[parent_idx[i]]
    return mask


def position_ids(parent_idx: Tensor, root_position: int) -> Tensor:
    """[N] position of each node: the root's position plus its depth (siblings share one)."""
    return root_position + node_depths(parent_idx)


def path_to(parent_idx: Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (empty for the root)."""
    path = []
    while node > 0:
        path.append(node)
        node = int(parent_idx[node])
    return path[::-1]


def validate_tree(token_ids: Tensor, parent_idx: Tensor, vocab_size: int, max_nodes: int | None = None) -> None:
    """Raise ValueError with the reason when an untrusted tree is malformed."""
    if token_ids.dim() != 1 or parent_idx.dim() != 1:
        raise ValueError(
            f"token_ids and parent_idx must be 1-D, got {tuple(token_ids.shape)} and {tuple(parent_idx.shape)}"
        )
    n = token_ids.shape[0]
    if parent_idx.shape[0] != n:
        raise ValueError(f"token_ids has {n} nodes but parent_idx has {parent_idx.shape[0]}")
    if n < 1:
        raise ValueError("a tree needs at least the root node")
    if max_nodes is not None and n > max_nodes:
        raise ValueError(f"tree has {n} nodes, more than the limit of {max_nodes}")
    if token_ids.dtype.is_floating_point or parent_idx.dtype.is_floating_point:
        raise ValueError("token_ids and parent_idx must be integer tensors")
    bad = ((token_ids < 0) | (token_ids >= vocab_size)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"node {i} has token id {int(token_ids[i])} outside the vocabulary [0, {vocab_size})")
    if int(parent_idx[0]) != -1:
        raise ValueError(f"the root's parent must be -1, got {int(parent_idx[0])}")
    idx = torch.arange(n, device=parent_idx.device)
    bad = ((parent_idx[1:] < 0) | (parent_idx[1:] >= idx[1:])).nonzero().flatten()
    if bad.numel():
        i = int(bad[0]) + 1
        raise ValueError(
            f"node {i} has parent {int(parent_idx[i])}: a parent must come before its child (0 <= parent < {i})"
        )


def validate_draft_tree(tree: DraftTree, max_nodes: int | None = None, atol: float = 1e-4) -> None:
    """validate_tree plus the proposal laws: finite, non-negative, summing to 1 at internal nodes,
    and every child's token inside its parent's support."""
    vocab_size = tree.draft_probs.shape[-1]
    validate_tree(tree.token_ids, tree.parent_idx, vocab_size, max_nodes)
    n = tree.num_nodes
    if tree.draft_probs.dim() != 2 or tree.draft_probs.shape[0] != n:
        raise ValueError(f"draft_probs must be [N={n}, V], got {tuple(tree.draft_probs.shape)}")
    internal = torch.unique(tree.parent_idx[1:])
    probs = tree.draft_probs[internal]  # [num_internal, V]
    sums = probs.sum(-1)  # a NaN or an infinite entry makes its row's sum NaN or infinite: no dense isfinite pass
    if not torch.isfinite(sums).all() or (probs.numel() and float(probs.min()) < 0):  # a reduction, no bool pass
        raise ValueError("draft_probs must be finite and non-negative")
    if ((sums - 1).abs() > atol).any():
        raise ValueError(f"draft_probs of internal nodes must sum to 1, got sums {sums.tolist()}")
    child_prob = tree.draft_probs[tree.parent_idx[1:], tree.token_ids[1:]]  # [N-1]
    bad = (child_prob <= 0).nonzero().flatten()
    if bad.numel():
        i = int(bad[0]) + 1
        raise ValueError(f"node {i} (token {int(tree.token_ids[i])}) has zero probability under its parent's law")

"""Drafting strategies: how the draft model's proposals become a tree.

Every strategy is a function over a `Proposal`, the draft's next-token law at given nodes of a
partial tree, so the same code drives a real model (one tree-masked forward per level) or a toy
table in the exactness tests. The law a Proposal returns is the law the children are sampled
from, and it is stored in the tree for the verifier: a drafter that truncates its proposal
(top-k / top-p of its own) does so inside the Proposal.

    strategy      children of a node                          tree
    SD            1 sample                                     one chain of L
    SpecInfer     K_l i.i.d. samples (with replacement)        branching (K_1..K_L)
    SpecTr        K i.i.d. samples at the root, then 1         K independent chains of L
    RSD-C         Gumbel-Top-K_l (without replacement)         branching (K_1..K_L)
    RSD-S         Stochastic Beam Search, width W, depth L     <= W nodes per level, early truncation
    greedy        the K_l most likely tokens                   branching (K_1..K_L), for temperature 0

draft_tree builds the branching trees, its DraftMode saying how children are picked:
WITHOUT_REPLACEMENT (SD, RSD-C), IID (SpecInfer; SpecTr through draft_spectr), GREEDY. RSD-S is
draft_sbs (greedy=True: plain beam search, for temperature 0).

Confidence stop (stop_below = tau > 0, a production knob in the spirit of transformers' assistant
confidence threshold): the shape becomes an upper bound. A node is expanded only if the draft
drew it with probability >= tau (its own entry in its parent's law); RSD-S stops after the first
level none of whose beams reaches tau (dropping single beams would change which prefixes compete
for the W slots). Either way the decision about a node's children is made before they are drawn,
from draft-side values only, and the tree is the untruncated strategy's tree cut by a fixed
function of its upper levels: tests/rsd/test_acceptance.py enumerates exactly that and the rules stay exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Protocol

import torch
from torch import Tensor

from rsd.random import Draw, StepRandom
from rsd.sampling import check_probs, sample, support, support_by_id, without_replacement
from rsd.tree import DraftTree


class DraftMode(StrEnum):
    """How draft_tree picks a node's K children from its proposal law."""

    WITHOUT_REPLACEMENT = "without_replacement"  # Gumbel-Top-K's law, in sampling order: RSD-C (SD when K = 1)
    IID = "iid"  # K i.i.d. samples, repeats allowed: SpecInfer; SpecTr's chains
    GREEDY = "greedy"  # the K most likely tokens, most likely first: every method at temperature 0


class Proposal(Protocol):
    def __call__(self, token_ids: Tensor, parent_idx: Tensor, node_idx: Tensor) -> Tensor:
        """Draft law [F, V] at nodes node_idx [F] of the partial tree (token_ids, parent_idx) [N]. A row of
        zeros proposes nothing: draft_tree keeps that node a leaf (context drafting, rsd.lookup)."""
        ...


class _TreeBuilder:
    """Grows a tree level by level; keeps the proposal law of every expanded node."""

    def __init__(self, root_token: int, device: torch.device | str = "cpu"):
        self.token_ids = [root_token]
        self.parent_idx = [-1]
        self.device = device
        self.probs: dict[int, Tensor] = {}

    def propose(self, proposal: Proposal, nodes: list[int]) -> Tensor:
        probs = proposal(self._tensor(self.token_ids), self._tensor(self.parent_idx), self._tensor(nodes))  # [F, V]
        check_probs(probs[~(probs == 0).all(-1)], "proposal law")  # a zero row: no proposal (draft_tree)
        self.probs.update(zip(nodes, probs, strict=True))
        return probs

    def add(self, parent: int, token: int) -> int:
        self.token_ids.append(token)
        self.parent_idx.append(parent)
        return len(self.token_ids) - 1

    def _tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def build(self, vocab_size: int, dtype: torch.dtype) -> DraftTree:
        n = len(self.token_ids)
        draft_probs = torch.zeros(n, vocab_size, dtype=dtype, device=self.device)  # [N, V]
        for node, probs in self.probs.items():
            draft_probs[node] = probs
        return DraftTree(self._tensor(self.token_ids), self._tensor(self.parent_idx), draft_probs)


def _check_branching(branching: Sequence[int]) -> None:
    if len(branching) == 0 or any(int(k) < 1 for k in branching):
        raise ValueError(f"branching must be a non-empty list of positive ints, got {list(branching)}")


def draft_tree(
    proposal: Proposal,
    root_token: int,
    branching: Sequence[int],
    mode: DraftMode,
    rng: StepRandom,
    device: torch.device | str = "cpu",
    stop_below: float = 0.0,
    grow: Callable[[Tensor, Tensor], list[bool]] | None = None,
) -> DraftTree:
    """A tree with branching[l] children per node at depth l, picked by `mode` (DraftMode).

    A node whose law has fewer than K tokens in its support gets only that many children in the
    without-replacement and greedy modes, and a node whose law is a zero row none (rsd.lookup).
    stop_below: a node drawn with probability below it gets no children (the root always does).
    grow(node_idx [F], laws [F, V]) -> [F] bools: whether each frontier node gets children, asked with their
    laws before any child is drawn (rsd.auto's gate; a function of the nodes' paths, so every rule stays exact).
    rng: the step's draws (Rule.draft_stream). device: where the tree's tensors live (the proposal's
    laws stay on their own device while drafting).
    """
    _check_branching(branching)
    mode = DraftMode(mode)  # ValueError for an unknown mode
    tree = _TreeBuilder(root_token, device)
    frontier, own, probs = [0], [1.0], None  # own: each frontier node's probability in its parent's law
    for depth, k in enumerate(branching):  # the frontier's depth
        frontier = [n for n, p in zip(frontier, own, strict=True) if p >= stop_below]
        if not frontier:
            break
        probs = tree.propose(proposal, frontier)  # [F, V]
        proposed = ~(probs == 0).all(-1)  # [F]: rows that propose something
        if not bool(proposed.all()):
            frontier = [n for n, ok in zip(frontier, proposed.tolist(), strict=True) if ok]
            if not frontier:
                break
            probs = probs[proposed]
        if grow is not None:
            grows = grow(torch.tensor(frontier, dtype=torch.long), probs)
            for n in (n for n, ok in zip(frontier, grows, strict=True) if not ok):
                del tree.probs[n]  # a leaf: its law was never drawn from
            frontier = [n for n, ok in zip(frontier, grows, strict=True) if ok]
            if not frontier:
                break
            probs = probs[torch.tensor(grows, device=probs.device)]
        node_idx = torch.tensor(frontier, dtype=torch.long, device=probs.device)  # [F]
        if mode is DraftMode.IID:
            values, ids = support_by_id(probs)  # [F, S]: draw over the support only (same law)
            u = rng.uniform(Draw.IID, node_idx[:, None], torch.arange(k, device=probs.device))  # [F, k]
            child_ids = sample(values.unsqueeze(1).expand(-1, k, -1), u)  # [F, k]
            if ids is not None:
                child_ids = ids.gather(-1, child_ids)
            valid_mask = torch.ones_like(child_ids, dtype=torch.bool)  # [F, k]
        elif mode is DraftMode.WITHOUT_REPLACEMENT:
            # DEVIATION: the paper's branching is constant; past a law's support no distinct token is
            # left, so the node keeps fewer children (Sequoia drafts uniformly there instead).
            child_ids, valid_mask = without_replacement(probs, min(k, probs.shape[-1]), rng, node_idx, depth)  # [F, k]
        else:
            top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)  # [F, k]
            child_ids, valid_mask = top.indices, top.values > 0
        kept = [  # (parent node, its row f in probs, child token)
            (parent, f, int(tok))
            for f, (parent, row_ids, row_valid) in enumerate(
                zip(frontier, child_ids.tolist(), valid_mask.tolist(), strict=True)
            )
            for tok, ok in zip(row_ids, row_valid, strict=True)
            if ok
        ]
        frontier = [tree.add(parent, tok) for parent, _, tok in kept]
        own = (
            probs[[f for _, f, _ in kept], [tok for _, _, tok in kept]].tolist()
            if stop_below > 0
            else [1.0] * len(kept)
        )
    return tree.build(probs.shape[-1], probs.dtype)


def draft_spectr(
    proposal: Proposal,
    root_token: int,
    num_chains: int,
    depth: int,
    rng: StepRandom,
    device: torch.device | str = "cpu",
    stop_below: float = 0.0,
) -> DraftTree:
    """SpecTr: num_chains independent draft sequences of length depth, as a tree of chains."""
    branching = [num_chains] + [1] * (depth - 1)
    return draft_tree(proposal, root_token, branching, DraftMode.IID, rng, device, stop_below)


def _condition_gumbel(g_tilde: Tensor, parent_g: Tensor) -> Tensor:
    """Gumbels g_tilde [F, V] shifted so each row's maximum equals parent_g [F] (Kool et al. 2019,
    appendix B, numerically stable form). Monotone within a row, so it keeps the row's order."""
    z = g_tilde.max(-1, keepdim=True).values  # [F, 1]
    t = parent_g.unsqueeze(-1)  # [F, 1]
    u = t - g_tilde + torch.log1p(-torch.exp(g_tilde - z))
    return t - torch.relu(u) - torch.log1p(torch.exp(-u.abs()))


def draft_sbs(
    proposal: Proposal,
    root_token: int,
    beam_width: int,
    depth: int,
    rng: StepRandom,
    device: torch.device | str = "cpu",
    greedy: bool = False,
    stop_below: float = 0.0,
) -> DraftTree:
    """RSD-S: Stochastic Beam Search (Kool et al., 2019) as a draft tree.

    Each beam y carries its draft log-probability phi(y) and a perturbed value G(y): the maximum of
    Gumbel-perturbed log-probabilities over all its completions. Expanding y draws fresh Gumbels
    for every child, conditions them to have maximum G(y), and the W children with the largest G
    over all beams become the next beams. Prefixes that fall out of the top W are not expanded:
    they end as leaves above depth L (early truncation). A node's children, taken in descending G,
    are a Plackett-Luce (without-replacement) sample from its law, and whether a j-th child exists
    does not depend on its identity, which keeps recursive rejection sampling exact.
    greedy=True drops the noise: plain beam search on draft log-probabilities, for temperature 0.
    stop_below: stop after the first level where every beam was drawn with probability below it.
    """
    if beam_width < 1 or depth < 1:
        raise ValueError(f"beam_width and depth must be >= 1, got {beam_width} and {depth}")
    tree = _TreeBuilder(root_token, device)
    beams = [0]
    phi = g = own_probs = probs = None  # [F] each, on the laws' device: log p, perturbed value, own probability
    for level in range(depth):
        if level > 0 and stop_below > 0 and float(own_probs.max()) < stop_below:
            break
        probs = tree.propose(proposal, beams)  # [F, V]
        if level == 0:
            phi = g = torch.zeros(1, dtype=torch.float64, device=probs.device)
        values, ids = support(probs)  # [F, S]: the search runs over the support only (same law)
        phi_child = phi.unsqueeze(-1) + torch.log(values.to(torch.float64))  # [F, S]
        if greedy:
            g_child = phi_child
        else:
            node_idx = torch.tensor(beams, dtype=torch.long, device=probs.device)  # [F]
            noise = rng.gumbel(node_idx, ids, probs.shape[-1], level)  # [F, S], keyed by (beam node, token id)
            g_child = _condition_gumbel(phi_child + noise, g)  # [F, S]
        top = torch.topk(g_child.flatten(), min(beam_width, g_child.numel()))  # [<= W] over F * S
        keep_idx = top.indices[torch.isfinite(top.values)]  # [<= W] flat (row, column), descending G
        width = values.shape[-1]
        # Store children grouped by parent, each group in descending G (its sampling order).
        order = sorted(range(keep_idx.numel()), key=lambda i: (int(keep_idx[i]) // width, i))
        keep_idx = keep_idx[order]
        row_idx, col_idx = keep_idx // width, keep_idx % width  # [<= W] each
        child_ids = col_idx if ids is None else ids[row_idx, col_idx]
        beams = [tree.add(beams[int(f)], int(t)) for f, t in zip(row_idx, child_ids, strict=True)]
        own_probs = values[row_idx, col_idx]  # [F']
        phi, g = phi_child.flatten()[keep_idx], g_child.flatten()[keep_idx]  # [F'] each
    return tree.build(probs.shape[-1], probs.dtype)

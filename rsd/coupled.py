"""The coupled rule: the target samples each token with the very Gumbel noise the drafter drew its
children with, and accepts the child that carries it.

Drafter-invariant speculative decoding (Daliri, Musco and Suresh, 2024, arXiv 2408.07978) and its list
form, Gumbel-max list sampling (Rowan, Phan and Khisti, 2025, arXiv 2506.05632), on RSD's own trees.

SD and RSD-C draw a node's K children by Gumbel-Top-K: the K largest keys log p(v) + G(v), G i.i.d.
standard Gumbel over the vocabulary; RSD-S's Stochastic Beam Search orders each node's children by the
same keys. Gumbel-max says argmax_v log q(v) + G(v) is a sample from q, for any law q. So a verifier that
knows the drafter's G samples the target's token at a node with it,

    y = argmax_v log q(v) + G(v)        q: the target's law at the node, after every sampling transform

and descends into the child carrying y if there is one. Such a child exists exactly when y ranks among
the drafter's top K of log p + G: when p and q agree near the top, the orders do too, and each extra
sibling is one more chance. Nothing is compared with a uniform. The walk descends while y is a child;
it emits y where y is not (a correction token) or at a leaf (the bonus token).

The noise. Under this rule the drafter draws from Stream.COUPLED, whose Gumbel noise is keyed by the
absolute position of the token it picks and the token id, not by node (rsd.random.StepRandom.gumbel):
every node at one depth shares its position's noise G_t, and the verifier recomputes G_t from the
session's seed. Rule.draft_stream tells the drafter which stream to draw from. G = -log T for arrival
times T drawn in blocks (StepRandom.arrivals), so that the verifier draws only the few tokens that can win
(coupled_token), not the whole vocabulary.

Why it is exact, and more than exact. Induction on t: the token emitted at position t is
y_t = argmax_v log q(v | y_<t) + G_t(v), whatever was drafted: the walk takes y_t at the node of
position t - 1 on its path, child or not, and the tree only decides whether the step goes on to t + 1.
So the output is the target's own Gumbel-max sampling under the noise G_1, G_2, ...: token for token
what the target alone emits with those draws, for every draft model, shape, tree, step boundary and
pre-drafted or re-run step (tests/rsd/test_coupled.py checks this equality). Its law is the target's:
G_t is read only to pick position t (by the drafter for the children of the nodes there, by the
verifier for y_t), so it is independent of everything that fixed y_<t, and Gumbel-max gives y_t ~ q.
A drafter that drew other noise, or none, changes how much is accepted and never the output.

What it gains. At a node with K children it accepts with P(argmax(log q + G) in top-K(log p + G)).
For K = 1 that is below RRS's 1 - TV(p, q) (it is at least (1 - TV) / (1 + TV), Daliri et al.), so on
a chain RRS accepts more; with siblings it often beats recursive rejection without replacement, whose
later siblings are tested only against the residual: docs/algorithm.md has the toy figures and the real
pair's. Its law on one given tree is not a function of the tree and the laws (the tree was drawn with
the noise the rule reads), so rsd.acceptance.step_law does not apply; the equality test above is its
proof, together with the Gumbel-max lemma.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rsd.random import COUPLED_BLOCK, StepRandom, Stream
from rsd.tree import DraftTree

_HEAD = 32  # the most likely tokens, drawn first: their best T / q bounds the search


def coupled_token(q: Tensor, noise: StepRandom, depth: int) -> int:
    """argmax_v log q(v) + G(v) for the Gumbel noise G of Stream.COUPLED that picks the token after a node at
    `depth` (noise: the step's StepRandom of Stream.COUPLED): a sample from q [V], float64. It is
    argmin_v T(v) / q(v) for the arrivals T = exp(-G), the smallest id on a tie; a token of probability 0
    never wins.

    Only the tokens that can win are drawn. The head's best ratio r is attained; a token whose block's
    first arrival m already gives m / q(v) > r cannot reach it (T(v) >= m, StepRandom.arrivals), nor can a
    block with m / max q > r hold one. Only the rest, about COUPLED_BLOCK / q(head) tokens, draw their own
    T: the same token as drawing all V, for one draw per block and a pass over q.
    """
    head = torch.topk(q, min(_HEAD, q.numel())).indices  # [H]
    bound = (noise.arrivals(head, depth) / q[head]).min()  # T / 0 = inf: a token of probability 0 never wins
    short = -q.numel() % COUPLED_BLOCK  # a real vocabulary is often a multiple of 128: no copy
    blocks = (torch.nn.functional.pad(q, (0, short)) if short else q).reshape(-1, COUPLED_BLOCK)  # [B, 128]
    first, _ = noise.first_arrivals(torch.arange(blocks.shape[0], device=q.device), depth)  # [B]
    open_blocks = (first / blocks.amax(-1) <= bound).nonzero()[:, 0]  # [b]: no token of another can reach the bound
    rows, cols = (first[open_blocks, None] / blocks[open_blocks] <= bound).nonzero().unbind(-1)  # [C] each
    open_ = open_blocks[rows] * COUPLED_BLOCK + cols  # [C] token ids, the best among them
    ratio = noise.arrivals(open_, depth) / q[open_]  # [C]
    return int(open_[ratio == ratio.min()].min())


def coupled_walk(tree: DraftTree, target_law: Callable[[int], Tensor], noise: StepRandom) -> tuple[int, int]:
    """Walk `tree` from the root with the coupled rule. target_law(n): q at node n [V], float64, checked.
    noise: StepRandom(seed, Stream.COUPLED, the step's root position). -> (the last node accepted, the token
    emitted after it)."""
    if noise.stream is not Stream.COUPLED:
        raise ValueError(f"the coupled rule reads Stream.COUPLED's noise, got {noise.stream.name}")
    parents, tokens = tree.parent_idx.tolist(), tree.token_ids.tolist()
    node, depth = 0, 0
    while True:
        y = coupled_token(target_law(node), noise, depth)
        child = next((c for c in range(node + 1, len(parents)) if parents[c] == node and tokens[c] == y), None)
        if child is None:
            return node, y
        node, depth = child, depth + 1

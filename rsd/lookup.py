"""Context drafting: proposals looked up in the text itself (prompt lookup), no draft model.

Code and chat repeat their context: identifiers, call patterns, quoted lines. At a tree node whose context
(the committed tokens, then the node's path) ends with an n-gram seen earlier in that context, the proposal
law is the empirical law of the tokens that followed its earlier occurrences, for the longest n in
[min_n, max_n] that occurs (as vLLM's ngram proposer, llama.cpp's lookup decoding and SuffixDecoding
propose, but as a law rather than one continuation):

    context  a b c a b d a b        suffix "a b" occurred twice before, followed by c and d
    law      {c: 1/2, d: 1/2}       the node's children are drawn from it

Where no n-gram of length >= min_n recurs, the law is a zero row: no proposal, the node stays a leaf
(rsd.drafting.draft_tree), so a context without repeats costs a one-row verify, as the target alone.

Why every rule stays exact: the law is a function of the tokens alone, fixed before any child is drawn,
and the children are drawn from it like any draft law's (Gumbel-Top-K without replacement, top-K at T = 0;
a point mass gives one child). Its support misses most of the vocabulary, which the rules allow: a child
has p > 0 by construction, and a token outside the support is reached through the residual. For one
child x of a point mass, recursive rejection accepts x with probability q(x) and otherwise samples
q without x, renormalised: exactly a draw from q. tests/rsd/test_lookup.py enumerates it.

Cost: a few vector compares over the context per node, no model forward; the verifier's tree rows are
the whole price, which is why a node is proposed only where the context repeats.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rsd.tree import path_to

MIN_N, MAX_N = 2, 4  # defaults: 1-grams recur everywhere (a broad, weak law), longer n-grams rarely


def continuation_law(context: Tensor, vocab_size: int, min_n: int = MIN_N, max_n: int = MAX_N) -> Tensor:
    """[V] float64: the law of the token after `context` [T] (int64) looked up in the context itself, for
    the longest n in [min_n, max_n] whose suffix n-gram occurred before (counts of what followed each
    earlier occurrence, normalised); all zeros when none occurred."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}")
    law = torch.zeros(vocab_size, dtype=torch.float64, device=context.device)
    t = int(context.shape[0])
    for n in range(min(max_n, t - 1), min_n - 1, -1):
        windows = context.unfold(0, n, 1)[: t - n]  # [T - n, n]: the windows that have a next token
        hits = (windows == context[t - n :]).all(-1)  # [T - n]
        if bool(hits.any()):
            followers = context[n:][hits]  # [H]: the token after each earlier occurrence
            law.index_add_(0, followers, torch.ones_like(followers, dtype=torch.float64))
            return law / law.sum()
    return law


class LookupProposal:
    """rsd.drafting.Proposal over the context: the law at a node is continuation_law(committed + path)."""

    def __init__(self, committed: list[int], vocab_size: int, min_n: int = MIN_N, max_n: int = MAX_N):
        self.committed = torch.tensor(committed, dtype=torch.long)  # [T]; committed[-1] is the tree's root
        self.vocab_size, self.min_n, self.max_n = vocab_size, min_n, max_n
        self.num_forwards = 0  # no model ran: the drafter's runner stays where it was (rsd_runtime.engines)
        self.tentative_of: dict[int, int] = {}

    def __call__(self, token_ids: Tensor, parent_idx: Tensor, node_idx: Tensor) -> Tensor:
        rows = []
        for n in node_idx.tolist():
            path = token_ids[path_to(parent_idx, n)].to(self.committed.device)  # [depth]
            context = torch.cat([self.committed, path])
            rows.append(continuation_law(context, self.vocab_size, self.min_n, self.max_n))
        return torch.stack(rows)  # [F, V]

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


def continuation(context: Tensor, vocab_size: int, min_n: int = MIN_N, max_n: int = MAX_N) -> tuple[Tensor, int]:
    """(law [V] float64, n): the law of the token after `context` [T] (int64) looked up in the context itself,
    for the longest n in [min_n, max_n] whose suffix n-gram occurred before (counts of what followed each
    earlier occurrence, normalised), and that n; (all zeros, 0) when none occurred."""
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
            return law / law.sum(), n
    return law, 0


def continuation_law(context: Tensor, vocab_size: int, min_n: int = MIN_N, max_n: int = MAX_N) -> Tensor:
    """[V] float64: continuation's law alone."""
    return continuation(context, vocab_size, min_n, max_n)[0]


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


class HybridProposal:
    """A model's tree with context lookups merged in (`--lookup-n N`): at a node whose context ends with an
    n-gram of N or more tokens seen before, the law is the context's (continuation); everywhere else the
    model's. The choice is a function of the node's context alone, made before any child of it is drawn, so
    every rule stays exact, as with any draft law; a looked-up node costs no draft forward (the model runs it
    only as the ancestor of a node that needs the model: rsd_runtime.engines.ModelProposal).

    model: the draft model's Proposal (with num_forwards and tentative_of); dtype, device: its laws' (the
    looked-up rows are cast to them before any child is drawn, so the law sent is the law drawn from)."""

    def __init__(self, model, committed: list[int], vocab_size: int, lookup_n: int, dtype, device, max_n: int = MAX_N):
        if lookup_n < 1:
            raise ValueError(f"lookup_n must be at least 1, got {lookup_n}")
        self.model, self.vocab_size, self.dtype, self.device = model, vocab_size, dtype, device
        self.committed = torch.tensor(committed, dtype=torch.long)  # [T]
        self.min_n, self.max_n = lookup_n, max(max_n, lookup_n)
        self.looked_up = 0  # nodes whose law came from the context

    @property
    def num_forwards(self) -> int:
        return self.model.num_forwards

    @property
    def tentative_of(self) -> dict[int, int]:
        return self.model.tentative_of

    def law(self, *args) -> Tensor:
        """The model's law from its logits (the pre-drafter ranks outcomes by it)."""
        return self.model.law(*args)

    def __call__(self, token_ids: Tensor, parent_idx: Tensor, node_idx: Tensor) -> Tensor:
        nodes = node_idx.tolist()
        rows: list[Tensor | None] = []
        for n in nodes:
            context = torch.cat([self.committed, token_ids[path_to(parent_idx, n)].to(self.committed.device)])
            law, found = continuation(context, self.vocab_size, self.min_n, self.max_n)
            rows.append(law.to(self.device, self.dtype) if found else None)
        self.looked_up += sum(r is not None for r in rows)
        need = [i for i, r in enumerate(rows) if r is None]
        if need:
            model_rows = self.model(token_ids, parent_idx, node_idx[need])  # [len(need), V]
            for i, row in zip(need, model_rows, strict=True):
                rows[i] = row.to(self.dtype)
        return torch.stack(rows)  # [F, V]

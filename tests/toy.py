"""Toy next-token tables and exact tree-law enumeration, for the exactness proofs.

A toy model is a function prefix (tuple of token ids after the root) -> probs [V] in float64.
`tree_law(...)` enumerates every tree a drafting strategy can produce with its exact probability,
so that sum over trees of P(tree) * step_law(tree) is the exact law of one speculative step.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor

from rsd.acceptance import Rule, step_law
from rsd.drafting import DraftMode
from rsd.sampling import truncate
from rsd.tree import DraftTree, path_to

Table = Callable[[tuple[int, ...]], Tensor]


def random_table(seed: int, vocab: int, support: int | None = None, zeros: tuple[int, ...] = ()) -> Table:
    """A deterministic random law per prefix. `support` keeps only that many tokens (chosen per
    prefix); `zeros` are tokens that never have mass."""

    @cache
    def table(prefix: tuple[int, ...]) -> Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, prefix)).encode()))
        probs = torch.rand(vocab, generator=g, dtype=torch.float64) ** 2 + 0.02
        probs[list(zeros)] = 0
        if support is not None:
            keep = torch.randperm(vocab, generator=g)[:support]
            probs = torch.zeros_like(probs).index_copy_(0, keep, probs[keep])
            if probs.sum() == 0:
                probs[keep[0]] = 1
        return probs / probs.sum()

    return table


def transformed(table: Table, top_k: int = 0, top_p: float = 1.0) -> Table:
    return cache(lambda prefix: truncate(table(prefix), top_k, top_p))


def greedy_table(table: Table) -> Table:
    def onehot(prefix: tuple[int, ...]) -> Tensor:
        probs = table(prefix)
        return torch.zeros_like(probs).scatter_(0, probs.argmax().view(1), 1.0)

    return onehot


class TableProposal:
    """A Proposal (rsd.drafting) backed by a table: the law at a node is table(path to node)."""

    def __init__(self, table: Table):
        self.table = table

    def __call__(self, token_ids: Tensor, parent_idx: Tensor, node_idx: Tensor) -> Tensor:
        return torch.stack([self.table(path_tokens(token_ids, parent_idx, int(n))) for n in node_idx])


def path_tokens(token_ids: Tensor, parent_idx: Tensor, node: int) -> tuple[int, ...]:
    return tuple(int(token_ids[i]) for i in path_to(parent_idx, node))


def target_probs_for(tree: DraftTree, table: Table) -> Tensor:
    """q at every node of the tree: [N, V]."""
    return torch.stack([table(path_tokens(tree.token_ids, tree.parent_idx, n)) for n in range(tree.num_nodes)])


# ---- exact tree laws -------------------------------------------------------------------------


def _ordered_samples(probs: Tensor, k: int, mode: DraftMode) -> list[tuple[tuple[int, ...], float]]:
    """Every ordered outcome of drawing a node's children, with its probability."""
    support = probs.nonzero().flatten().tolist()
    if mode is DraftMode.GREEDY:
        top = torch.topk(probs, min(k, len(probs)))
        return [(tuple(t for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True) if v > 0), 1.0)]
    if mode is DraftMode.IID:
        return [(xs, float(torch.prod(probs[list(xs)]))) for xs in itertools.product(support, repeat=k)]
    out = []  # without replacement: Plackett-Luce
    for xs in itertools.permutations(support, min(k, len(support))):
        prob, used = 1.0, 0.0
        for x in xs:
            prob *= float(probs[x]) / (1.0 - used)
            used += float(probs[x])
        out.append((xs, prob))
    return out


def _make_tree(tokens: list[int], parents: list[int], table: Table, vocab: int) -> DraftTree:
    token_ids, parent_idx = torch.tensor(tokens), torch.tensor(parents)
    draft = torch.zeros(len(tokens), vocab, dtype=torch.float64)
    for n in set(parents[1:]):
        draft[n] = table(path_tokens(token_ids, parent_idx, n))
    return DraftTree(token_ids, parent_idx, draft)


def branching_tree_law(
    table: Table, vocab: int, branching: list[int], mode: DraftMode
) -> list[tuple[DraftTree, float]]:
    """Every tree rsd.drafting.draft_tree can build, with its probability, nodes in its BFS order."""
    out = []

    def grow(tokens, parents, depths, queue, prob):
        if not queue:
            return out.append((_make_tree(tokens, parents, table, vocab), prob))
        node, rest = queue[0], queue[1:]
        if depths[node] == len(branching):
            return grow(tokens, parents, depths, rest, prob)
        path = path_tokens(torch.tensor(tokens), torch.tensor(parents), node)
        for xs, px in _ordered_samples(table(path), branching[depths[node]], mode):
            new = list(range(len(tokens), len(tokens) + len(xs)))
            grow(
                tokens + list(xs),
                parents + [node] * len(xs),
                depths + [depths[node] + 1] * len(xs),
                rest + new,
                prob * px,
            )

    grow([0], [-1], [0], [0], 1.0)
    return out


def sbs_tree_law(table: Table, vocab: int, beam_width: int, depth: int) -> list[tuple[DraftTree, float]]:
    """Every tree rsd.drafting.draft_sbs can build, with its probability.

    SBS keeps at each depth d the W prefixes with the largest perturbed values, and a prefix's value
    is the largest perturbed log-probability among its complete sequences. So the tree is read off
    the Plackett-Luce order of complete sequences: at depth d, the first W distinct prefixes to
    appear, children in order of appearance. Sequences that can no longer change the tree are
    skipped: by Luce's choice axiom the next *relevant* sequence is drawn with probability
    proportional to its own mass among the relevant ones.
    """
    seqs = {}
    for s in itertools.product(range(vocab), repeat=depth):
        prob = 1.0
        for d in range(depth):
            prob *= float(table(s[:d])[s[d]])
        if prob > 0:
            seqs[s] = prob
    num_prefixes = [len({s[:d] for s in seqs}) for d in range(depth + 1)]
    out: dict[tuple, float] = {}  # the same tree arises from many orders: keep each once

    def relevant(s, seen):
        return any(
            len(seen[d]) < min(beam_width, num_prefixes[d]) and s[:d] not in seen[d] for d in range(1, depth + 1)
        )

    def draw(remaining, seen, prob):
        cands = [s for s in remaining if relevant(s, seen)]
        if not cands:
            key = tuple(tuple(level) for level in seen)
            out[key] = out.get(key, 0.0) + prob
            return None
        mass = sum(seqs[s] for s in cands)
        for s in cands:
            new_seen = [list(level) for level in seen]
            for d in range(1, depth + 1):
                if len(new_seen[d]) < beam_width and s[:d] not in new_seen[d]:
                    new_seen[d].append(s[:d])
            draw(remaining - {s}, new_seen, prob * seqs[s] / mass)

    draw(frozenset(seqs), [[()]] + [[] for _ in range(depth)], 1.0)
    return [(_sbs_tree([list(level) for level in key], table, vocab, depth), p) for key, p in out.items()]


def _sbs_tree(seen: list[list[tuple[int, ...]]], table: Table, vocab: int, depth: int) -> DraftTree:
    tokens, parents, index, level = [0], [-1], {(): 0}, [()]
    for d in range(1, depth + 1):
        next_level = []
        for parent in level:  # parents in node order, children in order of appearance
            for prefix in seen[d]:
                if prefix[:-1] == parent:
                    index[prefix] = len(tokens)
                    tokens.append(prefix[-1])
                    parents.append(index[parent])
                    next_level.append(prefix)
        level = next_level
    return _make_tree(tokens, parents, table, vocab)


def confidence_cut(trees: list[tuple[DraftTree, float]], tau: float, per: str) -> list[tuple[DraftTree, float]]:
    """The trees of a strategy with the confidence stop of rsd.drafting, with their probabilities:
    per="node": a node drawn with probability < tau (its entry in its parent's law) keeps no children;
    per="level" (RSD-S): everything below the first level where every node is below tau is cut.
    The stop only decides whether children are drawn, so the cut of the untruncated tree has the
    law of what the drafter builds (tests/test_statistical.py checks this against the code)."""
    out = []
    for tree, prob in trees:
        tokens, parents = tree.token_ids.tolist(), tree.parent_idx.tolist()
        own = [1.0] + [float(tree.draft_probs[parents[n], tokens[n]]) for n in range(1, len(tokens))]
        depth = [0] * len(tokens)
        for n in range(1, len(tokens)):
            depth[n] = depth[parents[n]] + 1
        if per == "node":
            kept = [0]
            for n in range(1, len(tokens)):  # BFS order: a parent is decided before its children
                if parents[n] in kept and own[parents[n]] >= tau:
                    kept.append(n)
        else:
            cut = next(
                (d for d in range(1, max(depth) + 1) if max(own[n] for n in range(len(tokens)) if depth[n] == d) < tau),
                max(depth),
            )
            kept = [n for n in range(len(tokens)) if depth[n] <= cut]
        index = {n: i for i, n in enumerate(kept)}
        has_children = {parents[n] for n in kept[1:]}
        draft = torch.stack(
            [tree.draft_probs[n] if n in has_children else torch.zeros_like(tree.draft_probs[n]) for n in kept]
        )
        new_parents = torch.tensor([-1] + [index[parents[n]] for n in kept[1:]])
        out.append((DraftTree(tree.token_ids[kept], new_parents, draft), prob))
    return out


# ---- laws of emitted text ----------------------------------------------------------------------


def speculative_law(trees: list[tuple[DraftTree, float]], target: Table, rule: Rule, length: int) -> dict:
    """Law of the first `length` tokens: one speculative step, then plain target sampling."""
    law: dict[tuple[int, ...], float] = {}
    for tree, p_tree in trees:
        for emitted, p in step_law(tree, target_probs_for(tree, target), rule).items():
            for seq, p_rest in extend(emitted, target, length).items():
                law[seq] = law.get(seq, 0.0) + p_tree * p * p_rest
    return law


def extend(prefix: tuple[int, ...], target: Table, length: int) -> dict[tuple[int, ...], float]:
    """Law of completing (or cutting) prefix to `length` tokens by sampling from the target."""
    if len(prefix) >= length:
        return {prefix[:length]: 1.0}
    out = {}
    probs = target(prefix)
    for y in probs.nonzero().flatten().tolist():
        for seq, p in extend((*prefix, y), target, length).items():
            out[seq] = out.get(seq, 0.0) + float(probs[y]) * p
    return out


def max_abs_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))

"""Presence, frequency and repetition penalties (OpenAI's and vLLM's), per draft-tree node.

A penalty makes the next-token law depend on which tokens came before, so inside a draft tree the law
at node n depends on the tokens on the path root -> n: they are output tokens once accepted. Exactness
needs the draft law at n and the target law at n to be the penalised laws *of that path*; both sides
compute them here, from the session's tokens plus the path's draft tokens (docs/algorithm.md).

The transform (vLLM's apply_penalties; rsd.sampling applies it after logit_bias, before temperature):
    repetition_penalty r (> 0, 1 = off), over tokens of the prompt or the output:
        logit / r where logit > 0, logit * r where logit <= 0
    frequency_penalty f and presence_penalty p (in [-2, 2], 0 = off), over output tokens only:
        logit - f * count - p * (count > 0)
"Output" is what the current turn (request) generated: committed tokens from `output_start` on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rsd.tree import tree_attention_mask


@dataclass(frozen=True)
class Penalties:
    """The penalty parameters (defaults: off). Validated by rsd.sampling.SamplingParams, which holds them."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    @property
    def on(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


@dataclass(frozen=True)
class TokenCounts:
    """What the penalties read at F rows (tree nodes), over the U distinct tokens that occur at all (the
    penalties leave every other logit as it is, so a row costs U entries, not V):
        token_ids      [U]     int64, increasing
        seen_mask      [F, U]  bool: in the prompt or the output before the row's node
        output_counts  [F, U]  int64: times generated before it (the output)
    """

    token_ids: Tensor
    seen_mask: Tensor
    output_counts: Tensor


def session_counts(committed_ids: list[int], output_start: int, device=None) -> TokenCounts:
    """The counts after the committed tokens, one row [1, U]; committed_ids[output_start:] are output."""
    if not 0 <= output_start <= len(committed_ids):
        raise ValueError(f"output_start {output_start} outside [0, {len(committed_ids)}]")
    ids = torch.tensor(committed_ids, dtype=torch.long, device=device)  # [T]
    token_ids, col = torch.unique(ids, return_inverse=True)  # [U], [T]
    counts = torch.bincount(col[output_start:], minlength=token_ids.shape[0])[None]  # [1, U]
    return TokenCounts(token_ids, torch.ones_like(counts, dtype=torch.bool), counts)


def node_counts(session: TokenCounts, token_ids: Tensor, parent_idx: Tensor, node_idx: Tensor) -> TokenCounts:
    """The counts at nodes node_idx [F] of a tree (token_ids, parent_idx) [N] whose root is the last committed
    token: the session's plus the draft tokens on the path root -> node (node included, root excluded: it is
    committed already). One row per node [F, U'], U' the session's tokens and the tree's, on the session's device."""
    device = session.token_ids.device
    path_ids = token_ids[1:].to(device)  # [N-1]
    union = torch.unique(torch.cat([session.token_ids, path_ids]))  # [U']
    on_path = tree_attention_mask(parent_idx.cpu())[node_idx.cpu(), 1:].to(device)  # [F, N-1] ancestors or self
    num_rows, old_col = on_path.shape[0], torch.searchsorted(union, session.token_ids)  # [U]
    counts = torch.zeros(num_rows, union.shape[0], dtype=torch.long, device=device)  # [F, U']
    counts[:, old_col] = session.output_counts
    counts.scatter_add_(1, torch.searchsorted(union, path_ids).expand(num_rows, -1), on_path.long())
    seen = torch.zeros_like(counts, dtype=torch.bool)
    seen[:, old_col] = session.seen_mask
    return TokenCounts(union, seen | (counts > 0), counts)


def penalised(logits: Tensor, penalties: Penalties, counts: TokenCounts) -> Tensor:
    """logits [F, V] (float) after the penalties at F rows with these counts [F, U]; a new tensor."""
    cols = counts.token_ids  # [U]
    x = logits[:, cols]  # [F, U]
    if penalties.repetition != 1:
        r = penalties.repetition
        x = torch.where(counts.seen_mask, torch.where(x > 0, x / r, x * r), x)
    c = counts.output_counts.to(x.dtype)  # [F, U]
    x = x - penalties.frequency * c - penalties.presence * (c > 0).to(x.dtype)
    logits = logits.clone()
    logits[:, cols] = x
    return logits


def counts_at(
    penalties: Penalties,
    committed_ids: list[int],
    output_start: int | None,
    token_ids: Tensor,
    parent_idx: Tensor,
    node_idx: Tensor,
    device=None,
) -> TokenCounts | None:
    """node_counts at nodes node_idx [F] of the tree (token_ids, parent_idx) [N] drafted after committed_ids,
    whose output starts at output_start; None when the penalties are off (nothing to count)."""
    if not penalties.on:
        return None
    if output_start is None:  # guessing it would penalise the wrong tokens: a bug in the caller, refused
        raise ValueError("penalties need the position where the output starts (output_start)")
    return node_counts(session_counts(committed_ids, output_start, device), token_ids, parent_idx, node_idx)

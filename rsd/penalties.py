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
    """What the penalties read at F rows (tree nodes): seen_mask [F, V] bool (in the prompt or the output)
    and output_counts [F, V] (times each token was generated)."""

    seen_mask: Tensor
    output_counts: Tensor


def session_counts(committed_ids: list[int], output_start: int, vocab_size: int, device=None) -> TokenCounts:
    """The counts after the committed tokens, one row [1, V]; committed_ids[output_start:] are output."""
    if not 0 <= output_start <= len(committed_ids):
        raise ValueError(f"output_start {output_start} outside [0, {len(committed_ids)}]")
    ids = torch.tensor(committed_ids, dtype=torch.long, device=device)  # [T]
    seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
    seen[0, ids] = True
    counts = torch.bincount(ids[output_start:], minlength=vocab_size)[None]  # [1, V] int64
    return TokenCounts(seen, counts)


def node_counts(session: TokenCounts, token_ids: Tensor, parent_idx: Tensor, node_idx: Tensor) -> TokenCounts:
    """The counts at nodes node_idx [F] of a tree (token_ids, parent_idx) [N] whose root is the last committed
    token: the session's plus the draft tokens on the path root -> node (node included, root excluded: it is
    committed already). One row per node [F, V], on the session counts' device."""
    device = session.output_counts.device
    on_path = tree_attention_mask(parent_idx.cpu())[node_idx.cpu(), 1:].to(device)  # [F, N-1] ancestors or self
    num_rows = on_path.shape[0]
    path_ids = token_ids[1:].to(device).expand(num_rows, -1)  # [F, N-1]
    counts = session.output_counts.expand(num_rows, -1).clone()  # [F, V]
    counts.scatter_add_(1, path_ids, on_path.to(counts.dtype))
    seen = session.seen_mask | (counts > 0)  # [F, V]
    return TokenCounts(seen, counts)


def penalised(logits: Tensor, penalties: Penalties, counts: TokenCounts) -> Tensor:
    """logits [F, V] (float) after the penalties at F rows with these counts [F, V]; a new tensor."""
    if penalties.repetition != 1:
        r = penalties.repetition
        logits = torch.where(counts.seen_mask, torch.where(logits > 0, logits / r, logits * r), logits)
    elif penalties.on:
        logits = logits.clone()
    c = counts.output_counts.to(logits.dtype)  # [F, V]
    if penalties.frequency:
        logits -= penalties.frequency * c
    if penalties.presence:
        logits -= penalties.presence * (c > 0).to(logits.dtype)
    return logits


def counts_at(
    penalties: Penalties,
    committed_ids: list[int],
    output_start: int | None,
    token_ids: Tensor,
    parent_idx: Tensor,
    node_idx: Tensor,
    vocab_size: int,
    device=None,
) -> TokenCounts | None:
    """node_counts at nodes node_idx [F] of the tree (token_ids, parent_idx) [N] drafted after committed_ids,
    whose output starts at output_start; None when the penalties are off (nothing to count)."""
    if not penalties.on:
        return None
    if output_start is None:  # guessing it would penalise the wrong tokens: a bug in the caller, refused
        raise ValueError("penalties need the position where the output starts (output_start)")
    session = session_counts(committed_ids, output_start, vocab_size, device)
    return node_counts(session, token_ids, parent_idx, node_idx)

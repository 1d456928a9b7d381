"""The target's log-probabilities of the tokens a step emits (OpenAI's `logprobs` / `top_logprobs`).

What they are: vLLM's default (`logprobs_mode="raw_logprobs"`), log_softmax of the target's own logits at the
position where the token was emitted, before logit_bias, temperature, top-k and top-p. So they do not depend on
the sampling params (at temperature 0 too: the greedy token gets its model log-probability, not 0), nor on the
draft: a token's logits are the target's at its prefix, whichever tree node carried them.

Where they come from: the verifier's one forward already holds them. Token j of a step's
[*accepted_ids, next_token] was emitted at the parent of accepted node j: the root for the first, the last
accepted node for the correction or bonus token (`emitted_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """M tokens' log-probabilities and, for each, the k most likely tokens at its position (most likely first)."""

    logprobs: Tensor  # [M] float32
    top_ids: Tensor  # [M, k] int64
    top_logprobs: Tensor  # [M, k] float32

    def __len__(self) -> int:
        return self.logprobs.shape[0]

    def head(self, n: int) -> TokenLogprobs:
        """The first n tokens' (a step cut at max_new_tokens or after an EOS)."""
        return TokenLogprobs(self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])


def emitted_rows(accepted_idx: list[int]) -> list[int]:
    """The tree nodes whose logits give the law of a step's tokens [*accepted, next]: [0, *accepted_idx]."""
    return [0, *accepted_idx]


def token_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> TokenLogprobs:
    """logits [M, V] (the rows the tokens were emitted at), token_ids [M] -> their raw log-probabilities and the
    num_top (0..MAX_TOP_LOGPROBS) most likely tokens of each row, on the CPU."""
    if logits.dim() != 2 or token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"token_logprobs takes logits [M, V] and token_ids [M], got {list(logits.shape)} and "
            f"{list(token_ids.shape)}"
        )
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)  # [M, k] each
    chosen = logprobs.gather(-1, token_ids.to(logprobs.device, torch.int64)[:, None])[:, 0]  # [M]
    return TokenLogprobs(chosen.cpu(), top.indices.cpu(), top.values.cpu())

"""The target's log-probabilities of the tokens a step emits (OpenAI's `logprobs` / `top_logprobs`).

What they are: one of vLLM's four `logprobs_mode`s (its engine argument; here per request, GenerationParams
.logprobs_mode, with the gateway's --logprobs-mode as the default):
    raw_logprobs        (the default, as in vLLM) log_softmax of the target's own logits at the position the
                        token was emitted at, before the constraint mask, logit_bias, the penalties, temperature,
                        top-k and top-p. It does not depend on the sampling params (at temperature 0 either: the
                        greedy token gets its model log-probability), nor on the draft.
    raw_logits          the target's own logits there.
    processed_logprobs  log of the target law the token was sampled from: the logits after the constraint mask,
                        logit_bias and the penalties (those of the token's own path), softmax at the temperature,
                        cut by top-k and top-p (-inf outside what is left). At temperature 0 that law is the
                        argmax's point mass, so, as vLLM's greedy path, temperature, top-k and top-p are skipped:
                        log_softmax of the masked, biased, penalised logits (the emitted token is their argmax).
    processed_logits    those logits: masked, biased and penalised, divided by the temperature (T > 0), -inf
                        where the law has no mass; at temperature 0 not divided and not cut.
A token's figures are the same whichever tree node carried it: its logits are the target's at its prefix.

Where they come from: the verifier's one forward already holds them, and the processed ones are read off the law
tensors it verifies with (`law_scores`). Token j of a step's [*accepted_ids, next_token] was emitted at the
parent of accepted node j: the root for the first, the last accepted node for the correction or bonus token
(`emitted_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs

RAW_LOGPROBS, RAW_LOGITS = "raw_logprobs", "raw_logits"
PROCESSED_LOGPROBS, PROCESSED_LOGITS = "processed_logprobs", "processed_logits"
LOGPROBS_MODES = (RAW_LOGPROBS, RAW_LOGITS, PROCESSED_LOGPROBS, PROCESSED_LOGITS)  # vLLM's LogprobsMode values


def check_mode(mode: str) -> str:
    """mode, or ValueError unless it is one of LOGPROBS_MODES."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    return mode


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


def law_scores(
    mode: str, raw_logits: Tensor, processed_logits: Tensor, law_probs: Tensor, temperature: float
) -> Tensor:
    """The figures of `mode` at M rows, float32 [M, V]: raw_logits (the target's), processed_logits (after the
    constraint mask, logit_bias and the penalties; rsd.sampling.biased_logits) and law_probs (the law sampled
    from: rsd.sampling.law_of(processed_logits)), each [M, V]. See the module docstring."""
    check_mode(mode)
    if mode == RAW_LOGITS:
        return raw_logits.float()
    if mode == RAW_LOGPROBS:
        return torch.log_softmax(raw_logits.float(), dim=-1)
    greedy = temperature == 0
    if mode == PROCESSED_LOGPROBS:
        return torch.log_softmax(processed_logits.float(), dim=-1) if greedy else law_probs.float().log()
    if greedy:
        return processed_logits.float()
    return (processed_logits.float() / temperature).masked_fill(law_probs == 0, float("-inf"))


def token_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> TokenLogprobs:
    """logits [M, V] (the rows the tokens were emitted at), token_ids [M] -> their raw log-probabilities and the
    num_top (0..MAX_TOP_LOGPROBS) most likely tokens of each row, on the CPU."""
    return token_scores(torch.log_softmax(logits.float(), dim=-1), token_ids, num_top)


def token_scores(scores: Tensor, token_ids: Tensor, num_top: int) -> TokenLogprobs:
    """scores [M, V] (law_scores at the rows the tokens were emitted at), token_ids [M] -> each token's score and
    the num_top (0..MAX_TOP_LOGPROBS) highest of each row, on the CPU."""
    if scores.dim() != 2 or token_ids.shape != scores.shape[:1]:
        raise ValueError(
            f"token_logprobs takes logits [M, V] and token_ids [M], got {list(scores.shape)} and "
            f"{list(token_ids.shape)}"
        )
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}")
    scores = scores.float()
    top = torch.topk(scores, min(num_top, scores.shape[-1]), dim=-1)  # [M, k] each
    chosen = scores.gather(-1, token_ids.to(scores.device, torch.int64)[:, None])[:, 0]  # [M]
    return TokenLogprobs(chosen.cpu(), top.indices.cpu(), top.values.cpu())

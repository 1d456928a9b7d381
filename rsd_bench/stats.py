"""Sampling error of the benchmark's block efficiencies: a percentile bootstrap over steps.

Block efficiency is new tokens / target calls, i.e. the mean of the tokens each target call (step)
emitted, so its 95% interval resamples the steps (pooled over prompts) with replacement. Steps of
one generation are not independent, so the interval is a lower bound on the true uncertainty when a
row holds few prompts; the per-prompt block efficiencies in the JSON allow a prompt-level check.
"""

from __future__ import annotations

import random
import statistics

BOOTSTRAP_RESAMPLES = 1000  # rsd bench methods --bootstrap; the disaggregated bench has its own default


def bootstrap_interval(per_step: list[int], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list[float]:
    """95% percentile interval of the mean of per_step (tokens per step) over `resamples` resamples."""
    if not per_step:
        return [float("nan"), float("nan")]
    rng, n = random.Random(seed), len(per_step)
    means = sorted(statistics.fmean(rng.choices(per_step, k=n)) for _ in range(resamples))
    return [round(means[int(0.025 * resamples)], 3), round(means[min(int(0.975 * resamples), resamples - 1)], 3)]


def step_tokens(marks: list[int], new_tokens: int) -> list[int]:
    """Tokens each step emitted: the verifier's counts per target call (marks), the last ones cut so
    that they sum to the tokens the generation kept (its max-new-tokens or EOS cut)."""
    out, left = [], new_tokens
    for n in marks:
        out.append(min(n, left))
        left -= out[-1]
    return out

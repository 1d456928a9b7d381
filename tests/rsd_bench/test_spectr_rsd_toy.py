"""The toy SpecTr-vs-RSD-S report's machinery (rsd_bench/spectr_rsd_toy.py, rsd_bench/pair_divergence.py)."""

import pytest
import torch

from rsd_bench.pair_divergence import law_stats
from rsd_bench.spectr_rsd_toy import CODE_LIKE, exact_tokens_per_step, mc_tokens_per_step, pair


@pytest.mark.parametrize("method", ["spectr", "rsd_s"])
def test_a_draft_equal_to_the_target_is_always_accepted(method):
    draft, target = pair(3, 2.0, 0.0, 1.0)  # sigma 0: the same law on both sides
    assert exact_tokens_per_step(method, 2, 2, draft, target, 3, contexts=1) == pytest.approx(3.0)
    mc = mc_tokens_per_step(method, 2, 3, *pair(8, 2.0, 0.0, 1.0), steps=20)
    assert mc["mean"] == 4.0 and mc["bonus_full"] == 1.0 and mc["nodes"] == 6


def test_a_disagreeing_draft_loses_tokens_and_rsd_s_never_repeats_a_prefix():
    draft, target = pair(8, 0.0, 0.0, 1.0, mix=CODE_LIKE)
    spectr, rsd_s = (mc_tokens_per_step(m, 3, 3, draft, target, steps=60) for m in ("spectr", "rsd_s"))
    for mc in (spectr, rsd_s):
        assert 1 <= mc["mean"] < 4 and mc["bonus_full"] + mc["leaf_above_depth"] + mc["rejected"] == pytest.approx(1)
    assert rsd_s["distinct"] == rsd_s["nodes"] == 9 and spectr["distinct"] < 9 and spectr["leaf_above_depth"] == 0


def test_law_stats():
    q = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    stats = law_stats(q, p)
    assert stats["tv"] == [0.0, 1.0] and stats["target_top1"] == [0.5, 1.0]
    assert stats["target_mass_on_draft_top1"] == [0.5, 0.0]

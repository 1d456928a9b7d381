"""rsd.logprobs: the target's raw log-probabilities of emitted tokens, read off the verifier's logits."""

import pytest
import torch

from rsd.logprobs import LOGPROBS_MODES, MAX_TOP_LOGPROBS, check_mode, emitted_rows, law_scores, token_logprobs
from rsd.sampling import SamplingParams, biased_logits, law_of


def test_token_logprobs_are_log_softmax_and_its_top_k():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3  # [M, V]
    tokens = torch.tensor([5, 17, 299, 0])
    lp = token_logprobs(logits, tokens, 5)
    want = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(lp.logprobs.double(), want[torch.arange(4), tokens], atol=1e-5)
    assert torch.equal(lp.top_ids, want.topk(5, -1).indices)
    assert torch.allclose(lp.top_logprobs.double(), want.topk(5, -1).values, atol=1e-5)
    assert (lp.logprobs.dtype, lp.top_ids.dtype, lp.top_ids.shape) == (torch.float32, torch.int64, (4, 5))
    head = lp.head(2)
    assert len(head) == 2 and torch.equal(head.top_ids, lp.top_ids[:2])
    assert token_logprobs(logits, tokens, 0).top_ids.shape == (4, 0)
    assert token_logprobs(logits.bfloat16(), tokens, 1).logprobs.dtype == torch.float32


def test_emitted_rows_are_the_root_then_the_accepted_path():
    # tokens [a1, a2, next]: a1 drawn at the root, a2 at a1's node, next at a2's node
    assert emitted_rows([2, 5]) == [0, 2, 5]
    assert emitted_rows([]) == [0]


def test_token_logprobs_refuse_bad_input():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="top_logprobs"):
        token_logprobs(logits, torch.tensor([0, 1]), MAX_TOP_LOGPROBS + 1)
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(logits, torch.tensor([0]), 1)


@pytest.mark.parametrize("params", [SamplingParams(0, logit_bias=((3, 2.0),)), SamplingParams(0.7, 10, 0.8)])
def test_law_scores_of_each_mode(params):
    """raw: the logits and their log_softmax; processed: the law sampled from (its log; logits / T cut to its
    support), and at T = 0 the processed logits untouched by temperature, top-k and top-p."""
    raw = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 2  # [M, V]
    processed = biased_logits(raw, params)
    law = law_of(processed, params)
    t = params.temperature
    assert torch.equal(law_scores("raw_logits", raw, processed, law, t), raw)
    assert torch.allclose(law_scores("raw_logprobs", raw, processed, law, t), torch.log_softmax(raw, -1))
    lp = law_scores("processed_logprobs", raw, processed, law, t)
    logits = law_scores("processed_logits", raw, processed, law, t)
    if params.greedy:
        assert torch.allclose(lp, torch.log_softmax(processed, -1)) and torch.equal(logits, processed)
        assert torch.equal(lp.argmax(-1), law.argmax(-1))  # the greedy token is the most likely
    else:
        assert torch.equal(torch.isinf(lp), law == 0) and torch.equal(torch.isinf(logits), law == 0)
        assert torch.allclose(lp.exp(), law, atol=1e-6)
        assert torch.allclose(torch.log_softmax(logits, -1).exp(), law, atol=1e-6)  # the same law


def test_unknown_logprobs_mode_is_refused_by_name():
    assert [check_mode(m) for m in LOGPROBS_MODES] == list(LOGPROBS_MODES)
    with pytest.raises(ValueError, match=r"logprobs_mode: must be one of raw_logprobs, .*got 'processed'"):
        check_mode("processed")

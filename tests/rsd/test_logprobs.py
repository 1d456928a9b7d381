"""rsd.logprobs: the target's raw log-probabilities of emitted tokens, read off the verifier's logits."""

import pytest
import torch

from rsd.logprobs import MAX_TOP_LOGPROBS, emitted_rows, token_logprobs


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

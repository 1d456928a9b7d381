"""rsd.drafting: what a strategy refuses (the laws its trees follow are in test_statistical.py)."""

import pytest
import torch

from rsd.drafting import draft_tree
from rsd.random import StepRandom, Stream


def test_draft_tree_refuses_an_unknown_mode():
    proposal = lambda token_ids, parent_idx, node_idx: torch.tensor([[0.5, 0.5]]).expand(len(node_idx), -1)  # noqa: E731
    with pytest.raises(ValueError, match="DraftMode"):
        draft_tree(proposal, 0, [1], "beam", StepRandom(0, Stream.DRAFT, 0))

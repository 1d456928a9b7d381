"""rsd.tree: masks, depths, positions, paths, and the checks a tree must pass."""

import pytest
import torch

from rsd.tree import (
    DraftTree,
    node_depths,
    path_to,
    position_ids,
    tree_attention_mask,
    validate_draft_tree,
    validate_tree,
)

PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2])  # root; two children; 1 has two, 2 has one


def test_mask_depths_positions_paths():
    mask = tree_attention_mask(PARENTS)
    assert mask[3].tolist() == [True, True, False, True, False, False]
    assert mask[5].tolist() == [True, False, True, False, False, True]
    assert node_depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2]
    assert position_ids(PARENTS, 10).tolist() == [10, 11, 11, 12, 12, 12]
    assert path_to(PARENTS, 4) == [1, 4] and path_to(PARENTS, 0) == []


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ([1, 2], [-1, 1], "parent must come before"),  # self-loop
        ([1, 2, 3], [-1, 2, 1], "parent must come before"),  # cycle / parent after child
        ([1, 9], [-1, 0], "outside the vocabulary"),
        ([1, -1], [-1, 0], "outside the vocabulary"),
        ([1, 2], [0, 0], "root's parent"),
        ([1, 2, 3], [-1, 0], "parent_idx has"),
        ([], [], "at least the root"),
    ],
)
def test_validate_tree_rejects_malformed(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        validate_tree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), vocab_size=5)


def test_validate_tree_size_limit():
    with pytest.raises(ValueError, match="limit"):
        validate_tree(torch.zeros(4, dtype=torch.long), torch.tensor([-1, 0, 0, 0]), vocab_size=5, max_nodes=3)


def test_validate_draft_tree_checks_laws():
    probs = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    validate_draft_tree(DraftTree(torch.tensor([0, 1]), torch.tensor([-1, 0]), probs))
    with pytest.raises(ValueError, match="zero probability"):
        validate_draft_tree(DraftTree(torch.tensor([0, 2]), torch.tensor([-1, 0]), probs))
    with pytest.raises(ValueError, match="sum to 1"):
        validate_draft_tree(DraftTree(torch.tensor([0, 1]), torch.tensor([-1, 0]), probs * 2))
    with pytest.raises(ValueError, match="finite"):
        validate_draft_tree(DraftTree(torch.tensor([0, 1]), torch.tensor([-1, 0]), probs.log()))

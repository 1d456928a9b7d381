import ast
import pathlib

import pytest
import torch

from rsd.drafting import DraftMode, draft_sbs, draft_tree
from rsd.sampling import SamplingParams, gumbel_top_k, logits_to_probs, sample, truncate
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


def test_truncate_top_k_top_p():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert torch.allclose(truncate(probs, top_k=2), torch.tensor([0, 4 / 7, 0, 3 / 7]))
    assert torch.allclose(truncate(probs, top_p=0.7), torch.tensor([0, 4 / 7, 0, 3 / 7]))
    assert torch.allclose(truncate(probs, top_p=0.71), torch.tensor([0, 4 / 9, 2 / 9, 3 / 9]))
    assert torch.equal(truncate(probs, top_p=0.01), torch.tensor([0.0, 1, 0, 0]))


def test_logits_to_probs_temperature_and_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert logits_to_probs(logits, SamplingParams(temperature=0)).tolist() == [[0, 1, 0]]
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_sample_and_gumbel_top_k_respect_support():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).expand(200, -1)
    assert set(sample(probs, g).tolist()) == {1, 2}
    ids, valid = gumbel_top_k(probs[:1], 3, g)
    assert valid.tolist() == [[True, True, False]] and set(ids[0, :2].tolist()) == {1, 2}


@pytest.mark.parametrize(
    "row",
    [[0.0, 0.0, 0.0, 0.0], [0.5, float("nan"), 0.5, 0.0], [0.5, float("inf"), 0.0, 0.0], [1.5, -0.5, 0.0, 0.0]],
)
def test_samplers_refuse_a_row_that_is_not_a_law(row):
    """argmax over an all-zero or NaN row would silently return token 0."""
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], row])
    with pytest.raises(ValueError, match=r"row 1 of \(2,\)\) is not a law"):
        sample(probs, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="not a law"):
        gumbel_top_k(probs, 2, torch.Generator().manual_seed(0))


def test_random_functions_need_an_explicit_generator():
    probs = torch.tensor([[0.5, 0.5]])
    proposal = lambda token_ids, parent_idx, node_idx: probs.expand(len(node_idx), -1)  # noqa: E731
    calls = [
        lambda: sample(probs, None),
        lambda: gumbel_top_k(probs, 1, None),
        lambda: draft_tree(proposal, 0, [1], DraftMode.GREEDY, None),
        lambda: draft_sbs(proposal, 0, 1, 1, None, greedy=True),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"torch\.Generator"):
            call()
    with pytest.raises(ValueError, match="DraftMode"):
        draft_tree(proposal, 0, [1], "beam", torch.Generator())


def test_algorithm_package_is_pure():
    """rsd/ imports torch and the standard library only: no grpc, redis, ray, asyncio, transformers, os."""
    allowed = {"torch", "rsd", "__future__", "dataclasses", "collections", "typing", "math", "functools", "enum"}
    package = pathlib.Path(__file__).resolve().parents[1] / "rsd"  # not the working directory's rsd/
    paths = sorted(package.rglob("*.py"))
    assert {"__init__.py", "acceptance.py", "drafting.py", "sampling.py", "tree.py"} <= {p.name for p in paths}, package
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert name.split(".")[0] in allowed, f"{path} imports {name}"

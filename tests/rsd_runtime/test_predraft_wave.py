"""Pre-drafting side by side (PreDrafter.draft_wave, drafter predraft_width > 1), on tiny Llama models.

Several outcomes are drafted at once, each on a shadow copy of the drafter's runner; a hit swaps the
shadow in. In one process the wave's trees are drafted one after another, so a pipelined run must
equal the plain run token for token (tests/rsd_runtime/test_predraft.py runs that with width 2 too); through the
services their levels pack into one forward.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch

from drafter_service import engine as drafter_engine
from drafter_service.config import DrafterConfig
from rsd.acceptance import Verdict
from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd_runtime.engines import Drafter
from rsd_runtime.models import load_model
from rsd_runtime.predraft import PreDrafter, PreDraftMismatchError, outcome_of
from rsd_runtime.runner import ModelRunner
from rsd_service.serving import load_config
from rsd_tools.tiny import build_tiny_pair
from tests.fixtures.services import gen_params, reference, run, services
from tests.rsd_runtime.test_predraft import MAX_LEN, METHODS, PROMPT


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    draft_dir, target_dir = build_tiny_pair(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(draft_dir), load_model(target_dir)


def _keys(runner: ModelRunner) -> torch.Tensor:
    n = runner.cache_len + runner.num_tentative
    return torch.stack([torch.cat([layer.keys[:, :, :n], layer.values[:, :, :n]]) for layer in runner.cache.layers])


def test_copy_from_copies_committed_and_tentative_tokens_and_only_what_changed(pair):
    draft, _ = pair
    a, b = ModelRunner(draft, 64), ModelRunner(draft, 64)
    a.forward(torch.tensor([2, 10, 11, 12]), torch.tensor([-1, 0, 1, 2]))
    a.commit([0, 1, 2])
    a.forward(torch.tensor([12, 30, 31]), torch.tensor([-1, 0, 0]))
    b.copy_from(a)
    assert (b.cache_len, b.num_tentative) == (3, 3) and torch.equal(_keys(a), _keys(b))
    one, parent = torch.tensor([40]), torch.tensor([1])
    assert torch.equal(a.forward(one, parent), b.forward(one, parent))
    a.commit([0, 1])
    b.commit([0, 2])  # b diverges after position 3
    b.copy_from(a, start=3)  # positions < 3 are shared: only the rest is copied
    assert (b.cache_len, b.num_tentative) == (5, 0) and torch.equal(_keys(a), _keys(b))
    with pytest.raises(ValueError, match="start"):
        ModelRunner(draft, 64).copy_from(a, start=1)  # a fresh runner shares nothing


def test_a_shadow_tree_for_another_outcome_is_caught_and_a_miss_leaves_the_runner(pair):
    draft, _ = pair
    drafter = Drafter(ModelRunner(draft, MAX_LEN))
    runner = drafter.runner
    method, params = Method.parse("rsd_c", "2,2"), SamplingParams(1.0)
    tree = drafter.draft(PROMPT, method, params, StepRandom(1, Stream.DRAFT, len(PROMPT) - 1))
    pre = PreDrafter(drafter, method, params, seed=1, max_outcomes=2)
    pre.begin(PROMPT, tree, finishes=lambda tokens: False)
    before = _keys(runner).clone()
    assert pre.draft_wave(2) and len(pre.drafts) == 2 and all(d.runner is not None for d in pre.drafts.values())
    assert torch.equal(_keys(runner), before)  # shadows drafted; the drafter's runner untouched
    (path, token), _ = pre.drafts
    wrong = Verdict(accepted_idx=[], accepted_ids=[], next_token=(token + 1) % runner.vocab_size, is_bonus=False)
    pre.drafts[outcome_of(wrong)] = pre.drafts[(path, token)]
    with pytest.raises(PreDraftMismatchError, match="drafted after"):
        pre.take(wrong)
    del pre.drafts[outcome_of(wrong)]
    assert pre.take(wrong) is None and drafter.runner is runner and torch.equal(_keys(runner), before)
    # a hit swaps the shadow in, holding exactly what drafting that outcome fresh leaves
    pre.begin(PROMPT, tree, finishes=lambda tokens: False)
    assert pre.draft_wave(2)
    (path, token) = next(iter(pre.drafts))
    hit = Verdict(
        accepted_idx=list(path), accepted_ids=tree.token_ids[list(path)].tolist(), next_token=token, is_bonus=False
    )
    shadow = pre.drafts[(path, token)].runner
    assert pre.take(hit) is pre.drafts[(path, token)].tree and drafter.runner is shadow and runner in pre.shadows
    fresh = Drafter(ModelRunner(draft, MAX_LEN))
    fresh.draft(PROMPT, method, params, StepRandom(1, Stream.DRAFT, len(PROMPT) - 1))
    fresh.accept(PROMPT, hit)
    prefix = PROMPT + hit.token_ids
    fresh_tree = fresh.draft(prefix, method, params, StepRandom(1, Stream.DRAFT, len(prefix) - 1))
    assert torch.equal(fresh_tree.token_ids, pre.drafts[(path, token)].tree.token_ids)
    assert torch.equal(_keys(fresh.runner), _keys(shadow))


def test_a_wave_keeps_the_verdicts_own_tree_and_drops_the_others(pair):
    """The verdict arrives one forward into a wave of two: its own tree runs to its end, the other
    stops at its next forward, no new wave starts."""
    draft, _ = pair
    method, params = Method.parse("rsd_s", "2x3"), SamplingParams(1.0)
    drafter = Drafter(ModelRunner(draft, MAX_LEN))
    tree = drafter.draft(PROMPT, method, params, StepRandom(1, Stream.DRAFT, len(PROMPT) - 1))
    pre = PreDrafter(drafter, method, params, seed=1, max_outcomes=4)
    pre.begin(PROMPT, tree, finishes=lambda tokens: False)
    first, second = pre.rank(None)[:2]
    arrived, asked = threading.Event(), []

    def halt(outcome):
        asked.append(outcome)
        if asked.count(first) == 2:  # one forward of `first` ran: the verdict (`second`) is in
            arrived.set()
        return arrived.is_set() and outcome != second

    drafter_engine.predraft_while_waiting(pre, halt, arrived, math.inf, limit=4, width=2)
    assert list(pre.drafts) == [second]
    assert pre.drafts[second].tree.num_nodes == tree.num_nodes  # finished, not cut


def test_waves_through_services_equal_plain_and_pack(pair, monkeypatch):
    """Real gRPC, predraft_width 3, every outcome pre-drafted before each verdict is read (timing taken
    out): the tokens equal the in-process run without pre-drafting, hits happen, and the wave's levels
    ran in packed forwards of several trees."""

    def predraft_all(pre, halt, arrived, deadline, limit, width=1, side_by_side=None):
        while pre.draft_wave(width, None, side_by_side):
            pass

    monkeypatch.setattr(drafter_engine, "predraft_while_waiting", predraft_all)
    jobs = [(name, shape, temperature, 3) for name, shape in METHODS for temperature in (0.0, 1.0)]
    expected = [reference(pair, PROMPT, Method.parse(n, s), SamplingParams(t), seed) for n, s, t, seed in jobs]

    async def main():
        cfg = {"max_sessions": 2, "predraft_outcomes": 3, "predraft_width": 3}
        async with services(pair, None, cfg) as (vhandle, dhandle, stub, _):
            outs = [await run(stub, vhandle, f"wave-{i}", gen_params(*job), PROMPT) for i, job in enumerate(jobs)]
            return outs, dhandle.engine.packer.stats

    outs, packed = asyncio.run(main())
    for job, (tokens, _), want in zip(jobs, outs, expected, strict=True):
        assert tokens == want, job
    stats = [e.stats for _, events in outs for e in events if e.HasField("stats")]
    assert sum(s.predraft_hit for s in stats) > 0
    assert packed.max_calls == 3  # one session's three pre-drafts in one forward


def test_predraft_width_setting():
    cfg = load_config(DrafterConfig, "drafter", ["--predraft-width", "3"], env={})
    assert cfg.predraft_width == 3 and DrafterConfig().predraft_width == 1
    with pytest.raises(ValueError, match="predraft_width"):
        load_config(DrafterConfig, "drafter", [], env={"RSD_DRAFTER_PREDRAFT_WIDTH": "0"})

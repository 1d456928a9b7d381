"""Counter-based random streams and pre-drafting (rsd_runtime.predraft), on tiny Llama models.

Pre-drafting must change no token: a pipelined run equals the run without it, token for token,
for every method at T = 0, 0.6 and 1 over many seeds, in one process (PipelinedGenerator) and
through the real drafter and verifier services; a prediction that always misses changes nothing
either; a pre-drafted tree handed out for another outcome is caught.
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
from rsd.random import Draw, StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd_runtime.engines import Drafter
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import load_model
from rsd_runtime.predraft import PipelinedGenerator, PreDrafter, PreDraftMismatchError, outcome_of
from rsd_runtime.runner import ModelRunner
from rsd_service.serving import load_config
from rsd_tools.tiny import build_tiny_pair
from tests.fixtures.services import gen_params, reference, run, services

METHODS = [("sd", "3"), ("specinfer", "2,2"), ("spectr", "2x3"), ("rsd_c", "2,2,1"), ("rsd_s", "3x3")]
TEMPERATURES = [0.0, 0.6, 1.0]
PROMPT = [2, 10, 11, 12]
MAX_LEN = 256


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    draft_dir, target_dir = build_tiny_pair(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(draft_dir), load_model(target_dir)


def _never_right(self, stop):
    """A PreDrafter.rank that predicts the root's least likely token: (almost) always a miss."""
    return [((), int(self.tree.draft_probs[0].argmin()))]


def _predraft_all(pre: PreDrafter, halt, arrived, deadline, limit, width=1, side_by_side=None) -> None:
    """drafter_service.engine.predraft_while_waiting without its stops: every outcome, whatever the time."""
    while pre.draft_next():
        pass


# ---------------------------------------------------------------------------------------------
# 1. counter-based streams


def test_step_draws_are_stable_and_separate_streams_and_positions():
    # Golden values: the draws are part of the reproducibility contract (docs/algorithm.md); tests/rsd/test_random.py
    # checks their generator and that no two keys collide.
    ids = torch.arange(3)
    assert StepRandom(0, Stream.DRAFT, 0).uniform(Draw.GUMBEL, 0, ids).tolist() == [
        0.3990464708489646,
        0.7357127844834425,
        0.9722412015223157,
    ]
    assert torch.equal(
        StepRandom(3, Stream.DRAFT, 9).uniform(Draw.GUMBEL, 0, ids), StepRandom(3, 0, 9).uniform(0, 0, ids)
    )
    assert not torch.equal(
        StepRandom(3, Stream.DRAFT, 9).uniform(Draw.GUMBEL, 0, ids),
        StepRandom(3, Stream.VERIFY, 9).uniform(Draw.GUMBEL, 0, ids),
    )
    with pytest.raises(ValueError, match="root_position"):
        StepRandom(0, Stream.DRAFT, -1)


class _StepRoots(SpeculativeGenerator):
    """Records the committed length at each step."""

    def before_verify(self, step) -> None:
        self.lengths.append(len(step.committed))


def test_a_step_draws_by_position_not_by_history(pair):
    """Resuming at a step boundary (a new turn, a failover) draws what the uninterrupted run drew."""
    draft, target = pair
    gen = _StepRoots(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN))
    method, params = Method.parse("rsd_s", "2x3"), SamplingParams(1.0)
    gen.lengths = []
    whole = gen.generate(PROMPT, method, params, max_new_tokens=16, seed=5).token_ids
    cut = gen.lengths[len(gen.lengths) // 2] - len(PROMPT)  # a step boundary in the middle
    assert 0 < cut < len(whole)
    rest = gen.generate(PROMPT + whole[:cut], method, params, max_new_tokens=16 - cut, seed=5).token_ids
    assert whole[:cut] + rest == whole
    ar_whole = gen.generate(PROMPT, None, params, max_new_tokens=8, seed=5).token_ids  # every token a step
    ar_rest = gen.generate(PROMPT + ar_whole[:3], None, params, max_new_tokens=5, seed=5).token_ids
    assert ar_whole[:3] + ar_rest == ar_whole


# ---------------------------------------------------------------------------------------------
# 2. the runner's saved state


def test_runner_restore_is_bit_exact(pair):
    draft, _ = pair
    runner = ModelRunner(draft, 64)
    runner.forward(torch.tensor([2, 10, 11, 12]), torch.tensor([-1, 0, 1, 2]))
    runner.commit([0, 1, 2])
    runner.forward(torch.tensor([12, 30, 31]), torch.tensor([-1, 0, 0]))
    saved = runner.save(runner.cache_len)
    after = runner.forward(torch.tensor([40]), torch.tensor([1]))
    runner.commit([0, 2])  # moves K/V over the saved region
    runner.forward(torch.tensor([50, 51]), torch.tensor([-1, 0]))
    runner.restore(saved)
    assert (runner.cache_len, runner.num_tentative) == (3, 3)
    assert torch.equal(runner.forward(torch.tensor([40]), torch.tensor([1])), after)
    with pytest.raises(ValueError, match="save start"):
        runner.save(runner.cache_len + 1)


# ---------------------------------------------------------------------------------------------
# 3. in one process


@pytest.mark.parametrize("width", [1, 2])  # 2: waves of two on shadow runners (tests/rsd_runtime/test_predraft_wave.py)
@pytest.mark.parametrize(("name", "shape"), METHODS)
def test_pipelined_equals_plain_in_process(pair, name, shape, width):
    draft, target = pair
    plain = SpeculativeGenerator(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN))
    piped = PipelinedGenerator(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN), max_outcomes=3, width=width)
    method, hits, misses = Method.parse(name, shape), 0, 0
    for temperature in TEMPERATURES:
        for seed in range(4):
            params = SamplingParams(temperature)
            a = plain.generate(PROMPT, method, params, max_new_tokens=16, seed=seed)
            b = piped.generate(PROMPT, method, params, max_new_tokens=16, seed=seed)
            assert b.token_ids == a.token_ids, (temperature, seed)
            assert b.stats.draft_forwards == a.stats.draft_forwards  # the same trees were sent
            assert b.stats.predraft_trees > 0 and b.stats.wasted_draft_forwards > 0
            assert len(piped._pre.shadows) <= (3 if width > 1 else 0)  # a shadow per tree of a step at most
            hits, misses = hits + b.stats.predraft_hits, misses + b.stats.predraft_misses
    assert misses > 0 and hits > 0  # every method pre-drafts a verdict's tree sometimes (rsd_s 3 of these 12 runs)


@pytest.mark.parametrize("width", [1, 2])
def test_pipelined_equals_plain_with_penalties(pair, width):
    """Pre-drafts (on the drafter's runner or on shadows) count the penalties from the generation's output start
    plus the outcome's tokens, as the plain loop does: the same tokens and trees."""
    draft, target = pair
    plain = SpeculativeGenerator(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN))
    piped = PipelinedGenerator(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN), max_outcomes=3, width=width)
    method = Method.parse("rsd_c", "2,2")
    for temperature, seed in [(0.0, 0), (1.0, 1), (1.0, 2)]:
        params = SamplingParams(temperature, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.8)
        a = plain.generate(PROMPT, method, params, max_new_tokens=16, seed=seed)
        b = piped.generate(PROMPT, method, params, max_new_tokens=16, seed=seed)
        assert b.token_ids == a.token_ids and b.stats.draft_forwards == a.stats.draft_forwards, seed
        assert b.stats.predraft_trees > 0


@pytest.mark.parametrize(
    ("name", "shape", "verification"),
    [
        ("sd", "3", "traversal"),
        ("sd", "3", "block"),
        ("specinfer", "2,2", "traversal"),
        ("rsd_c", "2,1", "traversal"),
        ("rsd_s", "2x2", "coupled"),  # pre-drafts from the rule's stream too
    ],
)
def test_pipelined_equals_plain_with_every_verification(pair, name, shape, verification):
    """Pre-drafting drafts the same trees for the same verdicts (from the rule's draft stream), so a pipelined
    run equals the plain one token for token whichever exact rule judges the trees."""
    draft, target = pair
    plain = SpeculativeGenerator(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN))
    piped = PipelinedGenerator(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN), max_outcomes=3)
    method = Method.parse(name, shape)
    for seed in range(4):
        params = SamplingParams(1.0)
        a = plain.generate(PROMPT, method, params, max_new_tokens=16, seed=seed, verification=verification)
        b = piped.generate(PROMPT, method, params, max_new_tokens=16, seed=seed, verification=verification)
        assert b.token_ids == a.token_ids and b.stats.draft_forwards == a.stats.draft_forwards, seed
        assert b.stats.rule == a.stats.rule == method.rule(False, verification).name
        assert b.stats.predraft_trees > 0  # it pre-drafted (hits are rare on the tiny pair, whatever the rule)


def test_misses_change_nothing_in_process(pair, monkeypatch):
    draft, target = pair
    monkeypatch.setattr(PreDrafter, "rank", _never_right)
    plain = SpeculativeGenerator(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN))
    piped = PipelinedGenerator(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN))
    for name, shape in METHODS:
        for temperature in (0.0, 1.0):
            method, params = Method.parse(name, shape), SamplingParams(temperature)
            a = plain.generate(PROMPT, method, params, max_new_tokens=12, seed=3)
            b = piped.generate(PROMPT, method, params, max_new_tokens=12, seed=3)
            assert b.token_ids == a.token_ids
            assert b.stats.predraft_hits == 0 and b.stats.predraft_misses >= b.stats.target_calls - 1


def test_a_tree_for_another_outcome_is_caught(pair):
    """Re-key a pre-drafted tree to another outcome: take() refuses to hand it out."""
    draft, _ = pair
    drafter = Drafter(ModelRunner(draft, MAX_LEN))
    method, params = Method.parse("rsd_c", "2,2"), SamplingParams(1.0)
    tree = drafter.draft(PROMPT, method, params, StepRandom(1, Stream.DRAFT, len(PROMPT) - 1))
    pre = PreDrafter(drafter, method, params, seed=1, max_outcomes=2)
    pre.begin(PROMPT, tree, finishes=lambda tokens: False)
    assert pre.draft_next() and pre.draft_next()
    (path, token), _ = pre.drafts
    wrong = Verdict(
        accepted_idx=[], accepted_ids=[], next_token=(token + 1) % drafter.runner.vocab_size, is_bonus=False
    )
    assert outcome_of(wrong) not in pre.drafts
    pre.drafts[outcome_of(wrong)] = pre.drafts[(path, token)]
    with pytest.raises(PreDraftMismatchError, match="drafted after"):
        pre.take(wrong)
    # an honest miss leaves the drafter holding the sent tree, as if nothing had been pre-drafted
    del pre.drafts[outcome_of(wrong)]
    keys_before = drafter.runner.cache.layers[0].keys[:, :, : drafter.runner.cache_len + drafter.runner.num_tentative]
    keys_before = keys_before.clone()
    assert pre.take(wrong) is None
    n = drafter.runner.cache_len + drafter.runner.num_tentative
    assert torch.equal(drafter.runner.cache.layers[0].keys[:, :, :n], keys_before)


def test_the_verdicts_own_tree_is_finished_after_it_arrives_and_the_others_dropped(pair):
    """The engine's worker loop: the verdict arrives while the first outcome's tree is one forward in.
    If it is that outcome, the tree runs to its end (equal to drafting it fresh) and no other starts;
    if not, it is dropped at its next forward."""
    draft, _ = pair
    method, params = Method.parse("rsd_s", "2x3"), SamplingParams(1.0)
    for verdict_is_first in (True, False):
        drafter = Drafter(ModelRunner(draft, MAX_LEN))
        tree = drafter.draft(PROMPT, method, params, StepRandom(1, Stream.DRAFT, len(PROMPT) - 1))
        pre = PreDrafter(drafter, method, params, seed=1, max_outcomes=3)
        pre.begin(PROMPT, tree, finishes=lambda tokens: False)
        first, second = pre.rank(None)[:2]
        verdict_outcome = first if verdict_is_first else second
        arrived, asked = threading.Event(), []

        def halt(outcome, asked=asked, arrived=arrived, first=first, verdict_outcome=verdict_outcome):
            asked.append(outcome)
            if outcome == first and asked.count(first) == 2:  # one forward of `first` ran: the verdict is in
                arrived.set()
            return arrived.is_set() and outcome != verdict_outcome

        drafter_engine.predraft_while_waiting(pre, halt, arrived, deadline=math.inf, limit=3)
        assert list(pre.drafts) == ([first] if verdict_is_first else [])
        if verdict_is_first:
            other = Drafter(ModelRunner(draft, MAX_LEN))  # the same tree pre-drafted without interruption
            other.draft(PROMPT, method, params, StepRandom(1, Stream.DRAFT, len(PROMPT) - 1))
            whole = PreDrafter(other, method, params, seed=1, max_outcomes=3)
            whole.begin(PROMPT, tree, finishes=lambda tokens: False)
            assert whole.draft_next() and list(whole.drafts) == [first]
            assert torch.equal(pre.drafts[first].tree.token_ids, whole.drafts[first].tree.token_ids)
            assert torch.equal(pre.drafts[first].tree.draft_probs, whole.drafts[first].tree.draft_probs)


# ---------------------------------------------------------------------------------------------
# 4. through the services


def test_pipelined_equals_plain_through_services(pair):
    """Real gRPC: the drafter with pre-drafting on and off, every method at T = 0, 0.6, 1, two seeds
    each: both equal the in-process generator; only the pipelined runs report pre-drafts."""
    jobs = []
    for i, (name, shape) in enumerate(METHODS):
        for temperature in TEMPERATURES:
            for seed in (i, 50 + i):
                expected = reference(pair, PROMPT, Method.parse(name, shape), SamplingParams(temperature), seed)
                jobs.append((f"{name}-{temperature}-{seed}", gen_params(name, shape, temperature, seed), expected))

    async def main(predraft: bool):
        cfg = {"max_sessions": len(jobs), "predraft": predraft, "predraft_outcomes": 3}
        async with services(pair, {"num_slots": len(jobs)}, cfg) as (vhandle, _, stub, _):
            return await asyncio.gather(*(run(stub, vhandle, f"{sid}-{predraft}", p, PROMPT) for sid, p, _ in jobs))

    for predraft in (True, False):
        outs = asyncio.run(main(predraft))
        steps = [e.stats for _, events in outs for e in events if e.HasField("stats")]
        for (sid, _, expected), (tokens, _) in zip(jobs, outs, strict=True):
            assert tokens == expected, (sid, predraft)
        if not predraft:  # with it on, how much it drafts ahead depends on timing (the next test takes that out)
            assert sum(s.num_predrafted_trees for s in steps) == 0
        assert all(s.num_predrafted_trees > 0 or not s.predraft_hit for s in steps)


def test_misses_change_nothing_through_services(pair, monkeypatch):
    monkeypatch.setattr(PreDrafter, "rank", _never_right)
    monkeypatch.setattr(drafter_engine, "predraft_while_waiting", _predraft_all)
    name, shape = "rsd_s", "3x3"
    expected = reference(pair, PROMPT, Method.parse(name, shape), SamplingParams(0.6), 9)

    async def main():
        async with services(pair, None, {"predraft_outcomes": 2}) as (vhandle, _, stub, _):
            return await run(stub, vhandle, "miss", gen_params(name, shape, 0.6, 9), PROMPT)

    tokens, events = asyncio.run(main())
    assert tokens == expected
    stats = [e.stats for e in events if e.HasField("stats")]
    assert not any(s.predraft_hit for s in stats) and sum(s.num_predrafted_trees for s in stats) > 0


def test_every_outcome_predrafted_through_services_hits_as_in_process(pair, monkeypatch):
    """With the timing taken out (the drafter pre-drafts all its outcomes before it reads each verdict),
    the service's hits and misses are the in-process PipelinedGenerator's, step for step."""
    monkeypatch.setattr(drafter_engine, "predraft_while_waiting", _predraft_all)
    jobs = [(name, shape, temperature, 3) for name, shape in METHODS for temperature in (0.0, 1.0)]
    draft, target = pair
    piped = PipelinedGenerator(
        ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN), max_outcomes=3, draft_top_k=256
    )
    expected = []
    for name, shape, temperature, seed in jobs:
        out = piped.generate(PROMPT, Method.parse(name, shape), SamplingParams(temperature), 20, seed=seed)
        expected.append((out.token_ids, out.stats.predraft_hits, out.stats.predraft_misses))

    async def main():
        cfg = {"max_sessions": len(jobs), "predraft_outcomes": 3}
        async with services(pair, {"num_slots": len(jobs)}, cfg) as (vhandle, _, stub, _):
            calls = [run(stub, vhandle, f"all-{i}", gen_params(*job), PROMPT) for i, job in enumerate(jobs)]
            return await asyncio.gather(*calls)

    for job, (tokens, events), (want, hits, misses) in zip(jobs, asyncio.run(main()), expected, strict=True):
        stats = [e.stats for e in events if e.HasField("stats")]
        assert tokens == want, job
        assert sum(s.predraft_hit for s in stats) == hits, job
        assert sum(s.num_predrafted_trees > 0 and not s.predraft_hit for s in stats) == misses, job
    assert sum(h for _, h, _ in expected) > 0


def test_predraft_settings_from_flags_and_env():
    cfg = load_config(DrafterConfig, "drafter", ["--predraft-outcomes", "2"], env={"RSD_DRAFTER_PREDRAFT": "false"})
    assert (cfg.predraft, cfg.predraft_outcomes) == (False, 2)
    assert (DrafterConfig().predraft, DrafterConfig().predraft_outcomes) == (True, 4)  # on by default
    with pytest.raises(ValueError, match="predraft_outcomes"):
        load_config(DrafterConfig, "drafter", ["--predraft-outcomes", "0"], env={})


def test_predraft_coverage_benchmark_smoke(tmp_path):
    """rsd_bench.predraft_coverage on the tiny pair: hit rates at k grow with k, the cost table is filled."""
    import json

    from rsd_bench import predraft_coverage

    draft_dir, target_dir = build_tiny_pair(tmp_path / "models", "qwen2")
    argv = ["--draft", str(draft_dir), "--target", str(target_dir), "--dtype", "float32", "--draft-quantize", "none"]
    argv += ["--methods", "rsd_s:2x2;sd:3", "--temperatures", "0,1", "--num-prompts", "1", "--max-new-tokens", "8"]
    argv += ["--max-outcomes", "4", "--rows", "1,2", "--prompt-tokens", "12", "--reps", "1"]
    assert predraft_coverage.main([*argv, "--name", "smoke", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["complete"] and "cpu_flags" in result["machine"]
    assert [(c["method"], c["temperature"]) for c in result["coverage"]] == [
        ("rsd_s", 0.0),
        ("rsd_s", 1.0),
        ("sd", 0.0),
        ("sd", 1.0),
    ]
    for c in result["coverage"]:
        rates = [c["hit_rate_at_k"][k] for k in ("1", "2", "4")]
        assert c["steps"] > 0 and rates == sorted(rates) and rates[0] >= 0 and rates[-1] <= 1
    assert [c["rows"] for c in result["draft_forward_cost"]] == [1, 2]
    assert "hit rate, k = 4" in (tmp_path / "smoke.md").read_text()

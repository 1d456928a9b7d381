"""Seeded output that does not depend on the machine's load (docs/algorithm.md, reproducibility).

The real drafter and verifier services on loopback, with busy-loop processes on every core
(tests/fixtures/load.py): every method at T = 1 and at T = 0.8 with top-p 0.9, several seeds, four sessions at a
time (their forwards packed by whatever timing the load gives), pre-drafting forced on and off, the drafter's
quantisation "auto" as `rsd cluster` starts it (decided while the cores are busy), on tiny pairs of four
architectures: each answer equals the in-process SpeculativeGenerator's at the same seed, token for token.
Holds where no path of either model varies with its batch (rsd_runtime.models.batch_variance names it where one
does, and the test skips with that reason). Before GPT-2's Conv1D layers became nn.Linear ones (load_model's
as_plain_linear) its rows rounded differently alone than in company; before quantize "auto" was decided from the
machine and the model (rsd_runtime.models.int8_auto), a timing at start chose the int8 drafter on a busy machine
and the float one on an idle one. Either changed a seeded run's tokens with the machine's load.
"""

from __future__ import annotations

import asyncio

import pytest

from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd_runtime.models import batch_variance, load_model
from rsd_tools.tiny import build_tiny_pair
from tests.fixtures.load import busy_cores
from tests.fixtures.services import gen_params, reference, run, services

FAMILIES = ["qwen2", "gpt2", "opt", "llama"]
CASES = [("sd", "3"), ("specinfer", "2,2,1"), ("spectr", "3x3"), ("rsd_c", "2,2,1"), ("rsd_s", "3x3")]
SAMPLING = [(1.0, None), (0.8, 0.9)]  # (temperature, top_p)
SEEDS = [0, 3]
PROMPT = [2, 10, 11, 12, 13]
NEW_TOKENS = 24
AT_ONCE = 4  # sessions in flight together


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    draft_dir, target_dir = build_tiny_pair(tmp_path_factory.mktemp(request.param), request.param, vocab_size=64)
    draft, target = load_model(draft_dir), load_model(target_dir)
    if why := batch_variance(target) or batch_variance(draft):
        pytest.skip(f"not batch-invariant on this machine: {why}")
    return draft, target, draft_dir


def _jobs():
    return [(n, s, t, p, seed) for n, s in CASES for t, p in SAMPLING for seed in SEEDS]


@pytest.fixture(scope="module")
def expected(pair):
    """Each job's tokens from the in-process generator on an idle machine."""
    out = {}
    for name, shape, temperature, top_p, seed in _jobs():
        params = SamplingParams(temperature, top_p=top_p if top_p is not None else 1.0)
        out[name, shape, temperature, seed] = reference(
            pair[:2], PROMPT, Method.parse(name, shape), params, seed, NEW_TOKENS
        )
    return out


@pytest.mark.parametrize("predraft", [True, False], ids=["predraft", "no-predraft"])
def test_seeded_answers_under_load_equal_the_in_process_run(pair, expected, predraft):
    jobs = _jobs()

    async def main():
        _, target, draft_dir = pair  # the drafter loads its own model and quantises it "auto", as in a cluster
        drafter = {"model": str(draft_dir), "quantize": "auto", "max_sessions": AT_ONCE, "predraft": predraft}
        async with services((None, target), {"num_slots": AT_ONCE}, drafter) as (vhandle, dhandle, stub, _):
            assert dhandle.quantize == "none"  # a tiny drafter: int8 would not pay (rsd_runtime.models.int8_auto)
            answers = []
            for i in range(0, len(jobs), AT_ONCE):
                batch = jobs[i : i + AT_ONCE]
                calls = [
                    run(stub, vhandle, f"s{i + j}", gen_params(n, s, t, seed, top_p), PROMPT, NEW_TOKENS)
                    for j, (n, s, t, top_p, seed) in enumerate(batch)
                ]
                answers += await asyncio.gather(*calls)
            return answers

    with busy_cores(max_s=300):
        answers = asyncio.run(main())
    wrong = [
        (n, s, t, seed)
        for (n, s, t, _, seed), (tokens, _) in zip(jobs, answers, strict=True)
        if tokens != expected[n, s, t, seed]
    ]
    assert not wrong, f"{len(wrong)} of {len(jobs)} seeded answers changed under load: {wrong}"

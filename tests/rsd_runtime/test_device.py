"""Every step path on an accelerator's tensors: drafting, verification, the in-process and pipelined
generators and the batched verifier, with the models and laws on `device`.

`device` is RSD_TEST_DEVICE (e.g. cuda, run by scripts/gpu_check.sh where a GPU exists); elsewhere it
is CUDA emulated on the CPU (tests/fixtures/emulated_cuda.py), which raises where real CUDA would on a tensor
or generator of the wrong device, so device mixing is caught on CPU-only machines too. Randomness is
integer arithmetic (rsd.random), so a seeded run gives the CPU's tokens on the device wherever the
target's logits are the same.
"""

import contextlib
import os

import pytest
import torch

from rsd.acceptance import RULES, step_law, verify
from rsd.drafting import DraftMode, draft_sbs, draft_tree
from rsd.methods import Method
from rsd.random import Draw, StepRandom, Stream
from rsd.sampling import SamplingParams, gumbel_top_k, sample
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import load_model
from rsd_runtime.predraft import PipelinedGenerator
from rsd_runtime.runner import ModelRunner
from rsd_tools.tiny import build_tiny_pair
from tests.fixtures import toy
from tests.fixtures.emulated_cuda import emulated_cuda, module_to_emulated_cuda
from tests.fixtures.toy import chi_square_pvalue
from verifier_service.engine import VerifierPool, VerifyRequest

DEVICE = os.environ.get("RSD_TEST_DEVICE", "")
REAL = bool(DEVICE) and DEVICE != "cpu"
METHODS = [("sd", "3"), ("specinfer", "2,2"), ("spectr", "2x3"), ("rsd_c", "2,2"), ("rsd_s", "3x3")]
PROMPT = [2, 10, 11, 12, 13]


def on_device():
    """The context the device's tensors live in: nothing for a real device, else emulated CUDA."""
    return contextlib.nullcontext() if REAL else emulated_cuda()


def device() -> torch.device:
    return torch.device(DEVICE if REAL else "cuda")


def to_device(model):
    return model.to(device()) if REAL else module_to_emulated_cuda(model)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"), "qwen2")


def test_the_emulation_refuses_what_cuda_refuses():
    """Negative controls: the harness catches the bugs it is here for."""
    if REAL:
        pytest.skip("the emulation is for CPU-only machines")
    with emulated_cuda():
        x = torch.ones(4, device="cuda")
        assert x.device.type == "cuda" and float((x * 2).sum()) == 8.0
        with pytest.raises(RuntimeError, match="same device"):
            x - torch.ones(4)  # a law on the device against one on the CPU
        with pytest.raises(RuntimeError, match="generator"):
            torch.empty_like(x).exponential_(generator=torch.Generator())  # a CPU generator on device tensors
        assert (x + torch.tensor(1.0)).device.type == "cuda"  # 0-dim CPU tensors are scalars, as on CUDA


def test_draws_are_the_same_bits_on_the_device():
    rng = StepRandom(2**63 + 11, Stream.DRAFT, 77)
    nodes, ids = torch.tensor([0, 5, 9]), torch.tensor([[3, 1, 151_935], [0, 2, 4], [7, 7, 8]])
    cpu_rows, cpu_ids = rng.uniform_rows(Draw.GUMBEL, nodes, 300), rng.uniform(Draw.ACCEPT, nodes[:, None], ids)
    with on_device():
        dev = device()
        rows, few = (
            rng.uniform_rows(Draw.GUMBEL, nodes.to(dev), 300),
            rng.uniform(Draw.ACCEPT, nodes[:, None], ids.to(dev)),
        )
        assert rows.device.type == dev.type and few.device.type == dev.type
        assert torch.equal(rows.cpu(), cpu_rows) and torch.equal(few.cpu(), cpu_ids)


def test_samplers_and_rules_run_on_the_device():
    law = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)  # [F, V]
    rng = StepRandom(1, Stream.DRAFT, 4)
    u = rng.uniform(Draw.IID, torch.arange(3), torch.zeros(3, dtype=torch.long))
    want_ids, want_valid = gumbel_top_k(law, 4, rng, torch.tensor([0, 1, 2]))
    want_sample = sample(law, u)
    tree = draft_tree(toy.TableProposal(toy.random_table(3, 6)), 0, [2, 2], DraftMode.WITHOUT_REPLACEMENT, rng)
    target = toy.target_probs_for(tree, toy.random_table(4, 6))
    want_law = step_law(tree, target, RULES["rrs"])
    want_verdict = verify(tree, target, RULES["rrs"], StepRandom(1, Stream.VERIFY, 4))
    with on_device():
        dev = device()
        ids, valid = gumbel_top_k(law.to(dev), 4, rng, torch.tensor([0, 1, 2], device=dev))
        assert ids.device.type == dev.type and torch.equal(ids.cpu(), want_ids) and torch.equal(valid.cpu(), want_valid)
        assert torch.equal(sample(law.to(dev), u.to(dev)).cpu(), want_sample)
        on = tree.to(dev)
        assert step_law(on, target.to(dev), RULES["rrs"]) == pytest.approx(want_law, abs=1e-12)
        assert verify(on, target.to(dev), RULES["rrs"], StepRandom(1, Stream.VERIFY, 4)) == want_verdict
        with pytest.raises(ValueError, match="one device"):
            verify(tree, target.to(dev), RULES["rrs"], StepRandom(1, Stream.VERIFY, 4))  # the caller must move it


@pytest.mark.parametrize("greedy", [False, True])
def test_drafting_with_laws_on_the_device(greedy):
    """The drafters keep the tree where asked (the CPU, for the wire) and draw where the laws are."""
    table = toy.random_table(8, 6)

    class DeviceProposal(toy.TableProposal):
        def __call__(self, token_ids, parent_idx, node_idx):
            return super().__call__(token_ids, parent_idx, node_idx).to(device())

    rng = StepRandom(3, Stream.DRAFT, 9)
    want = draft_sbs(toy.TableProposal(table), 0, 3, 3, rng, greedy=greedy)
    want_iid = draft_tree(toy.TableProposal(table), 0, [3, 1], DraftMode.IID, rng)
    with on_device():
        got = draft_sbs(DeviceProposal(table), 0, 3, 3, rng, greedy=greedy)
        got_iid = draft_tree(DeviceProposal(table), 0, [3, 1], DraftMode.IID, rng)
        for a, b in ((want, got), (want_iid, got_iid)):
            assert b.token_ids.device.type == "cpu" and b.draft_probs.device.type == "cpu"
            assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.parent_idx, b.parent_idx)


def test_the_pipeline_law_on_the_device():
    """Chi-square of what draft + verify emit, laws on the device (as test_statistical, fewer trials)."""
    draft, target, n, counts = toy.random_table(31, 4), toy.random_table(32, 4), 1000, {}  # 4 outcomes
    with on_device():
        dev = device()

        class DeviceProposal(toy.TableProposal):
            def __call__(self, token_ids, parent_idx, node_idx):
                return super().__call__(token_ids, parent_idx, node_idx).to(dev)

        for i in range(n):
            tree = draft_sbs(DeviceProposal(draft), 0, 3, 2, StepRandom(1, Stream.DRAFT, i)).to(dev)
            q = toy.target_probs_for(tree.to("cpu"), target).to(dev)
            tokens = verify(tree, q, RULES["rrs"], StepRandom(1, Stream.VERIFY, i)).token_ids[:1]
            counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    assert chi_square_pvalue(counts, toy.extend((), target, 1), n) > 1e-4


@pytest.mark.parametrize(("name", "shape"), METHODS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_on_the_device_equals_the_cpu(dirs, name, shape, temperature):
    """The in-process generator and the pipelined one with both models on the device: same tokens as on the CPU."""
    method, params = Method.parse(name, shape), SamplingParams(temperature)
    cpu_draft, cpu_target = load_model(dirs[0]), load_model(dirs[1])
    want = SpeculativeGenerator(ModelRunner(cpu_target, 128), ModelRunner(cpu_draft, 128))
    want = want.generate(PROMPT, method, params, max_new_tokens=10, seed=5).token_ids
    with on_device():
        draft, target = to_device(load_model(dirs[0])), to_device(load_model(dirs[1]))
        plain = SpeculativeGenerator(ModelRunner(target, 128), ModelRunner(draft, 128))
        got = plain.generate(PROMPT, method, params, max_new_tokens=10, seed=5).token_ids
        piped = PipelinedGenerator(ModelRunner(target, 128), ModelRunner(draft, 128), 2)
        assert piped.generate(PROMPT, method, params, max_new_tokens=10, seed=5).token_ids == got
    if not REAL:  # the emulation computes on the CPU: the very same logits
        assert got == want


def test_batched_verifier_on_the_device(dirs):
    """VerifierPool with its target on the device verifies CPU trees (as they come off the wire), a prompt shared
    by two sessions (read off one slot) and processed logprobs read off the device's laws included."""
    cpu_target = load_model(dirs[1])
    trees = []
    for i, prompt in enumerate([PROMPT, [2, 50, 51], PROMPT]):
        proposal = toy.TableProposal(toy.random_table(20 + i, cpu_target.config.vocab_size))
        tree = draft_tree(proposal, prompt[-1], [2, 2], DraftMode.WITHOUT_REPLACEMENT, StepRandom(i, Stream.DRAFT, 0))
        trees.append((f"s{i}", prompt, tree))

    def run(pool: VerifierPool):
        for sid, prompt, _ in trees:
            pool.attach(sid, prompt)
        params, rng = SamplingParams(0.9, top_k=20, logit_bias=((7, 2.0),)), StepRandom(0, Stream.VERIFY, 0)
        requests = [
            VerifyRequest(sid, prompt, tree, RULES["rrs"], params, rng, 3, logprobs_mode="processed_logprobs")
            for sid, prompt, tree in trees
        ]
        return pool.verify_batch(requests)

    want = run(VerifierPool(cpu_target, 3, 64))
    with on_device():
        pool = VerifierPool(to_device(load_model(dirs[1])), 3, 64)
        got = run(pool)
    assert pool.num_shared_tokens == len(PROMPT) - 1 + 1  # s2 shares s0's prompt, s1 its first token (2)
    if not REAL:
        assert got == want
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.logprobs.top_ids, w.logprobs.top_ids)
            torch.testing.assert_close(g.logprobs.logprobs, w.logprobs.logprobs, atol=1e-5, rtol=0)
    assert all(v.token_ids for v in got) and all(v.logprobs.logprobs.device.type == "cpu" for v in got)

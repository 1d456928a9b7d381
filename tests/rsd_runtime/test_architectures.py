"""Any HF causal LM, exactly or refused (tests/fixtures/architectures.py is the matrix).

For every architecture, loaded through load_model (attention "auto"): tree-forward logits equal the
model's own causal forward of each root-to-node path, after commits that move the cache and with
sequences well past any sliding window; the verifier's packed batch of two sessions too; every
method's greedy output equals the target's own greedy decoding (transformers' generate). Refused
architectures load, and then every runner refuses them with the reason. The sampling law at T > 0
is checked on windowed models with a small vocabulary.
"""

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import GenerationConfig

from rsd.acceptance import RULES
from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd.tree import DraftTree
from rsd_runtime import row_attention
from rsd_runtime.attention import GROUPED_SDPA, ROW_SDPA, UnsupportedModelError
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import batch_variance, load_model
from rsd_runtime.runner import ModelRunner
from tests.fixtures.architectures import ARCHS, BY_NAME, WINDOW, save_pair
from tests.fixtures.toy import chi_square_pvalue
from tests.rsd_runtime.test_generator import target_law_two_tokens
from tests.rsd_runtime.test_runner import ATOL, assert_matches_paths, path, prefilled, random_tree
from verifier_service.engine import VerifierPool, VerifyRequest

EXACT = [a for a in ARCHS if not a.refused]
REFUSED = [a for a in ARCHS if a.refused]
METHODS = [("sd", "4"), ("specinfer", "2,2"), ("spectr", "2x3"), ("rsd_c", "2,2,1"), ("rsd_s", "3x4")]
PROMPT = [2, 10, 11, 12, 13, 14, 15, 16, 17]  # longer than WINDOW: the window is in play from the start
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def arch_root(tmp_path_factory):
    return tmp_path_factory.mktemp("archs")


def _pair(arch_root, name):
    draft_dir, target_dir = save_pair(BY_NAME[name], arch_root)
    return load_model(draft_dir), load_model(target_dir)


def test_matrix_is_wide():
    assert len(ARCHS) >= 20 and len(EXACT) >= 20
    assert sum(a.windowed for a in EXACT) >= 5
    assert {"gemma2", "mistral-window", "phi3-window", "bloom", "mpt", "gpt2", "opt", "falcon", "gpt_neox"} <= set(
        BY_NAME
    )


@pytest.mark.parametrize("arch", EXACT, ids=[a.name for a in EXACT])
def test_tree_forward_matches_per_path_causal(arch_root, arch):
    _, model = _pair(arch_root, arch.name)
    gen = torch.Generator().manual_seed(0)
    runner = ModelRunner(model, max_len=64)
    prefix = torch.randint(4, model.config.get_text_config().vocab_size, (10,), generator=gen).tolist()
    runner.forward(torch.tensor(prefix), torch.arange(len(prefix)) - 1)
    runner.commit(range(len(prefix)))
    for n in (8, 12):  # two trees; the commit between them keeps a path that is not first in the cache
        tokens, parents = random_tree(gen, n, 90)
        logits = runner.forward(tokens, parents)
        assert_matches_paths(model, logits, prefix, tokens, parents.tolist())
        keep = path(parents.tolist(), n - 1)  # a deep leaf: its path is not first in the cache
        runner.commit(keep)
        prefix = prefix + tokens[keep].tolist()
    assert len(prefix) > 2 * WINDOW


@pytest.mark.parametrize("arch", EXACT, ids=[a.name for a in EXACT])
def test_a_row_is_its_own_bit_for_bit_or_the_variance_is_named(arch_root, arch):
    """What makes a seeded run independent of the machine's load: which forwards a busy machine packs, pre-drafts
    or re-prefills after a failover changes how many rows share a forward, never a row's bits. Either
    batch_variance names why this model's rows depend on their batch, or a prompt prefilled in one forward leaves
    the cache that token-by-token steps leave, and each node of a tree forward is the one-token step of its path,
    bit for bit. (GPT-2's Conv1D ran torch.addmm, one row rounding unlike many, while batch_variance said "".)"""
    _, model = _pair(arch_root, arch.name)
    if why := batch_variance(model):
        assert arch.name not in ("llama", "qwen2", "gpt2", "opt"), why  # the served tests' architectures are exact
        return
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, 90, (11,), generator=gen).tolist()
    tokens, parents = random_tree(gen, 9, 90)
    tree_logits = prefilled(model, prompt).forward(tokens, parents)  # [9, V]
    for node in range(len(tokens)):
        alone = ModelRunner(model, max_len=128)
        for t in prompt + tokens[path(parents.tolist(), node)].tolist():  # every token a forward of one row
            step_logits = alone.forward(torch.tensor([t]), torch.tensor([-1]))
            alone.commit([0])
        assert torch.equal(step_logits[0], tree_logits[node]), f"node {node}"


WINDOWED = [a for a in EXACT if a.windowed]


@pytest.mark.parametrize("arch", WINDOWED, ids=[a.name for a in WINDOWED])
def test_window_ignored_is_caught(arch_root, arch):
    """Negative control: the same runner with every window dropped from its plan is off, so the
    sequences above do exercise the windows."""
    _, model = _pair(arch_root, arch.name)
    runner = ModelRunner(model, max_len=64)
    runner.plan = dataclasses.replace(runner.plan, windows=dict.fromkeys(runner.plan.windows))
    ids = list(range(10, 30))
    logits = runner.forward(torch.tensor(ids), torch.arange(len(ids)) - 1)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    assert (logits[-1] - ref).abs().max() > 10 * ATOL  # the exact tests hold ATOL


@pytest.mark.parametrize("arch", EXACT, ids=[a.name for a in EXACT])
def test_packed_verifier_matches_per_path_causal(arch_root, arch):
    """Two sessions of different lengths in one packed forward: windows by position, not by slot."""
    _, model = _pair(arch_root, arch.name)
    engine = VerifierPool(model, num_slots=2, max_len=64)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 90, (k,), generator=gen).tolist() for k in (13, 8)]
    for step in range(2):  # the second step has a cached prefix in each slot
        requests, trees = [], []
        for i, prompt in enumerate(prompts):
            if step == 0:
                engine.attach(f"s{i}", prompt)
            tokens, parents = random_tree(gen, 7, 90)
            token_ids = torch.cat([torch.tensor([prompt[-1]]), tokens])  # [1 + n]: node 0 is the root
            parent_idx = torch.cat([torch.tensor([-1]), torch.where(parents < 0, 0, parents + 1)])
            tree = DraftTree(token_ids, parent_idx, torch.full((8, 96), 1 / 96))
            requests.append(VerifyRequest(f"s{i}", prompt, tree, RULES["greedy"], SamplingParams(0)))
            trees.append((tokens, parents))
        logits = engine.score_batch(requests)
        for prompt, lg, (tokens, parents) in zip(prompts, logits, trees, strict=True):
            assert_matches_paths(model, lg[1:], prompt, tokens, parents.tolist())
        if step == 0:
            engine.verify_batch(requests)
            prompts = [[*p, int(lg[0].argmax())] for p, lg in zip(prompts, logits, strict=True)]


@pytest.mark.parametrize("arch", EXACT, ids=[a.name for a in EXACT])
def test_every_method_is_target_greedy(arch_root, arch):
    draft, target = _pair(arch_root, arch.name)
    # eos 999 is no id of these models: generate runs the whole budget, like the generator without eos ids.
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[999], pad_token_id=0)
    with torch.inference_mode():
        ref = target.generate(torch.tensor([PROMPT]), generation_config=config)[0, len(PROMPT) :].tolist()
    gen = SpeculativeGenerator(ModelRunner(target, 128), ModelRunner(draft, 128))
    assert gen.generate(PROMPT, None, SamplingParams(0), NEW_TOKENS).token_ids == ref
    for name, shape in METHODS:
        out = gen.generate(PROMPT, Method.parse(name, shape), SamplingParams(0), NEW_TOKENS)
        assert out.token_ids == ref, f"{name} {shape}"


@pytest.mark.parametrize("arch", REFUSED, ids=[a.name for a in REFUSED])
def test_refused_at_load_with_the_reason(arch_root, arch):
    _draft, target = _pair(arch_root, arch.name)  # the loader loads it (sdpa, else eager) ...
    assert target.config._attn_implementation in ("sdpa", "eager")
    with pytest.raises(UnsupportedModelError, match=arch.refused) as e:  # ... every runner refuses it
        ModelRunner(target, 64)
    assert arch.model_type in str(e.value)
    with pytest.raises(UnsupportedModelError, match=arch.refused):
        VerifierPool(target, 2, 64)


def test_gpt_neo_local_layers_exact_within_their_window(arch_root):
    """Local layers window by cache index: fine while every key fits in the window, refused beyond."""
    _, model = _pair(arch_root, "gpt_neo-local")
    ModelRunner(model, max_len=WINDOW)
    with pytest.raises(UnsupportedModelError, match="lower max_len"):
        ModelRunner(model, max_len=WINDOW + 1)


def test_explicit_attention_choice_is_honoured(arch_root):
    _draft_dir, target_dir = save_pair(BY_NAME["mistral-window"], arch_root)
    auto = ROW_SDPA if row_attention.available() else GROUPED_SDPA  # sdpa without repeat_kv; each row alone on CPUs
    assert load_model(target_dir).config._attn_implementation == auto
    assert load_model(target_dir, attn_implementation="sdpa").config._attn_implementation == "sdpa"
    assert load_model(target_dir, attn_implementation="eager").config._attn_implementation == "eager"
    gemma_dir = save_pair(BY_NAME["gemma2"], arch_root)[1]
    assert load_model(gemma_dir).config._attn_implementation == "eager"  # no sdpa path: eager, not an error
    with pytest.raises(UnsupportedModelError, match="flex_attention"):
        ModelRunner(load_model(target_dir, attn_implementation="flex_attention"), 64)


# ---- the law at T > 0 on windowed models ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral-window", "gemma2"])
def test_windowed_sampling_follows_target_law(arch_root, name):
    """Small vocabulary, a window of 3 and a prompt of 6: the two sampled tokens depend on the window."""
    from tests.fixtures.architectures import Arch, build, noisy_copy

    base = BY_NAME[name]
    arch = Arch(f"{name}-v8", base.model_type, {**base.config, "vocab_size": 8, "sliding_window": 3})
    target = build(arch, seed=3)
    draft = noisy_copy(target, 0.3, 4)
    for m in (target, draft):
        m.config._attn_implementation = "eager"
    gen = SpeculativeGenerator(ModelRunner(target, 32), ModelRunner(draft, 32))
    prompt, n, counts = [2, 5, 6, 7, 4, 5], 1200, {}
    params = SamplingParams(temperature=1.0)
    for seed in range(n):
        out = gen.generate(prompt, Method.parse("rsd_s", "3x2"), params, max_new_tokens=2, seed=seed)
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, target_law_two_tokens(target, prompt, params), n) > 1e-4


# ---- through the services -------------------------------------------------------------------------

SERVED = ["gemma2", "mistral-window", "qwen2-sliding", "gpt2"]


@pytest.mark.parametrize("name", SERVED)
def test_through_the_services(arch_root, name):
    """Drafter -> verifier over real gRPC: T = 0 is the target's greedy output, T > 0 the in-process
    generator's output with the same seed, token for token."""
    from tests.fixtures.services import gen_params, reference, run, services

    _draft, target = models = _pair(arch_root, name)
    greedy = SpeculativeGenerator(ModelRunner(target, 128)).generate(PROMPT, None, SamplingParams(0), NEW_TOKENS)

    async def main():
        async with services(models) as (vhandle, _, stub, _):
            got = {}
            for i, (method, shape) in enumerate(METHODS[-2:]):
                for temperature in (0.0, 0.8):
                    params = gen_params(method, shape, temperature, seed=5)
                    got[method, temperature], _ = await run(stub, vhandle, f"{name}-{i}-{temperature}", params, PROMPT)
            return got

    for (method, temperature), tokens in asyncio.run(main()).items():
        shape = dict(METHODS)[method]
        want = (
            greedy.token_ids
            if temperature == 0
            else reference(models, PROMPT, Method.parse(method, shape), SamplingParams(temperature), 5)
        )
        assert tokens == want, f"{method} T={temperature}"


@pytest.mark.parametrize("service", ["verifier_service", "drafter_service"])
def test_service_refuses_to_start_with_the_reason(arch_root, service):
    _, target_dir = save_pair(BY_NAME["bloom"], arch_root)
    proc = subprocess.run(
        [sys.executable, "-m", service, "--model", str(target_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0
    assert "cannot start" in proc.stderr and "ALiBi" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_report_table_lists_the_matrix():
    """The architecture table (benchmarks/results/architectures.md, written by `rsd bench architectures`; the docs
    link to it) names every entry with its verdict."""
    report = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "architectures.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in report.splitlines() if line.startswith("| ")}
    for arch in ARCHS:
        assert arch.name in rows, f"{arch.name} missing from the architecture table"
        assert ("**refused**" in rows[arch.name]) == bool(arch.refused), arch.name


def test_probe_refuses_a_model_that_ignores_positions():
    """The load-time probe: a model whose forward drops our position ids (so it numbers the tree's
    tokens by cache slot) passes every config rule and is still refused, with the measured error.
    (Attention weights scaled up so that positions move these tiny models' logits visibly.)"""
    from rsd_runtime.attention import probe_tree_forward
    from tests.fixtures.architectures import build

    def sharp_llama():
        model = build(BY_NAME["llama"], seed=7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "self_attn" in name:
                    p.mul_(8)
        return model

    model = sharp_llama()
    assert probe_tree_forward(model, ModelRunner(model, 32).plan) < 1e-5  # the honest model passes
    broken = sharp_llama()
    forward = broken.model.forward
    broken.model.forward = lambda *args, position_ids=None, **kwargs: forward(*args, **kwargs)
    with pytest.raises(UnsupportedModelError, match="differs from the model's own causal forward"):
        ModelRunner(broken, 32)

"""The public API (rsd_api) does what its docstring shows, with tiny models saved and loaded from disk."""

import rsd_api
from rsd_api import Method, ModelRunner, SamplingParams, SpeculativeGenerator, load_model, load_tokenizer
from rsd_tools.tiny import build_tiny_pair


def test_every_public_name_is_exported():
    public = {n for n, v in vars(rsd_api).items() if not n.startswith("_") and not isinstance(v, type(rsd_api))}
    assert sorted(rsd_api.__all__) == sorted(public)
    for name in rsd_api.__all__:
        assert getattr(rsd_api, name) is not None


def test_the_in_process_example_runs_and_is_greedy_exact(tmp_path):
    draft_dir, target_dir = build_tiny_pair(tmp_path, "qwen2")
    target, draft = load_model(target_dir), load_model(draft_dir)
    tok = load_tokenizer(target_dir)
    prompt = tok("def fib(n):")["input_ids"]
    gen = SpeculativeGenerator(ModelRunner(target), ModelRunner(draft))
    result = gen.generate(prompt, Method.parse("rsd_s", "3x4"), SamplingParams(temperature=0.7), 24, seed=0)
    assert len(result.token_ids) == 24 and result.stats.block_efficiency >= 1
    greedy = gen.generate(prompt, Method.parse("rsd_s", "3x4"), SamplingParams(temperature=0.0), 24)
    alone = SpeculativeGenerator(ModelRunner(target)).generate(prompt, None, SamplingParams(temperature=0.0), 24)
    assert greedy.token_ids == alone.token_ids
    assert isinstance(tok.decode(result.token_ids), str)

"""Architectures, exact or refused: a table from the test matrix (tests/fixtures/architectures.py), printed and
written to benchmarks/results/architectures.md (`rsd bench architectures`). It replays the test suite's matrix
and per-path reference (tests/rsd_runtime/test_runner.py), so it runs from a source checkout, where tests/ is.

Per architecture: the attention backend load_model picked, the plan check_model made (or its
refusal), the largest tree-forward logit error against per-path causal forwards (a sequence 3x the
window, after a commit that moves the cache), and whether rsd_s greedy equals transformers' generate.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import pathlib
import tempfile

import torch
from transformers import GenerationConfig

from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd_runtime.attention import UnsupportedModelError
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import load_model
from rsd_runtime.runner import ModelRunner
from rsd_tools.defaults import RESULTS_DIR
from tests.fixtures.architectures import ARCHS, WINDOW, save_pair
from tests.rsd_runtime.test_runner import causal_logits, path, random_tree

PROMPT = [2, 10, 11, 12, 13, 14, 15, 16, 17]
HEADER = "| architecture | model_type | attention | layers (window) | result |"


def _layers(plan) -> str:
    return ", ".join(k.replace("_attention", "") + (f" ({w})" if w else "") for k, w in plan.windows.items())


def tree_error(model) -> float:
    """Largest |tree logit - causal logit| over two trees with a moving commit between them."""
    gen = torch.Generator().manual_seed(0)
    runner = ModelRunner(model, 64)
    prefix = torch.randint(4, 90, (10,), generator=gen).tolist()
    runner.forward(torch.tensor(prefix), torch.arange(len(prefix)) - 1)
    runner.commit(range(len(prefix)))
    err = 0.0
    for n in (8, 12):
        tokens, parents = random_tree(gen, n, 90)
        logits = runner.forward(tokens, parents)
        for node in range(n):
            ref = causal_logits(model, prefix + tokens[path(parents.tolist(), node)].tolist())
            err = max(err, float((logits[node] - ref).abs().max()))
        keep = path(parents.tolist(), n - 1)
        runner.commit(keep)
        prefix += tokens[keep].tolist()
    return err


def greedy_matches(draft, target) -> bool:
    config = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=[999], pad_token_id=0)
    with torch.inference_mode():
        ref = target.generate(torch.tensor([PROMPT]), generation_config=config)[0, len(PROMPT) :].tolist()
    gen = SpeculativeGenerator(ModelRunner(target, 128), ModelRunner(draft, 128))
    return gen.generate(PROMPT, Method.parse("rsd_s", "3x4"), SamplingParams(0), 20).token_ids == ref


def rows(root: pathlib.Path) -> list[str]:
    out = []
    for arch in ARCHS:
        draft_dir, target_dir = save_pair(arch, root)
        draft, target = load_model(draft_dir), load_model(target_dir)
        attn = target.config._attn_implementation
        try:
            plan = ModelRunner(target, 64).plan
        except UnsupportedModelError as e:
            reason = str(e).split(": ", 1)[1]
            out.append(f"| {arch.name} | {arch.model_type} | {attn} | — | **refused**: {reason} |")
            continue
        err, greedy = tree_error(target), greedy_matches(draft, target)
        verdict = "exact" if err < 1e-4 and greedy else "**WRONG**"
        result = f"{verdict} (max tree-logit error {err:.0e}; greedy = generate: {'yes' if greedy else 'NO'})"
        note = f"; {arch.note}" if arch.note else ""
        out.append(f"| {arch.name} | {arch.model_type} | {attn} | {_layers(plan)}{note} | {result} |")
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m rsd_bench.architectures", description=__doc__.split("\n")[0]).parse_args(
        argv
    )
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        table = rows(pathlib.Path(tmp))
    lines = [
        "# Architectures: exact or refused",
        "",
        "Tiny random models of each architecture (tests/fixtures/architectures.py; "
        f"sliding windows of {WINDOW} tokens, sequences of 30+), loaded with `load_model` (attention `auto`). "
        "`python -m rsd_bench.architectures`.",
        "",
        HEADER,
        "| --- | --- | --- | --- | --- |",
        *table,
    ]
    text = "\n".join(lines) + "\n"
    (RESULTS_DIR / "architectures.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

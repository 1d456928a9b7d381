"""SpecTr K x L against RSD-S W x L at the same node count, in theory: expected tokens per target call.

    python -m rsd_bench.spectr_rsd_toy        # prints, and writes benchmarks/results/spectr-vs-rsd-toy.md

Two ways, both on the library's own drafting and acceptance code (rsd.drafting, rsd.acceptance):

- exact: every tree a strategy can draft with its probability (tests.fixtures.toy enumerators, as in
  tests/rsd/test_acceptance.py), times the exact law of what the rule emits on it (rsd.acceptance.step_law);
  E[tokens per step] = sum over trees and emitted sequences of P * length. Small V and depth only.
- Monte Carlo: trees drafted by draft_spectr / draft_sbs from a table proposal and verified by
  rsd.acceptance.verify, n steps, fixed seed; also where each step ended: a rejection at depth d, a
  leaf at full depth (bonus), or a leaf above it (a prefix the beam dropped: RSD-S's early truncation).

The toy pair imitates a predictable code pair: per prefix, target logits z = s * N(0, 1) and draft
logits z + sigma * N(0, 1), both divided by the temperature T. s sets how peaked the laws are (the
target's top token has mass ~0.6-0.9 for s = 2.5-4 at V = 32), sigma how much the drafter disagrees.
"""

from __future__ import annotations

import argparse
import zlib
from functools import cache

import torch

from rsd.acceptance import RULES, step_law, verify
from rsd.drafting import DraftMode, draft_sbs, draft_spectr
from rsd.random import StepRandom, Stream
from rsd_tools.defaults import RESULTS_DIR
from tests.fixtures import toy

# (name, scale, sigma, T, mix) of the Monte Carlo pairs; "code-like": 70% near-certain, well-aligned
# positions and 30% broad, misaligned ones (target top-1 mass mean ~0.7, median ~0.8; TV mean ~0.2,
# median < 0.1: about what rsd_bench.pair_divergence measures on the Qwen2.5-Coder pair at T = 1).
CODE_LIKE = ((0.7, 10.0, 0.6), (0.3, 2.0, 2.0))
REGIMES = (
    ("s=2.5, sigma=0.5", 2.5, 0.5, 1.0, ()),
    ("s=4, sigma=1", 4.0, 1.0, 1.0, ()),
    ("s=4, sigma=1", 4.0, 1.0, 0.6, ()),
    ("code-like", 0.0, 0.0, 1.0, CODE_LIKE),
    ("code-like", 0.0, 0.0, 0.6, CODE_LIKE),
)
OUT = RESULTS_DIR / "spectr-vs-rsd-toy.md"


def pair(vocab: int, scale: float, sigma: float, temperature: float, seed: int = 0, mix: tuple = ()):
    """(draft table, target table): prefix -> law [V] in float64, deterministic per prefix.

    mix: ((weight, scale, sigma), ...) draws each prefix's (scale, sigma) from these regimes instead
    (e.g. mostly near-certain, well-aligned positions and a few broad, misaligned ones, as in code)."""

    @cache
    def logits(prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, prefix)).encode()))
        s, sd = scale, sigma
        if mix:
            u = float(torch.rand(1, generator=g, dtype=torch.float64))
            cum = [sum(w for w, _, _ in mix[: i + 1]) for i in range(len(mix))]
            _, s, sd = mix[next((i for i, c in enumerate(cum) if u < c), len(mix) - 1)]
        z = s * torch.randn(vocab, generator=g, dtype=torch.float64)
        return z, z + sd * torch.randn(vocab, generator=g, dtype=torch.float64)

    def target(prefix):
        return torch.softmax(logits(prefix)[0] / temperature, -1)

    def draft(prefix):
        return torch.softmax(logits(prefix)[1] / temperature, -1)

    return cache(draft), cache(target)


def at_context(table, context: int):
    """The table seen after a context: prefix -> table((-1 - context, *prefix)) (negative: no token id)."""
    return lambda prefix: table((-1 - context, *prefix))


def exact_tokens_per_step(method: str, width: int, depth: int, draft, target, vocab: int, contexts: int = 3) -> float:
    """E[tokens one step emits] for spectr (K = width chains) or rsd_s (beam width), exactly, averaged
    over `contexts` root contexts."""
    return (
        sum(
            _exact_one(method, width, depth, at_context(draft, c), at_context(target, c), vocab)
            for c in range(contexts)
        )
        / contexts
    )


def _exact_one(method: str, width: int, depth: int, draft, target, vocab: int) -> float:
    if method == "spectr":
        trees, rule = toy.branching_tree_law(draft, vocab, [width] + [1] * (depth - 1), DraftMode.IID), "kseq"
    else:
        trees, rule = toy.sbs_tree_law(draft, vocab, width, depth), "rrs"
    total = 0.0
    for tree, p_tree in trees:
        law = step_law(tree, toy.target_probs_for(tree, target), RULES[rule])
        total += p_tree * sum(p * len(emitted) for emitted, p in law.items())
    return total


def mc_tokens_per_step(method: str, width: int, depth: int, draft, target, steps: int, seed: int = 0) -> dict:
    """Monte Carlo: mean tokens per step with its standard error, and where steps ended."""
    tokens, ends = [], {"bonus_full": 0, "leaf_above_depth": 0, "rejected": 0}
    nodes = distinct = 0
    for step in range(steps):  # each step in its own context: the root's law differs from step to step
        draft_at, target_at = at_context(draft, step), at_context(target, step)
        proposal, rng = toy.TableProposal(draft_at), StepRandom(seed, Stream.DRAFT, step)
        if method == "spectr":
            tree, rule = draft_spectr(proposal, 0, width, depth, rng), RULES["kseq"]
        else:
            tree, rule = draft_sbs(proposal, 0, width, depth, rng), RULES["rrs"]
        nodes += tree.token_ids.numel() - 1
        ids, parents = tree.token_ids, tree.parent_idx
        distinct += len({toy.path_tokens(ids, parents, n) for n in range(1, ids.numel())})
        verdict = verify(tree, toy.target_probs_for(tree, target_at), rule, StepRandom(seed, Stream.VERIFY, step))
        tokens.append(len(verdict.token_ids))
        accepted = len(verdict.accepted_idx)
        key = "rejected" if not verdict.is_bonus else ("bonus_full" if accepted == depth else "leaf_above_depth")
        ends[key] += 1
    t = torch.tensor(tokens, dtype=torch.float64)
    return {
        "mean": float(t.mean()),
        "se": float(t.std() / len(tokens) ** 0.5),
        "nodes": nodes / steps,
        "distinct": distinct / steps,  # distinct root-to-node paths: SpecTr's chains repeat prefixes
        **{k: v / steps for k, v in ends.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.spectr_rsd_toy", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000, help="Monte Carlo steps per cell")
    steps = ap.parse_args(argv).steps
    lines = [
        "# SpecTr K x L vs RSD-S W x L on a toy pair (expected tokens per target call)",
        "",
        "`python -m rsd_bench.spectr_rsd_toy` (rsd_bench/spectr_rsd_toy.py describes the toy pairs). K = W = 3,",
        "the shapes of the fixed-depth protocol. Exact: enumeration of every tree and verdict (V = 4, L = 2),",
        "averaged over 3 root contexts. Monte Carlo (V = 32): every step in its own root context (its own laws),",
        f"{steps} steps per cell with the library's drafting and verify, ± one standard error;",
        "`leaf<L`: share of steps whose accepted path ended at a leaf above depth L (RSD-S's truncated beams;",
        "SpecTr's chains always reach L). `distinct nodes`: SpecTr's i.i.d. chains repeat prefixes (RSD-S's never do).",
        "",
        "## Exact, V = 4, depth 2",
        "",
        "| s | sigma | T | spectr 3x2 | rsd_s 3x2 | rsd_s - spectr |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for scale, sigma, temp in ((2.5, 0.5, 1.0), (4.0, 1.0, 1.0), (4.0, 1.0, 0.6)):
        draft, target = pair(4, scale, sigma, temp)
        a = exact_tokens_per_step("spectr", 3, 2, draft, target, 4)
        b = exact_tokens_per_step("rsd_s", 3, 2, draft, target, 4)
        lines.append(f"| {scale} | {sigma} | {temp} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "## Monte Carlo, V = 32",
        "",
        "| pair | T | L | spectr 3xL | rsd_s 3xL | rsd_s - spectr | spectr distinct nodes | rsd_s leaf<L |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, scale, sigma, temp, mix in REGIMES:
        draft, target = pair(32, scale, sigma, temp, mix=mix)
        for depth in (2, 3, 4, 5):
            a = mc_tokens_per_step("spectr", 3, depth, draft, target, steps)
            b = mc_tokens_per_step("rsd_s", 3, depth, draft, target, steps)
            diff_se = (a["se"] ** 2 + b["se"] ** 2) ** 0.5
            lines.append(
                f"| {name} | {temp} | {depth} | {a['mean']:.3f} ± {a['se']:.3f} | {b['mean']:.3f} ± {b['se']:.3f} | "
                f"{b['mean'] - a['mean']:+.3f} ± {diff_se:.3f} | {a['distinct']:.2f} of {a['nodes']:.0f} | "
                f"{b['leaf_above_depth']:.3f} |"
            )
            print(lines[-1], flush=True)
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

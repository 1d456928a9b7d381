"""Every verification rule on the same recorded trees of a real pair: expected accepted drafts per step, exactly.

    python -m rsd_bench.rule_replay --draft DIR --target DIR     # 10 prompts x 64 tokens, T 0.6 and 1
    rsd bench rule_replay --quick                                # 2 prompts x 16 tokens

The pair generates in one process (rsd_runtime.generator, the path of `rsd bench methods`), each method with
its own rule. At every step the verifier has the target's law at every tree node [N, V] and the tree carries
the draft's law at every node (the law its children were drawn from). For each rule exact on that method
(rsd.methods: token, traversal, block for chains) the replay computes the exact law of how many drafts that
rule accepts on THAT tree, over the rule's own draws (rsd.acceptance.accepted_length_law: acceptance
probabilities and residuals over the whole vocabulary, nothing enumerated; tests/rsd/test_acceptance.py proves
it equal to step_law's enumeration). Every rule is judged on the same trees, so the difference between two rules
has no sampling noise of its own: it is paired, step by step, and its interval comes only from which trees
occurred. The laws [N, V] are kept for one step; the result keeps each step's expected accepted drafts per
rule (and the mean P(accepted >= d) per depth), from which every figure is computed.

The coupled rule (rsd.coupled) cannot be replayed: it reads the noise the tree was drawn with, and its trees
come from that noise (Stream.COUPLED). For the methods it is exact for (sd, rsd_c, rsd_s) each cell runs the
prompts a second time with it and keeps what it accepted at each step: a realised count, so its difference to
the token rule is unpaired (other trees, other draws) and its interval wider.

Per (method, shape, T, rule): the mean expected accepted drafts per step with a 95% interval over steps
(mean +- 1.96 s / sqrt(n); the steps of one generation are not independent, so per-prompt means are kept),
P(accepted >= d | accepted >= d - 1) per depth, and the difference to the method's token rule on the same steps.
At T = 0 every verification is greedy matching (Method.rule): every rule accepts the same on every tree, so
T = 0 is refused. The default shapes are budget 10 of the fixed-budget protocol (rsd_bench.methods.planning):
the chain, and each tree method's shallow-wide candidate, where rules can differ below the first level.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from torch import Tensor

from rsd.acceptance import Verdict, accepted_length_law
from rsd.constraint import Guide
from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd.tree import DraftTree
from rsd_bench.machine import cpu_info, machine_info, model_info, run_record, write_result
from rsd_runtime import NUMERICS
from rsd_runtime.engines import Verifier
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.runner import ModelRunner
from rsd_tools.defaults import RESULTS_DIR

METHODS = "sd:8;specinfer:2,2,1;spectr:3x3;rsd_c:2,2,1;rsd_s:3x3"  # budget 10: the chain, shallow-wide trees
TEMPERATURES = "0.6,1"
NUM_PROMPTS, MAX_NEW_TOKENS = 10, 64
QUICK_NUM_PROMPTS, QUICK_MAX_NEW_TOKENS = 2, 16


def verifications(method: Method) -> list[str]:
    """The rules exact on the method's trees, its token rule first (rsd.methods refuses the others)."""
    return ["token", "traversal"] + (["block"] if method.max_draft_tokens == method.depth else [])


def runs_coupled(method: Method) -> bool:
    """Whether the coupled rule is exact on the method's trees (rsd.methods: Gumbel-Top-K children)."""
    try:
        method.rule(False, "coupled")
    except ValueError:
        return False
    return True


def replay_tree(method: Method, tree: DraftTree, target_probs: Tensor) -> dict[str, list[float]]:
    """verification -> [P(accepted = d) for d = 0..the tree's depth] on this tree, T > 0."""
    return {v: accepted_length_law(tree, target_probs, method.rule(False, v)) for v in verifications(method)}


class ReplayVerifier(Verifier):
    """The target of one session that, on every tree it verifies, also replays every exact rule on that tree
    (into `replays`, for `method`); what it emits is the plain Verifier's."""

    def __init__(self, runner: ModelRunner):
        super().__init__(runner)
        self.method: Method | None = None
        self.replays: list[dict[str, list[float]]] = []

    def target_probs(
        self, committed: list[int], tree: DraftTree, params: SamplingParams, guide: Guide | None = None
    ) -> Tensor:
        probs = super().target_probs(committed, tree, params, guide)  # [N, V]
        if self.method is not None:  # None: a coupled run, nothing to replay
            self.replays.append(replay_tree(self.method, tree.to(probs.device), probs))
        return probs


class ReplayGenerator(SpeculativeGenerator):
    """SpeculativeGenerator whose verifier replays every rule on each tree (ReplayVerifier)."""

    def __init__(self, target: ModelRunner, draft: ModelRunner):
        super().__init__(target, draft)
        self.verifier = ReplayVerifier(target)
        self.realised: list[int] = []  # drafts each step of the current generation accepted

    def after_verdict(self, committed: list[int], verdict: Verdict, stats):
        self.realised.append(len(verdict.accepted_idx))
        return super().after_verdict(committed, verdict, stats)

    def replay(self, prompt_ids: list[int], method: Method, temperature: float, max_new_tokens: int, eos, seed: int):
        """One generation; returns (each step's replay, the generation's stats)."""
        self.verifier.method, self.verifier.replays = method, []
        params = SamplingParams(temperature=temperature)
        res = self.generate(prompt_ids, method, params, max_new_tokens, eos, seed)
        replays, self.verifier.replays = self.verifier.replays, []
        return replays, res.stats

    def coupled(self, prompt_ids: list[int], method: Method, temperature: float, max_new_tokens: int, eos, seed: int):
        """One generation with the coupled rule; returns the drafts each step accepted."""
        self.verifier.method, self.realised = None, []
        params = SamplingParams(temperature=temperature)
        self.generate(prompt_ids, method, params, max_new_tokens, eos, seed, verification="coupled")
        return self.realised


def mean_interval(xs: list[float]) -> tuple[float, list[float]]:
    """Mean and its 95% normal interval, mean +- 1.96 s / sqrt(n)."""
    m = statistics.fmean(xs)
    half = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return m, [m - half, m + half]


def expected(law: list[float]) -> float:
    return sum(d * p for d, p in enumerate(law))


def cell_rows(cell: dict) -> list[dict]:
    """One row per rule of a (method, shape, T) cell, from its steps' replays."""
    steps, depth = cell["steps"], max(len(s["law"]["token"]) for s in cell["steps"]) - 1
    token = [expected(s["law"]["token"]) for s in steps]
    rows = []
    for v in cell["verifications"]:
        acc = [expected(s["law"][v]) for s in steps]
        survival = [statistics.fmean(sum(s["law"][v][d:]) for s in steps) for d in range(1, depth + 1)]
        mean, ci = mean_interval(acc)
        diff = [a - b for a, b in zip(acc, token, strict=True)]
        d_mean, d_ci = mean_interval(diff)
        by_prompt: dict[int, list[float]] = {}
        for s, a in zip(steps, acc, strict=True):
            by_prompt.setdefault(s["prompt"], []).append(a)
        rows.append(
            {
                **{k: cell[k] for k in ("method", "shape", "temperature")},
                "verification": v,
                "rule": cell["rules"][v],
                "steps": len(steps),
                "accepted": round(mean, 5),
                "accepted_ci95": [round(x, 5) for x in ci],
                "accepted_by_prompt": [round(statistics.fmean(xs), 4) for xs in by_prompt.values()],
                "survival": [round(x, 5) for x in survival],  # P(accepted >= d), d = 1..
                "acceptance_by_depth": [  # P(accepted >= d | accepted >= d - 1)
                    round(x / prev, 4) if prev > 0 else 0.0 for x, prev in zip(survival, [1.0, *survival], strict=False)
                ],
                "vs_token": round(d_mean, 6),
                "vs_token_ci95": [round(x, 6) for x in d_ci],
                "vs_token_pct": round(100 * d_mean / statistics.fmean(token), 3) if any(token) else 0.0,
                "steps_above_token": sum(d > 1e-12 for d in diff),
                "steps_below_token": sum(d < -1e-12 for d in diff),
            }
        )
    if cell.get("coupled"):
        rows.append(coupled_row(cell, token))
    return rows


def coupled_row(cell: dict, token: list[float]) -> dict:
    """The coupled rule's row: realised accepted drafts per step, unpaired against the token rule's expectation."""
    steps, depth = cell["coupled"], max(len(s["law"]["token"]) for s in cell["steps"]) - 1
    acc = [float(s["accepted"]) for s in steps]
    mean, ci = mean_interval(acc)
    t_mean, t_ci = mean_interval(token)
    half = math.hypot(mean - ci[0], t_mean - t_ci[0])  # unpaired: the two halves add in quadrature
    survival = [statistics.fmean(a >= d for a in acc) for d in range(1, depth + 1)]
    by_prompt: dict[int, list[float]] = {}
    for s in steps:
        by_prompt.setdefault(s["prompt"], []).append(s["accepted"])
    return {
        **{k: cell[k] for k in ("method", "shape", "temperature")},
        "verification": "coupled",
        "rule": "coupled",
        "steps": len(steps),
        "realised": True,
        "accepted": round(mean, 5),
        "accepted_ci95": [round(x, 5) for x in ci],
        "accepted_by_prompt": [round(statistics.fmean(xs), 4) for xs in by_prompt.values()],
        "survival": [round(x, 5) for x in survival],
        "acceptance_by_depth": [
            round(x / prev, 4) if prev > 0 else 0.0 for x, prev in zip(survival, [1.0, *survival], strict=False)
        ],
        "vs_token": round(mean - t_mean, 6),
        "vs_token_ci95": [round(mean - t_mean - half, 6), round(mean - t_mean + half, 6)],
        "vs_token_pct": round(100 * (mean - t_mean) / t_mean, 3) if t_mean else 0.0,
        "steps_above_token": None,
        "steps_below_token": None,
    }


def run_cells(gen: ReplayGenerator, encoded: list[list[int]], specs, temperatures, args, eos) -> Iterator[dict]:
    """For each temperature, each method, each prompt: one generation with every tree replayed; a cell at a time."""
    for temperature in temperatures:
        for name, shape in specs:
            method = Method.parse(name, shape)
            cell = {
                "method": name,
                "shape": shape,
                "temperature": temperature,
                "verifications": verifications(method),
                "rules": {v: method.rule(False, v).name for v in verifications(method)},
                "steps": [],
                "realised_accepted": 0,  # drafts the token rule accepted in the run itself (a check)
                "wall_s": 0.0,
            }
            t0 = time.perf_counter()
            for i, ids in enumerate(encoded):
                replays, stats = gen.replay(ids, method, temperature, args.max_new_tokens, eos, args.seed + i)
                cell["steps"] += [{"prompt": i, "law": law} for law in replays]
                cell["realised_accepted"] += sum(stats.accepted_by_depth)
            if args.coupled and runs_coupled(method):
                cell["coupled"] = []
                for i, ids in enumerate(encoded):
                    realised = gen.coupled(ids, method, temperature, args.max_new_tokens, eos, args.seed + i)
                    cell["coupled"] += [{"prompt": i, "accepted": a} for a in realised]
            cell["wall_s"] = round(time.perf_counter() - t0, 1)
            rows = cell_rows(cell)
            print(
                f"[replay] T={temperature:g} {name}:{shape} {len(cell['steps'])} steps in {cell['wall_s']:.0f} s:",
                *(f"{r['verification']} {r['accepted']:.3f}" for r in rows),
                file=sys.stderr,
                flush=True,
            )
            yield cell


def compact(cell: dict) -> dict:
    """What the JSON keeps of a cell: per step its prompt and each rule's expected accepted drafts."""
    steps = cell["steps"]
    return {
        **{k: v for k, v in cell.items() if k not in ("steps", "coupled")},
        "steps": len(steps),
        **({"coupled_accepted": [s["accepted"] for s in cell["coupled"]]} if cell.get("coupled") else {}),
        "step_prompt": [s["prompt"] for s in steps],
        "step_expected": {v: [round(expected(s["law"][v]), 6) for s in steps] for v in cell["verifications"]},
    }


def cpu_tag() -> str:
    """The CPU's widest matrix / vector feature, for the result's name (rsd_bench.index's machine classes)."""
    flags = cpu_info()["cpu_flags"]
    tiers = (("amx_bf16", "amx"), ("avx512_bf16", "avx512-bf16"), ("avx512f", "avx512"), ("avx2", "avx2"))
    return next((tag for flag, tag in tiers if flag in flags), "cpu")


def _f(x: float) -> str:
    return f"{x:+.4f}" if x else "0"


def markdown(result: dict) -> str:
    s = result["settings"]
    rows = result["rows"]
    lines = [
        f"# {result['name']}: every verification rule on the same recorded trees (real pair)",
        "",
        f"- target `{result['models']['target']['name']}`, draft `{result['models']['draft']['name']}`, numeric "
        f"`{s['numeric']}`; {s['num_prompts']} stdlib prompts x {s['max_new_tokens']} new tokens, seeds "
        f"{s['seed']}+prompt; the run's own rule is each method's token rule",
        f"- machine: {result['machine']['cpu_model']}, flags {' '.join(result['machine']['cpu_flags'])}; torch "
        f"{result['machine']['torch_threads']} thread(s); wall {result['wall_s']:.0f} s",
        "- figures: expected accepted draft tokens per step on each recorded tree, exactly "
        "(rsd.acceptance.accepted_length_law), averaged over the steps; 95% interval over steps "
        "(mean +- 1.96 s / sqrt(n)); `- token`: the paired difference to the method's token rule on the same trees",
        "- `coupled (realised)`: the coupled rule's own run (its trees drawn from Stream.COUPLED), drafts it accepted "
        "per step; `- token` is then unpaired (intervals added in quadrature)",
        "",
        "| method | shape | T | steps | rule | accepted / step | 95% interval | - token | 95% interval | % | "
        "steps above / below token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lo, hi = r["accepted_ci95"]
        dlo, dhi = r["vs_token_ci95"]
        token = r["verification"] == "token"
        lines.append(
            f"| {r['method']} | {r['shape']} | {r['temperature']:g} | {r['steps']} | {r['verification']} "
            f"({'realised' if r.get('realised') else r['rule']}) | {r['accepted']:.4f} | [{lo:.4f}, {hi:.4f}] | "
            + (
                "– | – | – | – |"
                if token
                else f"{_f(r['vs_token'])} | [{dlo:+.4f}, {dhi:+.4f}] | {r['vs_token_pct']:+.2f} | "
                + ("unpaired |" if r.get("realised") else f"{r['steps_above_token']} / {r['steps_below_token']} |")
            )
        )
    lines += [
        "",
        "### Acceptance by depth: P(accepted >= d | accepted >= d - 1), expected over each tree",
        "",
        "| method | shape | T | rule | by depth |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        by_depth = " ".join(f"{x:.3f}" for x in r["acceptance_by_depth"])
        lines.append(f"| {r['method']} | {r['shape']} | {r['temperature']:g} | {r['verification']} | {by_depth} |")
    lines += [
        "",
        "### Check: the run's own draws",
        "",
        "The token rule's drafts accepted in the run itself per step, against its expectation over the same trees",
        "(the two estimate one quantity; the run's draws add sampling noise).",
        "",
        "| method | shape | T | realised | expected | wall s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    token = {(r["method"], r["shape"], r["temperature"]): r for r in rows if r["verification"] == "token"}
    for c in result["cells"]:
        expected_token = token[(c["method"], c["shape"], c["temperature"])]["accepted"]
        lines.append(
            f"| {c['method']} | {c['shape']} | {c['temperature']:g} | {c['realised_accepted'] / c['steps']:.4f} | "
            f"{expected_token:.4f} | {c['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse_specs(text: str) -> list[tuple[str, str]]:
    specs = []
    for part in text.split(";"):
        if part.strip():
            name, _, shape = part.strip().partition(":")
            Method.parse(name, shape)  # ValueError on a bad method or shape
            specs.append((name, shape))
    if not specs:
        raise ValueError(f"no methods in {text!r}")
    return specs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rsd bench rule_replay", description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default=METHODS, help="';'-separated name:shape (default %(default)s)")
    ap.add_argument("--temperatures", default=TEMPERATURES, help="comma-separated, each > 0 (default %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=None, help=f"default {NUM_PROMPTS} ({QUICK_NUM_PROMPTS} quick)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help=f"default {MAX_NEW_TOKENS}")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_NUM_PROMPTS} prompts x {QUICK_MAX_NEW_TOKENS} tokens")
    ap.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt draw (rsd_bench.prompts)")
    ap.add_argument("--seed", type=int, default=0, help="prompt i is generated with seed + i")
    ap.add_argument("--draft", type=Path, help="draft model folder (default: the provisioned Qwen pair)")
    ap.add_argument("--target", type=Path, help="target model folder, same tokenizer as the draft")
    ap.add_argument("--cache-dir", type=Path, default=None, help="model cache for the provisioned pair")
    ap.add_argument(
        "--numeric",
        default="q8_activations",
        choices=NUMERICS,
        help="both GGUF models' numeric mode (default %(default)s, the faster on a CPU; exact for other models)",
    )
    ap.add_argument(
        "--coupled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each method the coupled rule pairs with a second time under it (default on)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    ap.add_argument("--name", default=None, help="result file stem (default rule-replay-<CPU feature>)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        specs = parse_specs(args.methods)
        temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if not temperatures or min(temperatures) <= 0:
        raise SystemExit(
            "error: --temperatures must be > 0 (at T = 0 every rule is greedy matching: nothing to compare)"
        )
    args.num_prompts = args.num_prompts or (QUICK_NUM_PROMPTS if args.quick else NUM_PROMPTS)
    args.max_new_tokens = args.max_new_tokens or (QUICK_MAX_NEW_TOKENS if args.quick else MAX_NEW_TOKENS)
    args.name = args.name or f"rule-replay-{cpu_tag()}"

    import torch
    from transformers.utils import logging as hf_logging

    from rsd_bench.methods.run import eos_ids
    from rsd_bench.prompts import stdlib_prompts
    from rsd_runtime.models import load_model
    from rsd_runtime.tokenizer import load_tokenizer
    from rsd_tools.launcher import model_dirs

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    record, machine = run_record("rule_replay"), machine_info()
    draft_dir, target_dir = model_dirs(args.draft, args.target, args.cache_dir)
    try:
        target_model = load_model(target_dir, numeric=args.numeric)
        draft_model = load_model(draft_dir, numeric=args.numeric)
    except ValueError as e:
        raise SystemExit(f"error: --numeric {args.numeric}: {e}") from None
    tokenizer = load_tokenizer(target_dir)
    prompts = stdlib_prompts(args.num_prompts, args.prompt_seed)
    encoded = [tokenizer.encode(p["prompt"]) for p in prompts]
    max_nodes = max(Method.parse(n, s).max_draft_tokens for n, s in specs)
    max_len = max(map(len, encoded)) + args.max_new_tokens + 2 * max_nodes + 16
    gen = ReplayGenerator(ModelRunner(target_model, max_len), ModelRunner(draft_model, max_len))
    models = argparse.Namespace(tokenizer=tokenizer, target_model=target_model)
    eos = eos_ids(argparse.Namespace(ignore_eos=False), models)  # the tokenizer's and the generation config's
    result = {
        **record,
        "name": args.name,
        "complete": False,  # true once every cell ran: the files are rewritten after each
        "models": {
            "target": model_info(target_dir, target_model, "float32", "cpu"),
            "draft": model_info(draft_dir, draft_model, "float32", "cpu"),
        },
        "machine": machine,
        "settings": {
            "methods": [f"{n}:{s}" for n, s in specs],
            "temperatures": temperatures,
            "num_prompts": args.num_prompts,
            "prompt_ids": [p["id"] for p in prompts],
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "numeric": args.numeric,
            "coupled": args.coupled,
            "eos_token_ids": list(eos),
        },
        "rows": [],
        "cells": [],
    }
    for cell in run_cells(gen, encoded, specs, temperatures, args, eos):
        result["rows"] += cell_rows(cell)
        result["cells"].append(compact(cell))
        result["wall_s"] = round(time.perf_counter() - t_start, 1)
        write_result(args.out_dir, args.name, result, markdown(result), echo=False)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["complete"] = True
    write_result(args.out_dir, args.name, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

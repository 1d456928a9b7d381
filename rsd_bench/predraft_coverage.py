"""How often pre-drafting k outcomes could hit, and what drafting k outcomes at once would cost.

    python -m rsd_bench.predraft_coverage --methods 'rsd_s:2x6;rsd_s:3x4' --temperatures 0,1 \
        --cores 1 --threads 1 --name cpu-predraft-coverage

In one process (no services, no timing of the pipeline): each step of a plain speculative generation asks
rsd_runtime.predraft.PreDrafter.rank for its `--max-outcomes` likeliest verdict outcomes (the list the drafter
service pre-drafts from, in order) and records where the verdict's actual outcome stood in it. The share of
steps whose outcome is among the first k is the hit rate of a drafter that pre-drafts k outcomes before
every verdict: the ceiling of what more pre-drafting could buy. The second table is the draft model's
forward cost by rows (one tree level of k outcomes packed into one forward has k times the rows), min over
interleaved reps at a cached prefix of --prompt-tokens.
Writes benchmarks/results/<name>.json and .md, with the CPU flags and the placement.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rsd_bench.machine import machine_info, run_record, write_result
from rsd_service.placement import add_placement_flags, apply_placement
from rsd_tools.defaults import RESULTS_DIR

KS = (1, 2, 4, 8, 16)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.predraft_coverage", description=__doc__.split("\n")[0])
    ap.add_argument("--draft", type=Path, help="model folder (default: the provisioned draft)")
    ap.add_argument("--target", type=Path, help="model folder (default: the provisioned target)")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--dtype", default="bfloat16", help="the target's dtype")
    ap.add_argument("--draft-quantize", default="int8", help="the drafter's quantize setting: none, int8, auto")
    ap.add_argument("--methods", default="rsd_s:2x6;rsd_s:3x4", help="';'-separated method:shape")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-outcomes", type=int, default=max(KS))
    ap.add_argument("--rows", default="1,2,4,8,16,32", help="forward sizes for the draft cost table")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--name", default="cpu-predraft-coverage")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    add_placement_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    placement = apply_placement(args.cores, args.threads)
    import torch

    from rsd.methods import Method
    from rsd.sampling import SamplingParams
    from rsd_bench.prompts import stdlib_prompts
    from rsd_runtime.generator import SpeculativeGenerator
    from rsd_runtime.models import load_model, prepare_draft
    from rsd_runtime.predraft import PreDrafter, outcome_of
    from rsd_runtime.runner import ModelRunner
    from rsd_runtime.tokenizer import load_tokenizer
    from rsd_tools.provision import provision_pair

    pair = {} if args.draft and args.target else provision_pair(args.cache_dir)
    draft_dir, target_dir = args.draft or pair["draft"], args.target or pair["target"]
    target = load_model(target_dir, "cpu", args.dtype)
    draft = load_model(draft_dir, "cpu", "float32")
    quantized = prepare_draft(draft, quantize=args.draft_quantize)
    tokenizer = load_tokenizer(target_dir)
    prompts = [tokenizer.encode(p["prompt"]) for p in stdlib_prompts(args.num_prompts, seed=0)]
    eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + 64

    class Ranking(SpeculativeGenerator):
        """A plain generation that ranks the outcomes of every step (nothing is pre-drafted)."""

        def before_verify(self, step) -> None:
            pre = PreDrafter(self.drafter, step.method, step.params, step.seed, args.max_outcomes)
            pre.begin(step.committed, step.tree, step.finishes)
            self.ranked = pre.rank(None)  # its leaf forward is dropped again: the runner is as it was
            pre.runner.restore(pre.base)

        def after_verdict(self, committed, verdict, stats):
            outcome = outcome_of(verdict)
            self.ranks.append(self.ranked.index(outcome) if outcome in self.ranked else None)
            return None

    gen = Ranking(ModelRunner(target, max_len), ModelRunner(draft, max_len), draft_top_k=256)
    coverage = []
    for spec in args.methods.split(";"):
        name, shape = spec.split(":")
        method = Method.parse(name, shape)
        for t in (float(x) for x in args.temperatures.split(",")):
            gen.ranks = []
            for i, prompt in enumerate(prompts):
                gen.generate(prompt, method, SamplingParams(t), args.max_new_tokens, eos, seed=i)
            n = len(gen.ranks)
            hits = {k: sum(r is not None and r < k for r in gen.ranks) / n for k in KS if k <= args.max_outcomes}
            coverage.append({"method": name, "shape": shape, "temperature": t, "steps": n, "hit_rate_at_k": hits})
            print(f"[predraft_coverage] {spec} T={t}: {n} steps, hit rate at k {hits}", flush=True)

    runner = ModelRunner(draft, args.prompt_tokens + max(int(r) for r in args.rows.split(",")) + 1)
    prefix = torch.arange(100, 100 + args.prompt_tokens)
    runner.forward(prefix, torch.arange(-1, args.prompt_tokens - 1))
    runner.commit(list(range(args.prompt_tokens)))
    rows = [int(r) for r in args.rows.split(",")]
    best = dict.fromkeys(rows, float("inf"))
    for rep in range(args.reps + 1):  # rep 0 warms up
        for r in rows:
            t0 = time.perf_counter()
            runner.forward(torch.arange(r) + 7, torch.full((r,), -1))
            if rep:
                best[r] = min(best[r], time.perf_counter() - t0)
            runner.commit([])
    cost = [{"rows": r, "ms": round(best[r] * 1e3, 1), "vs_one_row": round(best[r] / best[rows[0]], 2)} for r in rows]
    result = {
        **run_record("predraft_coverage"),
        "complete": True,
        "draft": str(draft_dir),
        "target": str(target_dir),
        "dtype": args.dtype,
        "draft_quantize": quantized,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "placement": {"cores": placement.cores, "threads": placement.threads},
        "machine": machine_info(),
        "coverage": coverage,
        "draft_forward_cost": cost,
    }
    write_result(args.out_dir, args.name, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m, ks = result["machine"], list(result["coverage"][0]["hit_rate_at_k"]) if result["coverage"] else []
    lines = [
        f"# Pre-draft coverage: the verdict's outcome among the drafter's k likeliest ({Path(result['draft']).name} "
        f"quantize {result['draft_quantize']} -> {Path(result['target']).name} {result['dtype']})",
        "",
        f"{result['prompts']} stdlib prompts x {result['max_new_tokens']} tokens; placement: cores "
        f"{result['placement']['cores'] or 'any'}, {result['placement']['threads']} thread(s).",
        f"CPU: {m.get('cpu_model', '?')}; flags: {' '.join(m.get('cpu_flags', []))}.",
        "",
        "| method | T | steps | " + " | ".join(f"hit rate, k = {k}" for k in ks) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in ks) + " |",
    ]
    for c in result["coverage"]:
        rates = " | ".join(f"{c['hit_rate_at_k'][k]:.2f}" for k in ks)
        lines.append(f"| {c['method']} {c['shape']} | {c['temperature']:g} | {c['steps']} | {rates} |")
    lines += ["", "| draft forward, rows | ms | × one row |", "| --- | --- | --- |"]
    lines += [f"| {c['rows']} | {c['ms']:.1f} | {c['vs_one_row']:.2f} |" for c in result["draft_forward_cost"]]
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a draft/target pair sits on the toy map of rsd_bench/spectr_rsd_toy.py: per position of real
text, the target's top-1 mass and the total variation between draft and target laws at temperature T.

    python -m rsd_bench.pair_divergence benchmarks/results/NAME.json [--label spectr:3x5] [--temperature 1]

Reads the prompts and one row's generated tokens from an `rsd bench methods` result (the stdlib prompts are
redrawn with the result's count and seed), runs both models once over prompt + generation, and
summarises the laws at the generated positions. The toy pairs' own values are printed for comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from rsd_bench.spectr_rsd_toy import REGIMES, pair


def law_stats(q: torch.Tensor, p: torch.Tensor) -> dict[str, list[float]]:
    """q, p [N, V]: per row top-1 mass of q, P_q(argmax p), and total variation."""
    return {
        "target_top1": q.max(-1).values.tolist(),
        "target_mass_on_draft_top1": q.gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1).tolist(),
        "tv": (0.5 * (q - p).abs().sum(-1)).tolist(),
    }


def summary(stats: dict[str, list[float]]) -> str:
    return ", ".join(
        f"{k} mean {statistics.fmean(v):.3f} (median {statistics.median(v):.3f})" for k, v in stats.items()
    )


def toy_stats(scale: float, sigma: float, temperature: float, mix: tuple, vocab: int = 32, n: int = 2000) -> dict:
    draft, target = pair(vocab, scale, sigma, temperature, mix=mix)
    prefixes = [(-1 - i,) for i in range(n)]  # n root contexts, as rsd_bench.spectr_rsd_toy's Monte Carlo
    return law_stats(torch.stack([target(x) for x in prefixes]), torch.stack([draft(x) for x in prefixes]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.pair_divergence", description=__doc__.split("\n")[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--label", default=None, help="the row whose tokens to score (default: the first)")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)
    from rsd_bench.prompts import stdlib_prompts
    from rsd_runtime.models import load_model
    from rsd_runtime.tokenizer import load_tokenizer

    result = json.loads(args.result.read_text())
    row = next(r for r in result["rows"] if args.label in (None, r["label"]) and r["temperature"] == args.temperature)
    prompts = stdlib_prompts(result["prompts"]["count"], result["prompts"]["seed"])
    target_dir, draft_dir = result["models"]["target"]["path"], result["models"]["draft"]["path"]
    tok = load_tokenizer(target_dir)
    target = load_model(target_dir, "cpu", result["models"]["target"]["dtype"])
    draft = load_model(draft_dir, "cpu", result["models"]["draft"]["dtype"])
    stats: dict[str, list[float]] = {}
    with torch.no_grad():
        for out in row["outputs"]:
            ids = tok.encode(prompts[out["prompt"]]["prompt"])
            seq = torch.tensor([ids + out["token_ids"]])
            first = len(ids) - 1  # the laws that produced the generated tokens
            lq = target(seq).logits[0, first:-1].float() / args.temperature
            lp = draft(seq).logits[0, first:-1].float()[:, : lq.shape[-1]] / args.temperature
            vocab = min(lq.shape[-1], lp.shape[-1])
            q, p = torch.softmax(lq[:, :vocab], -1), torch.softmax(lp[:, :vocab], -1)
            for k, v in law_stats(q, p).items():
                stats.setdefault(k, []).extend(v)
    print(f"real pair, {row['label']} T={args.temperature}, {len(stats['tv'])} positions: {summary(stats)}")
    for name, scale, sigma, temp, mix in REGIMES:
        print(f"toy {name} T={temp}: {summary(toy_stats(scale, sigma, temp, mix))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Two methods of one `rsd bench methods` result, depth by depth: is the gap in block efficiency noise?

    python -m rsd_bench.methods.compare benchmarks/results/NAME.json spectr rsd_s [--temperature 1]

For each depth where both methods have a row at the temperature, prints (markdown): both block
efficiencies, their difference A - B with two 95% intervals, and where the accepted paths ended:

- over steps: the two methods' steps resampled independently (1000 resamples, fixed seed), the
  unit the bench's own intervals use;
- over prompts: prompts resampled (the same draw for both methods: they ran the same prompts with
  the same seeds), each method's block efficiency recomputed as its tokens / its steps on the
  drawn prompts. Steps within a generation are correlated, so this interval is the honest one
  when prompts differ in difficulty;
- leaf<L: the share of steps whose accepted path ended at a leaf above the tree's depth (e.g. a
  prefix RSD-S's beam stopped expanding: early truncation), from the row's accepted/tried counts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from rsd_bench.stats import BOOTSTRAP_RESAMPLES


def difference_interval(a: list[int], b: list[int], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list:
    """95% percentile interval of mean(a) - mean(b), a and b resampled independently."""
    rng = random.Random(seed)
    diffs = sorted(
        statistics.fmean(rng.choices(a, k=len(a))) - statistics.fmean(rng.choices(b, k=len(b)))
        for _ in range(resamples)
    )
    return [round(diffs[int(0.025 * resamples)], 3), round(diffs[min(int(0.975 * resamples), resamples - 1)], 3)]


def prompt_interval(a: dict, b: dict, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list:
    """95% interval of BE(a) - BE(b) resampling prompts; a, b: prompt -> its per-step tokens."""
    rng, prompts = random.Random(seed), sorted(set(a) & set(b))
    diffs = []
    for _ in range(resamples):
        draw = rng.choices(prompts, k=len(prompts))
        be = [sum(sum(m[p]) for p in draw) / max(sum(len(m[p]) for p in draw), 1) for m in (a, b)]
        diffs.append(be[0] - be[1])
    diffs.sort()
    return [round(diffs[int(0.025 * resamples)], 3), round(diffs[min(int(0.975 * resamples), resamples - 1)], 3)]


def leaf_above_depth(row: dict) -> float | None:
    """Share of steps whose accepted path ended at a leaf above the row's depth (neither a rejection
    nor a full-depth bonus): at depth d, steps that reached d minus those that tried a child there."""
    accepted, tried, steps = row.get("accepted_by_depth"), row.get("tried_by_depth"), row.get("target_calls")
    if not accepted or not tried or not steps:
        return None
    reached = [steps, *accepted[:-1]]  # steps whose path got to depth d = 0 .. L-1
    return sum(r - t for r, t in zip(reached, tried, strict=True)) / steps


def per_prompt(row: dict) -> dict[int, list[int]]:
    return {o["prompt"]: o["step_tokens"] for o in row["outputs"] if o.get("step_tokens") is not None}


def compare(result: dict, a: str, b: str, temperature: float) -> list[str]:
    rows = {}
    for r in result["rows"]:
        if r["temperature"] == temperature and r["method"] in (a, b) and r.get("protocol") != "fixed_nodes":
            rows.setdefault((r["method"], r["depth"]), r)
    depths = sorted({d for m, d in rows if m == a} & {d for m, d in rows if m == b})
    lines = [
        f"| depth | {a} | {b} | {a} - {b} | 95% over steps | 95% over prompts | prompts | steps {a} / {b} "
        f"| leaf<L {a} | leaf<L {b} |",
        "|" + " --- |" * 10,
    ]
    for d in depths:
        ra, rb = rows[(a, d)], rows[(b, d)]
        pa, pb = per_prompt(ra), per_prompt(rb)
        sa, sb = [n for s in pa.values() for n in s], [n for s in pb.values() for n in s]
        la, lb = leaf_above_depth(ra), leaf_above_depth(rb)
        lines.append(
            f"| {d} | {ra['block_efficiency']:.2f} ({ra['shape']}) | {rb['block_efficiency']:.2f} ({rb['shape']}) | "
            f"{ra['block_efficiency'] - rb['block_efficiency']:+.2f} | {difference_interval(sa, sb)} | "
            f"{prompt_interval(pa, pb)} | {len(set(pa) & set(pb))} | {len(sa)} / {len(sb)} | "
            f"{'–' if la is None else f'{la:.3f}'} | {'–' if lb is None else f'{lb:.3f}'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.methods.compare", description=__doc__.split("\n")[0])
    ap.add_argument("result", type=Path, help="an rsd bench methods JSON result")
    ap.add_argument("a", help="method name, e.g. spectr")
    ap.add_argument("b", help="method name, e.g. rsd_s")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text())
    print("\n".join(compare(result, args.a, args.b, args.temperature)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a new session's first verification costs: its prompt's catch-up chain, then the tree, in one forward.

    python -m rsd_bench.prefill_cost --cores 0-1 --threads 2 --dtype bfloat16 --name cpu-prefill-cost

The chain needs no logits (only the tree's nodes are judged), so forward_with_catch_up asks for the tree's
rows alone and the output layer runs on those (ModelRunner logits_rows, transformers' logits_to_keep).
Timed against the same forward returning every row's logits (what the runner did before), interleaved,
min over reps, for prompts of --prompt-tokens and a --tree-nodes tree. Also reports the largest logit
difference between the two (float rounding at most). Writes benchmarks/results/<name>.json and .md, with
the CPU flags and the placement.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rsd_bench.machine import machine_info, run_record, write_result
from rsd_service.placement import add_placement_flags, apply_placement
from rsd_tools.defaults import RESULTS_DIR


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.prefill_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, help="model folder (default: the provisioned target)")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", default="128,512,1024", help="prompt lengths (comma-separated)")
    ap.add_argument("--tree-nodes", type=int, default=13)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--name", default="cpu-prefill-cost")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    add_placement_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    placement = apply_placement(args.cores, args.threads)
    import torch

    from rsd_runtime.engines import forward_with_catch_up
    from rsd_runtime.models import load_model
    from rsd_runtime.runner import ModelRunner
    from rsd_tools.provision import provision_pair

    target_dir = args.target or provision_pair(args.cache_dir)["target"]
    model = load_model(target_dir, "cpu", args.dtype)
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    runner = ModelRunner(model, max(lengths) + args.tree_nodes + 1)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    nodes = args.tree_nodes
    tree_parents = torch.tensor([-1] + [(i - 1) // 3 for i in range(1, nodes)])  # [N] about 3 children a node

    def tree_only(committed: list[int], tree: torch.Tensor) -> torch.Tensor:
        return forward_with_catch_up(runner, committed, tree, tree_parents)  # [N, V]

    def every_row(committed: list[int], tree: torch.Tensor) -> torch.Tensor:
        m = len(committed) - 1
        parents = torch.cat([torch.arange(-1, m - 1), torch.where(tree_parents < 0, m - 1, tree_parents + m)])
        return runner.forward(torch.tensor(committed[:-1] + tree.tolist()), parents)[m:]  # [m + N, V] -> [N, V]

    cases = {"tree_only": tree_only, "every_row": every_row}
    times = {(c, n): [] for c in cases for n in lengths}
    diff = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for n in lengths:
            committed = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
            tree = torch.cat([torch.tensor(committed[-1:]), torch.randint(0, vocab, (nodes - 1,), generator=gen)])
            out = {}
            for case, fn in cases.items():
                runner.reset()
                t = time.perf_counter()
                out[case] = fn(committed, tree)
                if rep:
                    times[(case, n)].append(1000 * (time.perf_counter() - t))
            diff[n] = max(diff.get(n, 0.0), float((out["tree_only"] - out["every_row"]).abs().max()))
    rows = []
    for n in lengths:
        fast, slow = min(times[("tree_only", n)]), min(times[("every_row", n)])
        rows.append(
            {
                "prompt_tokens": n,
                "tree_only_ms": round(fast, 1),
                "every_row_ms": round(slow, 1),
                "saved": round(1 - fast / slow, 3),
                "max_abs_logit_diff": diff[n],
            }
        )
    result = {
        **run_record("prefill_cost"),
        "complete": True,
        "target": str(target_dir),
        "dtype": args.dtype,
        "tree_nodes": nodes,
        "reps": args.reps,
        "summary": "min over reps, interleaved",
        "placement": {"cores": placement.cores, "threads": placement.threads},
        "machine": machine_info(),
        "rows": rows,
    }
    write_result(args.out_dir, args.name, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# A new session's first verification: prompt chain + {result['tree_nodes']}-node tree in one forward "
        f"({Path(result['target']).name}, {result['dtype']})",
        "",
        f"Placement: cores {result['placement']['cores']}, {result['placement']['threads']} thread(s); min of "
        f"{result['reps']} interleaved reps. CPU: {m.get('cpu_model', '?')}; "
        f"flags: {' '.join(m.get('cpu_flags', []))}.",
        "",
        "| prompt tokens | logits for the tree only, ms | for every row, ms | saved | max abs logit diff |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['prompt_tokens']} | {r['tree_only_ms']:.0f} | {r['every_row_ms']:.0f} | {100 * r['saved']:.0f}% "
            f"| {r['max_abs_logit_diff']:.1e} |"
        )
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    raise SystemExit(main())

"""What a target forward of n tokens costs against one token, per linear-layer kernel (issue 13, section 5).

    python -m rsd_bench.forward_cost --cores 1 --threads 1 --tokens 1,2,4,6,8,12,16 --name cpu-forward-cost

A tree verification is one forward of a handful of tokens; on a memory-bound CPU it should cost little
more than one token. Each kernel is timed on the same model, interleaved (every rep runs every case once)
and summarised by the minimum over reps (a background load only ever adds time):

    f_linear     torch's F.linear everywhere (MKL / oneDNN)
    torch        use_small_batch_linear's `weight @ x.T` (rows padded to a multiple of 8)
    small_gemm   rsd_runtime.small_gemm: each weight streamed once for all rows (AVX2, AVX512-BF16, AMX-BF16)

The prompt sits in the KV cache first (--context tokens), so attention is realistic. Also checks that a
tree's logits stay within float rounding of the one-token path (the max difference is reported).
Writes benchmarks/results/<name>.json and .md, with the CPU flags and the placement.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rsd_bench.machine import machine_info, run_record, write_result
from rsd_service.placement import add_placement_flags, apply_placement
from rsd_tools.defaults import RESULTS_DIR

KERNELS = ("f_linear", "torch", "small_gemm")  # rsd_runtime.linear.LINEAR_KERNELS (torch loads after placement)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.forward_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, help="model folder (default: the provisioned target)")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", default="1,2,4,6,8,12,16", help="forward sizes (comma-separated)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"some of {','.join(KERNELS)}")
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache before the timed forwards")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--name", default="cpu-forward-cost")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    add_placement_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    placement = apply_placement(args.cores, args.threads)
    import torch

    from rsd_runtime.linear import set_linear_kernel, use_small_batch_linear
    from rsd_runtime.models import load_model
    from rsd_runtime.runner import ModelRunner
    from rsd_tools.provision import provision_pair

    target_dir = args.target or provision_pair(args.cache_dir)["target"]
    model = load_model(target_dir, "cpu", args.dtype)
    use_small_batch_linear(model, 64)
    runner = ModelRunner(model, max_len=args.context + 64)
    sizes = sorted({int(n) for n in args.tokens.split(",")} | {1})
    kernels = args.kernels.split(",")
    prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))

    def forward(n: int):
        out = runner.forward(torch.full((n,), int(prompt[-1])), torch.arange(-1, n - 1))  # a chain of n
        runner.commit([])  # drop the tentative tokens: the cache keeps the prompt
        return out

    runner.forward(prompt, torch.arange(-1, args.context - 1))
    runner.commit(list(range(args.context)))
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in kernels for n in sizes}
    rounding: dict[str, float] = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for kernel in kernels:
            set_linear_kernel(model, kernel, 64)
            for n in sizes:
                t = time.perf_counter()
                forward(n)
                if rep:
                    times[(kernel, n)].append(1000 * (time.perf_counter() - t))
    for kernel in kernels:  # a chain's first row is the one-token forward: same logits up to rounding
        set_linear_kernel(model, kernel, 64)
        one, many = forward(1)[0], forward(max(sizes))[0]
        rounding[kernel] = float((one.float() - many.float()).abs().max())
    rows = []
    for kernel in kernels:
        base = min(times[(kernel, 1)])
        for n in sizes:
            ms = min(times[(kernel, n)])
            rows.append({"kernel": kernel, "tokens": n, "ms": round(ms, 1), "ratio_to_1_token": round(ms / base, 3)})
    fastest_one = min(min(times[(k, 1)]) for k in kernels)
    for r in rows:
        r["ratio_to_fastest_1_token"] = round(r["ms"] / fastest_one, 3)
    result = {
        **run_record("forward_cost"),
        "complete": True,
        "target": str(target_dir),
        "dtype": args.dtype,
        "context_tokens": args.context,
        "reps": args.reps,
        "summary": "min over reps, interleaved",
        "placement": {"cores": placement.cores, "threads": placement.threads},
        "machine": machine_info(),
        "max_abs_logit_diff_first_row_vs_one_token": rounding,
        "rows": rows,
    }
    write_result(args.out_dir, args.name, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    kernels = list(dict.fromkeys(r["kernel"] for r in result["rows"]))
    sizes = sorted({r["tokens"] for r in result["rows"]})
    by = {(r["kernel"], r["tokens"]): r for r in result["rows"]}
    m = result["machine"]
    lines = [
        f"# Target forward cost by tokens and linear kernel ({Path(result['target']).name}, {result['dtype']})",
        "",
        f"Placement: cores {result['placement']['cores']}, {result['placement']['threads']} thread(s); "
        f"{result['context_tokens']} tokens in the cache; min of {result['reps']} interleaved reps.",
        f"CPU: {m.get('cpu_model', '?')}; flags: {' '.join(m.get('cpu_flags', []))}"
        + (f"; small_gemm is {m['small_gemm_kernels'].get(result['dtype'])}." if m.get("small_gemm_kernels") else "."),
        "",
        "| tokens | " + " | ".join(f"{k} ms (x its 1 token)" for k in kernels) + " |",
        "| --- | " + " | ".join("---" for _ in kernels) + " |",
    ]
    for n in sizes:
        cells = [f"{by[(k, n)]['ms']:.0f} ({by[(k, n)]['ratio_to_1_token']:.2f}x)" for k in kernels]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    diffs = ", ".join(f"{k} {v:.1e}" for k, v in result["max_abs_logit_diff_first_row_vs_one_token"].items())
    lines += ["", f"Max |logit difference| of a chain's first row against the one-token forward: {diffs}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

"""What a target forward of n tokens costs against one token, per linear-layer kernel (issue 13, section 5).

    python -m rsd_bench.forward_cost --cores 1 --threads 1 --tokens 1,2,4,6,8,12,16 --name cpu-forward-cost

A tree verification is one forward of a handful of tokens; on a memory-bound CPU it should cost little
more than one token. Each kernel is timed on the same model, interleaved (every rep runs every case once)
and summarised by the minimum over reps (a background load only ever adds time):

    f_linear     torch's F.linear everywhere (MKL / oneDNN)
    torch        use_small_batch_linear's `weight @ x.T` (rows padded to a multiple of 8)
    small_gemm   rsd_runtime.small_gemm: each weight streamed once for all rows (AVX2, AVX512-BF16, AMX-BF16)
    gguf         a GGUF target on its own quantised blocks (rsd_runtime.quant); the other kernels then run on
                 the same model dequantised to float32 (the fp32 detour), in the same run
    gguf_q8      the same blocks in the opt-in numeric mode "q8_activations" (rsd_runtime.quant_q8: int8
                 activations and integer block sums, as llama.cpp computes; another function, so the result
                 also gives its largest logit difference from gguf's on the one-token forward)

The prompt sits in the KV cache first (--context tokens), so attention is realistic. Also checks that a
tree's logits stay within float rounding of the one-token path (the max difference is reported).
Each row also gives the weights read a second (every weight once a forward) as a fraction of the machine's
read bandwidth, measured in the same run (a sum over a 2 GiB tensor on the same threads): how close a forward
comes to the memory's limit. Writes benchmarks/results/<name>.json and .md, with the CPU flags and the placement.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rsd_bench.machine import machine_info, run_record, write_result
from rsd_service.placement import add_placement_flags, apply_placement
from rsd_tools.defaults import RESULTS_DIR

KERNELS = ("f_linear", "torch", "small_gemm")  # rsd_runtime.linear.LINEAR_KERNELS (torch loads after placement)
GGUF_KERNELS = ("gguf", "small_gemm")  # the default for a GGUF target (gguf_q8 on request)
ON_BLOCKS = ("gguf", "gguf_q8")  # kernels that are models of their own, not set_linear_kernel's


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.forward_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, help="model folder (default: the provisioned target)")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", default="1,2,4,6,8,12,16", help="forward sizes (comma-separated)")
    ap.add_argument("--kernels", help=f"some of {','.join(KERNELS)} (gguf, gguf_q8 too for a GGUF target)")
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache before the timed forwards")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bandwidth-gib", type=float, default=2, help="GiB read to measure the read bandwidth")
    ap.add_argument("--name", default="cpu-forward-cost")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    add_placement_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    placement = apply_placement(args.cores, args.threads)
    import torch

    from rsd_runtime.gguf_model import gguf_file, load_gguf
    from rsd_runtime.linear import set_linear_kernel, use_small_batch_linear
    from rsd_runtime.models import load_model, parse_dtype
    from rsd_runtime.runner import ModelRunner
    from rsd_tools.provision import provision_pair

    target_dir = args.target or provision_pair(args.cache_dir)["target"]
    file = gguf_file(target_dir)
    kernels = (args.kernels or ",".join(GGUF_KERNELS if file else KERNELS)).split(",")
    served = load_model(target_dir, "cpu", args.dtype)
    models = {"gguf": served} if file and "gguf" in kernels else {}
    if file and "gguf_q8" in kernels:
        models["gguf_q8"] = load_model(target_dir, "cpu", args.dtype, numeric="q8_activations")
    if any(k not in ON_BLOCKS for k in kernels):
        plain = served
        if file:  # a GGUF target's fp32 detour: the same weights dequantised, attending as the served model
            plain = load_gguf(file, quantized=False).to(parse_dtype(args.dtype))
            plain.set_attn_implementation(served.config._attn_implementation)
        use_small_batch_linear(plain, 64)
        models.update({k: plain for k in kernels if k not in ON_BLOCKS})
    runners = {id(m): ModelRunner(m, max_len=args.context + 64) for m in models.values()}
    sizes = sorted({int(n) for n in args.tokens.split(",")} | {1})
    vocab = next(iter(models.values())).config.vocab_size
    prompt = torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(0))

    def forward(kernel: str, n: int):
        runner = runners[id(models[kernel])]
        out = runner.forward(torch.full((n,), int(prompt[-1])), torch.arange(-1, n - 1))  # a chain of n
        runner.commit([])  # drop the tentative tokens: the cache keeps the prompt
        return out

    def use(kernel: str) -> None:
        if kernel not in ON_BLOCKS:
            set_linear_kernel(models[kernel], kernel, 64)

    for runner in runners.values():
        runner.forward(prompt, torch.arange(-1, args.context - 1))
        runner.commit(list(range(args.context)))
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in kernels for n in sizes}
    rounding: dict[str, float] = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for kernel in kernels:
            use(kernel)
            for n in sizes:
                t = time.perf_counter()
                forward(kernel, n)
                if rep:
                    times[(kernel, n)].append(1000 * (time.perf_counter() - t))
    for kernel in kernels:  # a chain's first row is the one-token forward: same logits up to rounding
        use(kernel)
        one, many = forward(kernel, 1)[0], forward(kernel, max(sizes))[0]
        rounding[kernel] = float((one.float() - many.float()).abs().max())
    q8_vs_exact = None
    if {"gguf", "gguf_q8"} <= set(kernels):  # what int8 activations change in the one-token logits
        q8_vs_exact = float((forward("gguf_q8", 1)[0] - forward("gguf", 1)[0]).abs().max())
    bandwidth = read_bandwidth_gbps(args.bandwidth_gib)
    weight_gb = {k: weight_bytes(models[k]) / 1e9 for k in kernels}
    rows = []
    for kernel in kernels:
        base = min(times[(kernel, 1)])
        for n in sizes:
            ms = min(times[(kernel, n)])
            row = {"kernel": kernel, "tokens": n, "ms": round(ms, 1), "ratio_to_1_token": round(ms / base, 3)}
            row["bandwidth_fraction"] = round(weight_gb[kernel] / (ms / 1000) / bandwidth, 3)
            rows.append(row)
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
        "max_abs_logit_diff_gguf_q8_vs_gguf": q8_vs_exact,
        "read_bandwidth_gbps": round(bandwidth, 1),
        "weight_gb": {k: round(v, 3) for k, v in weight_gb.items()},
        "rows": rows,
    }
    write_result(args.out_dir, args.name, result, markdown(result))
    return 0


def read_bandwidth_gbps(gib: float = 2, reps: int = 3) -> float:
    """GB/s of reading a `gib` GiB float32 tensor once (torch's sum on the current threads; the best of reps)."""
    import torch

    x = torch.ones(int(gib * (1 << 28)))
    best = float("inf")
    for _ in range(reps + 1):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model) -> int:
    """Bytes a forward reads of the model's linear weights and head (parameters and GGUF blocks; embeddings are
    looked up, not read whole)."""
    import torch

    embed = model.get_input_embeddings().weight
    # weight matrices, and GGUF blocks in any layout (repacked ones are flat uint8: quant_q8.repack_x8)
    every = [*model.parameters(), *model.buffers()]
    tensors = {id(t): t for t in every if t is not None and (t.dim() == 2 or t.dtype == torch.uint8)}
    tensors.pop(id(embed), None)
    return sum(t.numel() * t.element_size() for t in tensors.values())


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
        f"Read bandwidth measured in the run: {result.get('read_bandwidth_gbps', '?')} GB/s; weights read a forward: "
        + ", ".join(f"{k} {v:.2f} GB" for k, v in result.get("weight_gb", {}).items())
        + ". In brackets: x its 1 token; that forward's weight bytes a second over the read bandwidth.",
        "",
        "| tokens | " + " | ".join(f"{k} ms (x 1 token; of bandwidth)" for k in kernels) + " |",
        "| --- | " + " | ".join("---" for _ in kernels) + " |",
    ]
    for n in sizes:
        rows = [by[(k, n)] for k in kernels]
        cells = [f"{r['ms']:.0f} ({r['ratio_to_1_token']:.2f}x; {r.get('bandwidth_fraction', 0):.2f})" for r in rows]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    diffs = ", ".join(f"{k} {v:.1e}" for k, v in result["max_abs_logit_diff_first_row_vs_one_token"].items())
    lines += ["", f"Max |logit difference| of a chain's first row against the one-token forward: {diffs}."]
    if result.get("max_abs_logit_diff_gguf_q8_vs_gguf") is not None:
        lines += [f"gguf_q8 (int8 activations) against gguf, one token: max |logit difference| "
                  f"{result['max_abs_logit_diff_gguf_q8_vs_gguf']:.3f} (another function, by design)."]  # fmt: skip
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

"""What batched drafting saves: N sessions drafting a tree each, packed into shared forwards or each alone.

    python -m rsd_bench.draft_batching --cores 0 --threads 1 --sessions 1,2,4,8 --name cpu-draft-batching

The drafter service's own loop without the verifier: N sessions (distinct stdlib prompts, each in the
draft cache first) draft one tree each, concurrently, in N threads, as DrafterPool runs them:

    packed   every forward through rsd_runtime.packed.PackedForwards (the service's default)
    alone    each thread runs its own forwards (drafter --batching false)

Each rep drafts every case once (interleaved, so a change of the machine's load hits both), each step at
a new root position so the draws differ; a case's time is the median over reps. Reported per case:
trees per second over all sessions, and its ratio to one session (the "N sessions ≥ 3x one session"
figure of issue 13 §3, for the drafter alone) and to the same N alone.
Writes benchmarks/results/<name>.json and .md, with the CPU flags and the placement.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from contextlib import nullcontext
from pathlib import Path

from rsd_bench.machine import machine_info, run_record, write_result
from rsd_service.placement import add_placement_flags, apply_placement
from rsd_tools.defaults import RESULTS_DIR


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.draft_batching", description=__doc__.split("\n")[0])
    ap.add_argument("--draft", type=Path, help="model folder (default: the provisioned draft)")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="none", help="the drafter's quantize setting: none, int8, auto")
    ap.add_argument("--sessions", default="1,2,4,8", help="concurrent sessions (comma-separated)")
    ap.add_argument("--method", default="rsd_s")
    ap.add_argument("--shape", default="3x4")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=256, help="the drafter's proposal_top_k")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="each session's cached prefix (cut to this)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--wait-ms", type=float, default=10.0, help="the drafter's batch_wait_ms")
    ap.add_argument("--name", default="cpu-draft-batching")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    add_placement_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    placement = apply_placement(args.cores, args.threads)
    import torch

    from rsd.methods import Method
    from rsd.random import StepRandom, Stream
    from rsd.sampling import SamplingParams
    from rsd_bench.prompts import stdlib_prompts
    from rsd_runtime.engines import Drafter
    from rsd_runtime.models import load_model, prepare_draft
    from rsd_runtime.packed import PackedForwards
    from rsd_runtime.runner import ModelRunner
    from rsd_runtime.tokenizer import load_tokenizer
    from rsd_tools.provision import provision_pair

    draft_dir = args.draft or provision_pair(args.cache_dir)["draft"]
    sessions = sorted({1, *(int(n) for n in args.sessions.split(",") if n)})
    model = load_model(draft_dir, "cpu", args.dtype)
    quantized = prepare_draft(model, quantize=args.quantize, dtype=args.dtype)
    tokenizer = load_tokenizer(draft_dir)
    prompts = [tokenizer.encode(p["prompt"])[-args.prompt_tokens :] for p in stdlib_prompts(max(sessions), seed=0)]
    method, params = Method.parse(args.method, args.shape), SamplingParams(args.temperature)
    max_len = args.prompt_tokens + 8 * (args.reps + 2) + method.max_draft_tokens + 8
    runners = [ModelRunner(model, max_len) for _ in prompts]
    packer = PackedForwards(model, max(sessions) * max_len, wait_s=args.wait_ms / 1000)
    for runner, prompt in zip(runners, prompts, strict=True):  # the cached prefix: all but the root
        runner.forward(torch.tensor(prompt[:-1]), torch.arange(-1, len(prompt) - 2))
        runner.commit(list(range(len(prompt) - 1)))

    def draft_all(n: int, packed: bool, step: int) -> float:
        """n sessions draft one tree each at once; -> seconds. The trees are dropped afterwards."""
        forward = packer.forward if packed else ModelRunner.forward
        ready = threading.Barrier(n + 1)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                committed = prompts[i] + [prompts[i][-1]] * step  # a new root position per step
                runner = runners[i]
                runner.crop(len(prompts[i]) - 1)
                if step:  # catch the cache up to committed[:-1] before the clock starts
                    behind = committed[runner.cache_len : -1]
                    runner.forward(torch.tensor(behind), torch.arange(-1, len(behind) - 1))
                    runner.commit(list(range(len(behind))))
                gen = StepRandom(i, Stream.DRAFT, len(committed) - 1)
                with packer.drafting() if packed else nullcontext():
                    ready.wait()
                    Drafter(runner, args.top_k, forward=forward).draft(committed, method, params, gen)
                runner.commit([])
            except BaseException as e:
                errors.append(e)
                ready.abort()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        ready.wait()  # every session is caught up and about to draft
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    times: dict[tuple[int, bool], list[float]] = {(n, p): [] for n in sessions for p in (True, False)}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for n in sessions:
            for packed in (True, False):
                s = draft_all(n, packed, rep)
                if rep:
                    times[(n, packed)].append(s)
    rows = []
    base = {p: statistics.median(times[(1, p)]) for p in (True, False)}
    for n in sessions:
        for packed in (True, False):
            s = statistics.median(times[(n, packed)])
            rows.append(
                {
                    "sessions": n,
                    "packed": packed,
                    "seconds": round(s, 4),
                    "trees_per_s": round(n / s, 3),
                    "vs_one_session": round(n / s / (1 / base[packed]), 3),
                    "vs_alone_same_sessions": round(statistics.median(times[(n, False)]) / s, 3),
                }
            )
    result = {
        **run_record("draft_batching"),
        "complete": True,
        "draft": str(draft_dir),
        "dtype": args.dtype,
        "quantize": quantized,
        "method": f"{args.method} {args.shape}",
        "temperature": args.temperature,
        "proposal_top_k": args.top_k,
        "prompt_tokens": [len(p) for p in prompts],
        "reps": args.reps,
        "summary": "median over reps, interleaved",
        "packer": vars(packer.stats),
        "placement": {"cores": placement.cores, "threads": placement.threads},
        "machine": machine_info(),
        "rows": rows,
    }
    write_result(args.out_dir, args.name, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# Batched drafting: N sessions drafting a tree each ({Path(result['draft']).name}, {result['dtype']}, "
        f"quantize {result['quantize']})",
        "",
        f"{result['method']}, T = {result['temperature']:g}, proposal top-k {result['proposal_top_k']}; placement: "
        f"cores {result['placement']['cores'] or 'any'}, {result['placement']['threads']} thread(s); "
        f"{result['summary']} of {result['reps']}.",
        f"CPU: {m.get('cpu_model', '?')}; flags: {' '.join(m.get('cpu_flags', []))}.",
        "",
        "| sessions | packed | s per round | trees/s | × 1 session | packed ÷ alone |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['sessions']} | {'yes' if r['packed'] else 'no'} | {r['seconds']:.3f} | {r['trees_per_s']:.2f} | "
            f"**{r['vs_one_session']:.2f}** | {r['vs_alone_same_sessions']:.2f} |"
        )
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    raise SystemExit(main())

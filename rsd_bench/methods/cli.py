"""Benchmark speculative methods against autoregressive decoding on one loaded drafter/target pair.

    rsd bench methods --quick                                          # the real pair (provisioned/cached)
    rsd bench methods --protocol all --temperatures 0,0.6,1 --name cpu-full   # both paper protocols
    python -m rsd_bench.methods --config "ar;sd:4;specinfer:2,2,1;spectr:2x4;rsd_c:2,2,1;rsd_s:3x4" \\
        --temperatures 0,1 --num-prompts 3 --max-new-tokens 32 --threads 2 --name cpu-quick
    python -m rsd_bench.methods --method ar --method rsd_s:3x4 --draft DIR --target DIR --prompts FILE

Methods are `name[:shape]`, separated by ';' in --config (shapes contain commas) or given one per
--method flag: ar (target alone), sd:L, specinfer:K1,K2,..., spectr:KxL, rsd_c:K1,K2,..., rsd_s:WxL,
and hf_assisted[:k] (transformers' assisted generation with the same two models; k = draft tokens
per step with a constant schedule, no k = transformers' defaults). Any tree shape may end in @tau,
the confidence stop of rsd.drafting (e.g. rsd_s:2x12@0.2). Every method runs on the same
models, prompts, per-prompt seeds, temperatures and max new tokens; runs are interleaved (for each
prompt, for each temperature, every method) so a background load hits all methods alike and a run
stopped early still covers every temperature.

Protocols (--protocol): fixed_depth runs matched shapes at each depth L in --depths (sd:L,
specinfer and rsd_c with branching 2,2,1,...,1, spectr and rsd_s 3xL); fixed_nodes runs, for each
budget in --budgets (draft tokens per tree), the candidate shapes of BUDGET_CANDIDATES and marks the
one with the highest block efficiency per (method, budget, temperature) as "best"; all runs both
(a shape in both protocols runs once and is reported under each). With --small-batch-linear the
target alone also runs with plain F.linear (ar:plain); --ar-dtype D adds the target alone loaded a
second time in dtype D (ar:D), so the baseline is the fastest target configuration found in the same
run; speedup_vs_ar divides by the fastest ar row. --draft-dtype/--target-dtype give each model its
own dtype (as the drafter and verifier services do); --target-numeric q8_activations serves a GGUF
target with int8 activations (rsd_runtime.quant_q8; recorded as models.target.numeric), --draft-numeric
the drafter. --draft-quantize
none,int8 compares drafters in one run: every speculative method runs again with each further drafter
(label +int8), and each drafter's forward is timed at --draft-cost-tokens (--costs-only: only those
timings). --cores pins the process; the result files record the placement and the CPU's notable flags.

Prompts: by default functions of the Python standard library of the running interpreter (a fixed
module list; module-level functions with a docstring and a body after it), cut after the signature
and the docstring, drawn with a fixed seed. --prompts FILE reads JSON lines with a "prompt" field.

Metrics per (method, temperature), summed over prompts:
    block_efficiency  new tokens / target calls, with a 95% percentile bootstrap interval over steps
                      (block_efficiency_ci95; --bootstrap resamples, fixed seed)
    mbsu              memory-bound speed-up (SpecTr, RSD papers): block_efficiency / (1 + c * F), with F
                      the draft forwards per target call and c = draft / target single-token forward
                      time, both measured in this run on the same context
    tokens_per_s      new tokens / wall seconds; speedup_vs_ar divides it by the ar row at the same T
    steady_tokens_per_s   the same after each generation's first step (which also prefills both models)
    draft_s, verify_s, other_s   the wall time split (other: sampling glue, bookkeeping)
Writes <out-dir>/<name>.json and <out-dir>/<name>.md, rewritten after every prompt ("complete": false
until the end). benchmarks/README.md describes every field.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from rsd.methods import VERIFICATIONS
from rsd_bench.methods.planning import (
    AR_DTYPES,
    BUDGETS,
    DEPTHS,
    MAX_NEW_TOKENS,
    NUM_PROMPTS,
    QUICK_CONFIG,
    QUICK_MAX_NEW_TOKENS,
    QUICK_NUM_PROMPTS,
    make_plan,
)
from rsd_bench.methods.report import markdown, plots
from rsd_bench.prompts import STDLIB_MODULES, file_prompts, stdlib_prompts
from rsd_bench.stats import BOOTSTRAP_RESAMPLES
from rsd_runtime import NUMERICS
from rsd_service.placement import add_placement_flags
from rsd_tools.defaults import RESULTS_DIR, TEMPERATURES


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rsd bench methods",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[1:]),
    )
    quick = f"{QUICK_NUM_PROMPTS} prompts, {QUICK_MAX_NEW_TOKENS} tokens, T {TEMPERATURES}"
    ap.add_argument("--quick", action="store_true", help=f"preset: {QUICK_CONFIG}; {quick}")
    ap.add_argument("--config", help=f"';'-separated methods, e.g. {QUICK_CONFIG!r}")
    ap.add_argument("--method", action="append", default=[], help="one method 'name[:shape]'; repeatable")
    ap.add_argument("--temperatures", default=TEMPERATURES, help="comma-separated (default %(default)s)")
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"default {QUICK_NUM_PROMPTS} with --quick, else {NUM_PROMPTS} (with --prompts: the whole file)",
    )
    ap.add_argument("--prompts", type=Path, help="JSON lines with a 'prompt' field (default: stdlib functions)")
    ap.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt draw")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"default {QUICK_MAX_NEW_TOKENS} with --quick, else {MAX_NEW_TOKENS}",
    )
    ap.add_argument("--seed", type=int, default=0, help="prompt i is generated with seed + i by every method")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    ap.add_argument(
        "--verification",
        default="token",
        choices=VERIFICATIONS,
        help="the exact rule every speculative method verifies with (rsd.methods; block: chain shapes only)",
    )
    ap.add_argument("--draft", type=Path, help="draft model folder (default: the provisioned Qwen pair)")
    ap.add_argument("--target", type=Path, help="target model folder, same tokenizer as the draft")
    ap.add_argument("--cache-dir", type=Path, default=None, help="model cache for the provisioned pair")
    ap.add_argument("--device", default="cpu")
    dtypes = [*AR_DTYPES, "auto"]
    ap.add_argument("--dtype", default="float32", choices=dtypes, help="both models' dtype (auto: rsd_runtime.models)")
    ap.add_argument("--draft-dtype", choices=dtypes, help="the drafter's dtype (default: --dtype)")
    ap.add_argument("--target-dtype", choices=dtypes, help="the target's dtype (default: --dtype)")
    ap.add_argument(
        "--target-numeric",
        default="exact",
        choices=NUMERICS,
        help="a GGUF target's numeric mode (q8_activations: int8 activations as llama.cpp; rsd_runtime.quant_q8)",
    )
    ap.add_argument("--draft-numeric", default="exact", choices=NUMERICS, help="a GGUF drafter's numeric mode")
    ap.add_argument(
        "--ar-dtype",
        action="append",
        default=[],
        choices=AR_DTYPES,
        help="also run the target alone loaded in this dtype (ar:DTYPE); repeatable",
    )
    add_placement_flags(ap)
    ap.add_argument(
        "--draft-quantize",
        default="none",
        help="the drafter's quantisation: none, int8, auto, or several to compare in one run (e.g. none,int8: "
        "every speculative method also runs with each further drafter, labelled +int8)",
    )
    ap.add_argument(
        "--draft-cost-tokens",
        default="1",
        help="token counts at which each drafter's forward is timed (e.g. 1,3,8: the draft cost table)",
    )
    ap.add_argument(
        "--costs-only", action="store_true", help="time the forwards (c, drafters by tokens) and stop: no generations"
    )
    ap.add_argument("--cost-reps", type=int, default=5, help="repetitions of each timed forward for c")
    ap.add_argument("--tree-costs", action="store_true", help="also time one target forward per method's tree size")
    ap.add_argument(
        "--protocol",
        choices=["fixed_depth", "fixed_nodes", "all"],
        default=None,
        help="run a paper protocol instead of --config/--method (default without either: all)",
    )
    ap.add_argument(
        "--only", metavar="METHODS", help="with --protocol: run only these methods of it (e.g. spectr,rsd_s; no ar)"
    )
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="fixed_depth draft lengths")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="fixed_nodes budgets (draft tokens)")
    ap.add_argument(
        "--small-batch-linear",
        type=int,
        default=0,
        metavar="ROWS",
        help="linear layers as weight @ x.T up to ROWS rows, in both models (adds ar:plain as a baseline)",
    )
    ap.add_argument(
        "--draft-vocab", type=int, default=0, metavar="K", help="the drafter scores only the first K ids (0 = all)"
    )
    ap.add_argument(
        "--bootstrap",
        type=int,
        default=BOOTSTRAP_RESAMPLES,
        metavar="N",
        help="resamples of the steps for each block efficiency's 95%% interval (0: none; default %(default)s)",
    )
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--name", default="bench", help="result file stem")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return ap


def choose_prompts(args: argparse.Namespace, num_prompts: int) -> tuple[list[dict], str]:
    """The prompts (--prompts FILE, else the standard library's functions) and where they come from."""
    if args.prompts:
        return file_prompts(args.prompts, args.num_prompts, args.prompt_seed), str(args.prompts)
    source = f"python {platform.python_version()} standard library ({len(STDLIB_MODULES)} modules)"
    return stdlib_prompts(num_prompts, args.prompt_seed), source


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    from transformers.utils import logging as hf_logging

    from rsd_bench.machine import machine_info
    from rsd_bench.methods.run import BenchRun, load_models, log
    from rsd_service.placement import apply_placement
    from rsd_tools.launcher import model_dirs

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        placement = apply_placement(args.cores, args.threads)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    t_start = time.perf_counter()
    machine = {**machine_info(), "placement": placement.as_dict()}
    prompts, source = choose_prompts(args, plan.num_prompts)
    draft_dir, target_dir = model_dirs(args.draft, args.target, args.cache_dir)
    log(
        f"loading target {target_dir} ({plan.target_dtype}) and draft {draft_dir} ({plan.draft_dtype}) on {args.device}"
    )
    models = load_models(args, plan, draft_dir, target_dir)
    run = BenchRun(args, plan, models, prompts, source, machine, placement, t_start)
    if not args.costs_only:
        run.generate_all()
    result = run.write(complete=True)
    if args.costs_only:
        log(f"wrote {run.json_path} and {run.md_path} (forward costs only)")
    else:
        log(f"wrote {run.json_path} and {run.md_path} in {result['wall_s']:.0f} s")
        if not args.no_plots:
            for path in plots(result, args.out_dir, args.name):
                log(f"wrote {path}")
    print(markdown(result))
    return 0

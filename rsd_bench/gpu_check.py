"""Every step path on CUDA with random-weight models of the real pair's shapes, and what its forwards cost (issue 29).

    bash scripts/gpu_check.sh                                      # the device tests, then this; one command
    python -m rsd_bench.gpu_check --out benchmarks/results/gpu-DATE.json [--quick] [--dtypes bfloat16]
    python -m rsd_bench.gpu_check --device cpu --tiny --out /tmp/gpu-smoke.json   # smoke run, any machine

No checkpoint, hub or network is needed. The draft and target are random models built from the configs of
the real pair (REAL_PAIR: Qwen2.5-Coder-0.5B / 1.5B-Instruct; --tiny: rsd_tools.tiny.tiny_config sizes),
seeded, initialised as transformers initialises them, saved in bfloat16 (as the real checkpoints are) into
a temporary folder, and loaded back through rsd_runtime.models.load_model, the path a user's checkpoint
takes (the draft then through prepare_draft, as `rsd generate` makes its drafter). Per dtype it measures:

    forward_cost  the target's forward of a tree of N nodes (node i's parent (i - 1) // 2) after --context
                  tokens in the cache: median ms over --reps, synchronised, and its ratio to N = 1; the
                  draft's one-token forward beside it
    generation    the target alone (method ar), SpeculativeGenerator and PipelinedGenerator (pre-drafting
                  --predraft outcomes a step) for each --methods entry at each temperature, on --prompts
                  prompts of random token ids, --new-tokens each: tokens/s, block efficiency, acceptance
                  by depth; at T = 0 whether the tokens equal the target alone's (matches_ar), and at every
                  T whether pipelined equals plain token for token (first mismatch index where not)

Read the figures with these in mind:
  - random weights give near-uniform laws over 151,936 ids, so the draft almost never agrees with the
    target: block efficiency is near 1 and every speculative method is slower than the target alone. That
    is what the run records; the point is that each path runs on the device and what its forwards cost.
  - in one process nothing overlaps, so the pipelined generator does its pre-drafting in series (more
    draft forwards a step); its tokens, not its speed, are what it checks.
  - matches_ar and pipelined-equals-plain hold up to float rounding: a tree forward and a one-token
    forward reduce in different kernels on a GPU, and near-uniform laws have near ties, so in bfloat16 a
    near-tie argmax can flip (recorded with the first mismatch; float32 should match).

--budget-s bounds the wall time of the measurements: the dtypes share it in order (an earlier dtype's unspent
time passes on), and a case that would start past its dtype's share is recorded as skipped. The result json
(and a .md summary beside it) records the date, commit, torch/CUDA versions, device and CPU, the configs,
every figure, and the test results when --tests-junit names pytest's junit file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from rsd_bench.gpu_record import (
    config_record,
    machine_record,
    markdown,
    stats_record,
    summarise,
    tests_record,
)
from rsd_bench.machine import run_record
from rsd_tools.defaults import RESULTS_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing here touches a hub

# The real pair's shapes (config.json of Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct, the models
# rsd_tools.provision fetches); the rest of Qwen2Config's defaults match those files.
REAL_PAIR = {
    "draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "target": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
}
REAL_SHARED = dict(
    vocab_size=151936,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    bos_token_id=151643,
    eos_token_id=151645,
)
TINY_PAIR = {"draft": dict(hidden_size=64, num_layers=2), "target": dict(hidden_size=128, num_layers=4)}
TINY_VOCAB = 256
SEEDS = {"target": 0, "draft": 1}
STORED_DTYPE = "bfloat16"
# Sizes of each preset; a flag given on the command line wins. --quick fits a few minutes of an H200.
PRESETS = {
    "full": dict(
        dtypes="bfloat16,float32",
        methods="sd:4,rsd_s:3x4,rsd_s:2x6,spectr:3x4",
        temperatures="0,1",
        prompts=2,
        new_tokens=64,
        reps=20,
        predraft=4,
    ),
    "quick": dict(
        dtypes="bfloat16", methods="sd:4,rsd_s:3x4", temperatures="0,1", prompts=1, new_tokens=32, reps=10, predraft=2
    ),
    # --tiny: a smoke run of every path in well under a minute on two CPU cores
    "tiny": dict(
        dtypes="float32", methods="sd:3,rsd_s:2x3", temperatures="0,1", prompts=1, new_tokens=8, reps=3, predraft=2
    ),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="result json (a .md beside it); default benchmarks/results/gpu-DATE.json")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N; cpu only with --tiny (a smoke run)")
    ap.add_argument("--tiny", action="store_true", help="tiny models (tiny_config sizes): " + _preset_help("tiny"))
    ap.add_argument("--quick", action="store_true", help="the quick preset: " + _preset_help("quick"))
    ap.add_argument("--dtypes", help="comma-separated model dtypes, in order (full: bfloat16,float32)")
    ap.add_argument("--methods", help=f"comma-separated method:shape (full: {PRESETS['full']['methods']})")
    ap.add_argument("--temperatures", help="comma-separated (full: 0,1)")
    ap.add_argument("--prompts", type=int, help="random prompts per case (full: 2)")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--new-tokens", type=int, help="tokens generated per case (full: 64)")
    ap.add_argument("--context", type=int, default=256, help="tokens in the cache before the timed tree forwards")
    ap.add_argument("--tree-sizes", default="1,4,8,16,32,64", help="tree nodes per timed forward")
    ap.add_argument("--reps", type=int, help="timed forwards per tree size, after one warm-up (full: 20)")
    ap.add_argument("--predraft", type=int, help="outcomes the pipelined generator drafts ahead a step (full: 4)")
    ap.add_argument("--seed", type=int, default=0, help="generation seed (prompt i is seeded by seed + 1000 + i)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="wall-time bound of the measurements (0: none)")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="also profile N tokens of ar and each method (host ops, scalar reads a step) and time "
        "transformers' generate (0: off)",
    )
    ap.add_argument("--tests-junit", type=Path, help="pytest's --junitxml file, summarised into the result")
    ap.add_argument("--tests-rc", type=int, help="pytest's exit status")
    ap.add_argument("--tests-command", help="the pytest command line, recorded as given")
    return ap


def _preset_help(name: str) -> str:
    return ", ".join(f"{k}={v}" for k, v in PRESETS[name].items())


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset from the preset: tiny (--tiny), quick (--quick) or full."""
    for key, value in PRESETS["tiny" if args.tiny else "quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = RESULTS_DIR / f"gpu-{datetime.date.today().isoformat()}.json"
    return args


# ---------------------------------------------------------------- the models


def pair_configs(tiny: bool) -> dict:
    """{"draft": config, "target": config}: the real pair's shapes, or tiny_config's."""
    from transformers import Qwen2Config

    if tiny:
        from rsd_tools.tiny import tiny_config

        return {role: tiny_config("qwen2", TINY_VOCAB, **kw) for role, kw in TINY_PAIR.items()}
    return {role: Qwen2Config(**REAL_SHARED, **kw) for role, kw in REAL_PAIR.items()}


def build_random_model(config, out_dir: Path, seed: int, device: str) -> tuple[Path, int]:
    """A seeded random model of `config` (transformers' own initialisation, on `device`), saved in
    STORED_DTYPE to out_dir as a checkpoint folder. Returns (out_dir, its number of parameters)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # the caller's CPU generator stays as it was (GPUs' are seeded too)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    num_params = model.num_parameters()  # tied embeddings counted once
    model.to(getattr(torch, STORED_DTYPE)).save_pretrained(out_dir)
    del model
    return out_dir, num_params


# ---------------------------------------------------------------- measuring


class Clock:
    """Wall time on the device: synchronise before reading the host clock."""

    def __init__(self, device: str):
        import torch

        self._sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def now(self) -> float:
        self._sync()
        return time.perf_counter()


def forward_cost(target, draft, context: int, sizes: list[int], reps: int, clock: Clock) -> dict:
    """Median ms of the target's tree forwards (after `context` cached tokens) and the draft's one token."""
    import torch

    vocab = target.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(12345))
    for runner in (target, draft):
        runner.reset()
        runner.forward(prompt, torch.arange(-1, context - 1))
        runner.commit(list(range(context)))

    def tree(n: int) -> tuple:  # node 0 (the same token in every tree) follows the context; a binary heap below
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))  # [N]
        ids[0] = int(prompt[-1])
        return ids, torch.tensor([-1] + [(i - 1) // 2 for i in range(1, n)], dtype=torch.long)

    def timed(runner, n: int) -> tuple[float, object]:
        ids, parents = tree(n)
        t = clock.now()
        logits = runner.forward(ids, parents)  # [n, V]
        ms = 1000 * (clock.now() - t)
        runner.commit([])  # drop the tentative nodes: the cache keeps the context
        return ms, logits

    times: dict[int, list[float]] = {n: [] for n in sizes}
    draft_ms: list[float] = []
    for rep in range(reps + 1):  # rep 0 warms up; every rep runs every size (interleaved)
        for n in sizes:
            ms, _ = timed(target, n)
            if rep:
                times[n].append(ms)
        ms, _ = timed(draft, 1)
        if rep:
            draft_ms.append(ms)
    one = timed(target, 1)[1][0]
    root = timed(target, max(sizes))[1][0]  # node 0 sees the same context as the one-token forward
    base = statistics.median(times[min(sizes)])
    rows = [
        {
            "nodes": n,
            "ms": round(statistics.median(times[n]), 3),
            "ms_min": round(min(times[n]), 3),
            "ratio_to_1": round(statistics.median(times[n]) / base, 3),
        }
        for n in sizes
    ]
    return {
        "context_tokens": context,
        "reps": reps,
        "summary": "median over reps, interleaved, synchronised",
        "tree": "node i's parent (i - 1) // 2",
        "target": rows,
        "draft_1_token_ms": round(statistics.median(draft_ms), 3),
        "max_abs_logit_diff_root_vs_one_token": float((one.float() - root.float()).abs().max()),
    }


def profile_case(gen, prompt: list[int], method, spec: str, temperature: float, tokens: int, seed: int, clock) -> dict:
    """Where a generation's host time goes: `tokens` tokens under torch.profiler (host activity only: on the
    H200 lent on 2026-12-04, under gVisor, CUPTI's device tracing ran past a 280 s limit), the ops with the
    most host time, and the reads of a scalar to the host (aten::_local_scalar_dense: on a GPU each is a
    synchronisation that drains the launch queue)."""
    from torch.profiler import ProfilerActivity, profile

    from rsd.sampling import SamplingParams

    params = SamplingParams(temperature)
    t = clock.now()
    res = gen.generate(prompt, method, params, tokens, (), seed)
    wall_s = clock.now() - t
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gen.generate(prompt, method, params, tokens, (), seed)
    events = prof.key_averages()
    calls = max(res.stats.target_calls, 1)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]
    return {
        "method": spec,
        "temperature": temperature,
        "tokens": len(res.token_ids),
        "target_calls": res.stats.target_calls,
        "ms_per_target_call": round(1000 * wall_s / calls, 3),
        "scalar_reads_per_target_call": round(
            sum(e.count for e in events if e.key == "aten::_local_scalar_dense") / calls, 1
        ),
        "top_host_ops": [
            {"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1000, 3)} for e in top
        ],
    }


def hf_generate(model, prompt: list[int], tokens: int, clock) -> dict:
    """transformers' own greedy generate on the same model: what a user gets from it alone (tokens/s)."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    model.generate(ids, **kw)  # warm-up
    t = clock.now()
    out = model.generate(ids, **kw)
    s = clock.now() - t
    return {"tokens": int(out.shape[1] - ids.shape[1]), "s": round(s, 4), "tokens_per_s": round(tokens / s, 2)}


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (the shorter length when one is a prefix), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_dtype(args: argparse.Namespace, dirs: dict, dtype: str, deadline: float, clock: Clock) -> dict:
    """Load the pair in `dtype`, time the tree forwards, then every generation case until `deadline`."""
    import torch

    from rsd.methods import Method
    from rsd.sampling import SamplingParams
    from rsd_runtime.generator import SpeculativeGenerator
    from rsd_runtime.lean import lean_decoder
    from rsd_runtime.models import load_model, prepare_draft
    from rsd_runtime.predraft import PipelinedGenerator
    from rsd_runtime.runner import ModelRunner

    out: dict = {"complete": False}
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = clock.now()
    target_model = load_model(dirs["target"], args.device, dtype)
    draft_model = load_model(dirs["draft"], args.device, dtype)
    out["draft_prepared"] = prepare_draft(draft_model, 0, "none", dtype)
    out["draft_lean_forward"] = lean_decoder(draft_model) is not None
    out["attention"] = target_model.config._attn_implementation
    max_len = max(args.context + max(args.tree_sizes), args.prompt_len + args.new_tokens + 64)
    target, draft = ModelRunner(target_model, max_len), ModelRunner(draft_model, max_len)
    out["load_s"] = round(clock.now() - t, 2)
    print(f"[gpu_check] {dtype}: loaded in {out['load_s']} s; timing tree forwards", file=sys.stderr, flush=True)
    out["forward_cost"] = forward_cost(target, draft, args.context, args.tree_sizes, args.reps, clock)

    vocab = target.vocab_size
    prompts = [
        torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed + 1000 + i))
        for i in range(args.prompts)
    ]
    prompts = [p.tolist() for p in prompts]
    methods = [(spec, Method.parse(*spec.split(":", 1))) for spec in args.methods]
    plain = SpeculativeGenerator(target, draft)
    pipelined = PipelinedGenerator(target, draft, max_outcomes=args.predraft)
    for _, method in methods:  # warm-up: every tree shape and the pre-drafting path once, short
        plain.generate(prompts[0], method, SamplingParams(1.0), 4, (), args.seed)
    plain.generate(prompts[0], None, SamplingParams(1.0), 4, (), args.seed)
    pipelined.generate(prompts[0], methods[0][1], SamplingParams(1.0), 4, (), args.seed)

    rows: list[dict] = []
    skipped = 0

    def case(kind: str, spec: str, temperature: float, prompt_idx: int, gen, method) -> list[int] | None:
        nonlocal skipped
        row = {"kind": kind, "method": spec, "temperature": temperature, "prompt": prompt_idx}
        rows.append(row)
        if args.budget_s and time.perf_counter() > deadline:
            row["skipped"] = "budget"
            skipped += 1
            return None
        try:
            res = gen.generate(prompts[prompt_idx], method, SamplingParams(temperature), args.new_tokens, (), args.seed)
        except Exception as e:  # recorded, so one failing path leaves the others' figures
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"
            return None
        row.update(stats_record(res.stats))
        return res.token_ids

    for i in range(args.prompts):  # prompts outermost: a budget cut drops whole prompts, every case of one stays
        for temperature in args.temperatures:
            ar = case("ar", "ar", temperature, i, plain, None)
            for spec, method in methods:
                tokens = case("plain", spec, temperature, i, plain, method)
                if tokens is not None and temperature == 0 and ar is not None:
                    rows[-1]["matches_ar"] = tokens == ar
                    rows[-1]["first_mismatch_vs_ar"] = first_mismatch(tokens, ar)
                piped = case("pipelined", spec, temperature, i, pipelined, method)
                if piped is not None and tokens is not None:
                    rows[-1]["equals_plain"] = piped == tokens
                    rows[-1]["first_mismatch_vs_plain"] = first_mismatch(piped, tokens)
            print(f"[gpu_check] {dtype}: prompt {i}, T={temperature:g} done", file=sys.stderr, flush=True)
    out["generation"] = rows
    if args.profile:
        out["profile"] = [
            profile_case(plain, prompts[0], method, spec, t, args.profile, args.seed, clock)
            for spec, method in [("ar", None), *methods]
            for t in args.temperatures
        ]
        out["hf_generate"] = hf_generate(target_model, prompts[0], args.profile, clock)
    out["summary"] = summarise(rows)
    out["skipped_cases"] = skipped
    out["errors"] = sum("error" in r for r in rows)
    out["complete"] = not skipped and not out["errors"]
    if torch.device(args.device).type == "cuda":
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"error: CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda}): this "
            "check runs the real pair's shapes on a GPU; `--device cpu --tiny` is the smoke run"
        )
    if device.type != "cuda" and not args.tiny:
        raise SystemExit(f"error: --device {args.device} needs --tiny (the real pair's shapes are for a GPU)")
    args.dtypes = args.dtypes.split(",")
    args.methods = args.methods.split(",")
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.tree_sizes = sorted({int(n) for n in args.tree_sizes.split(",")} | {1})
    for spec in args.methods:
        if ":" not in spec:
            raise SystemExit(f"error: --methods entries are method:shape (e.g. sd:4), got {spec!r}")

    start = time.perf_counter()
    configs = pair_configs(args.tiny)
    result: dict = {
        **run_record("gpu_check"),
        "complete": False,
        "tiny": args.tiny,
        "machine": machine_record(args.device),
        "models": {role: config_record(c) for role, c in configs.items()},
        "weights": f"random (transformers' init; seeds target {SEEDS['target']}, draft {SEEDS['draft']}; stored "
        f"{STORED_DTYPE}; loaded through load_model)",
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("out", "tests_junit", "tests_rc", "tests_command")
        },
        "tests": tests_record(args.tests_junit, args.tests_rc, args.tests_command),
        "dtypes": {},
    }
    clock = Clock(args.device)
    with tempfile.TemporaryDirectory(prefix="rsd-gpu-check-") as tmp:
        t = time.perf_counter()
        dirs = {role: build_random_model(c, Path(tmp) / role, SEEDS[role], args.device) for role, c in configs.items()}
        result["build_s"] = round(time.perf_counter() - t, 2)
        for role, (_, num_params) in dirs.items():
            result["models"][role]["num_parameters"] = num_params
        dirs = {role: path for role, (path, _) in dirs.items()}
        print(f"[gpu_check] built the random pair in {result['build_s']} s", file=sys.stderr, flush=True)
        bench_start = time.perf_counter()
        for i, dtype in enumerate(args.dtypes):
            deadline = bench_start + args.budget_s * (i + 1) / len(args.dtypes)
            try:
                result["dtypes"][dtype] = run_dtype(args, dirs, dtype, deadline, clock)
            except Exception as e:  # a dtype that cannot load or run leaves the others' figures
                traceback.print_exc()
                result["dtypes"][dtype] = {"complete": False, "error": f"{type(e).__name__}: {e}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()  # this dtype's models are gone: give their memory back before the next
            write(result, args.out, start)  # each dtype's figures land as it ends: a run cut short keeps them
    text = write(result, args.out, start)
    print(text)
    return 1 if any(d.get("error") or d.get("errors") for d in result["dtypes"].values()) else 0  # skips are no error


def write(result: dict, out: Path, start: float) -> str:
    """Write the result json and its .md summary as they stand; returns the summary."""
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    tests = result["tests"]
    result["complete"] = all(d.get("complete") for d in result["dtypes"].values()) and (
        tests is None or tests.get("rc") == 0
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    out.with_suffix(".md").write_text(text)
    return text


if __name__ == "__main__":
    raise SystemExit(main())

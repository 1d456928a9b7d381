"""Benchmark of the distributed services: overhead, verifier capacity, and where a step's time goes.

    python -m rsd_bench.services --tiny --name services-cpu
    python -m rsd_bench.services --draft DIR --target DIR --overhead-only --num-prompts 1 \\
        --max-new-tokens 16 --name services-real

The services run as real processes (verifier, drafter, gateway; `python -m <service>`, one torch
thread each by default), so they share no GIL with this client or with each other. Three parts:

1. Overhead: the same prompts, seeds and settings through the in-process SpeculativeGenerator
   (this process, same torch threads) and through the gateway (one session at a time). Ratio =
   gateway tok/s / in-process tok/s; the token ids are compared too (they must match).
2. Capacity: N concurrent sessions through the gateway, for each batching setting of --batching
   (verifier/drafter: "on" = both batch; "on/off" = the drafter drafts each session on its own;
   "off/off" = neither), the verifier and drafter restarted on their ports between settings.
   Aggregate tok/s = all tokens / wall time of the N sessions; speedup = aggregate / aggregate
   with 1 session (same batching setting).
3. Step split, from the StepStats of every delta: draft_ms (drafter), queue_ms and verify_ms
   (VerifierStats.queue_ms / forward_ms: batched target forward + acceptance walk), transfer_ms =
   round_trip_ms - queue_ms - verify_ms (gRPC both ways, (de)serialisation, verifier servicer), and
   residual_ms = the client-observed time between two deltas - draft_ms - round_trip_ms (the
   drafter applying the verdict, drafter -> gateway -> client streaming, gateway bookkeeping). The
   first step of a turn (attach + prefill) is excluded from the means and reported as first_step_ms.

--tiny builds a "medium tiny" qwen2 pair (see --vocab-size, --hidden-size, --num-layers,
--draft-layers) so that compute is not negligible next to the per-call overhead.
Writes benchmarks/results/<name>.json and <name>.md, with the CPU flags, the load and each service's cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rsd_bench.gateway_runs import Run, concurrent_runs, est_ratio, gateway_run, step_split
from rsd_bench.machine import machine_info, run_record
from rsd_bench.services_report import MISSING, SPLIT_DEFINITIONS, render_md
from rsd_tools.defaults import CODE_PROMPT, DEFAULT_METHOD, DEFAULT_SHAPES, RESULTS_DIR, TEMPERATURES
from rsd_tools.launcher import (
    Cluster,
    drafter_command,
    free_port,
    gateway_command,
    model_dirs,
    service_env,
    verifier_command,
    wait_all_ready,
)

CODE_PROMPTS = [
    CODE_PROMPT,
    "def is_prime(n: int) -> bool:\n    ",
    "import json\n\n\ndef load_config(path):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
]


# ---------------------------------------------------------------------------------------------
# Services as processes


def _verifier_name(batching: bool) -> str:
    return f"verifier-batching-{'on' if batching else 'off'}"


def _drafter_name(batching: bool) -> str:
    return f"drafter-batching-{'on' if batching else 'off'}"


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def parse_batching(text: str) -> list[tuple[bool, bool]]:
    """--batching "on,on/off,off/off" -> [(verifier batching, drafter batching)], drafter "on" when omitted."""
    flags = {"on": True, "off": False}
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        verifier, _, drafter = item.partition("/")
        if verifier not in flags or (drafter or "on") not in flags:
            raise SystemExit(f"--batching: {item!r} is not on|off[/on|off]")
        out.append((flags[verifier], flags[drafter or "on"]))
    if out and out[0] != (True, True):
        raise SystemExit("--batching: the services start with batching on; list 'on' first")
    return out


@dataclass
class Services:
    """The verifier, drafter and gateway processes (rsd_tools.launcher) and how to start the verifier again."""

    cluster: Cluster
    verifier_cmd: list[str]  # without --batching
    drafter_cmd: list[str]  # without --batching
    gateway_address: str
    batching: tuple[bool, bool] = (True, True)  # (verifier, drafter) as running

    def set_batching(self, batching: tuple[bool, bool], start_timeout_s: float) -> None:
        """Restart the verifier and/or drafter whose batching differs, on the same ports (the gateway's
        static lists hold them)."""
        restarted = []
        for role, cmd, on, was, name in (
            ("verifier", self.verifier_cmd, batching[0], self.batching[0], _verifier_name),
            ("drafter", self.drafter_cmd, batching[1], self.batching[1], _drafter_name),
        ):
            if on != was:
                old = next(p for p in self.cluster.processes if p.name.startswith(role))
                flag = ["--batching", "true" if on else "false"]
                restarted.append(self.cluster.restart_with(old, name(on), [*cmd, *flag]))
        wait_all_ready(restarted, start_timeout_s)
        self.batching = batching


def start_services(
    draft_dir: Path, target_dir: Path, args: argparse.Namespace, run_dir: Path, batching: bool = True
) -> Services:
    """Verifier, drafter and gateway (embedded store, static service lists), started, not waited for."""
    cluster, env = Cluster(run_dir), service_env()
    threads, drain = ["--threads", str(args.threads)], ["--drain-s", "1"]
    slots = str(max(8, *args.sessions))
    v_port, d_port, g_port = free_port(), free_port(), free_port()
    verifier_flags = ["--num-slots", slots, "--max-len", str(args.max_len), "--dtype", args.dtype, *threads]
    if args.batch_wait_ms is not None:
        verifier_flags += ["--batch-wait-ms", str(args.batch_wait_ms)]
    verifier_cmd = verifier_command(
        v_port, target_dir, "verifier-0", *verifier_flags, *drain, cores=args.verifier_cores
    )
    drafter_flags = ["--max-sessions", slots, "--max-len", str(args.max_len), *threads]
    drafter_flags += ["--proposal-top-k", str(args.draft_top_k), "--quantize", args.draft_quantize, *drain]
    if args.predraft is not None:
        drafter_flags += ["--predraft", args.predraft]
    static = ["--drafters", f"drafter-0=127.0.0.1:{d_port}", "--verifiers", f"verifier-0=127.0.0.1:{v_port}"]
    try:
        batching_flag = ["--batching", "true" if batching else "false"]
        cluster.spawn(_verifier_name(batching), [*verifier_cmd, *batching_flag], env, f"127.0.0.1:{v_port}")
        drafter_cmd = drafter_command(d_port, draft_dir, "drafter-0", *drafter_flags, cores=args.drafter_cores)
        cluster.spawn(_drafter_name(True), [*drafter_cmd, "--batching", "true"], env, f"127.0.0.1:{d_port}")
        gateway = gateway_command(g_port, target_dir, *static, *drain, cores=args.gateway_cores)
        cluster.spawn("gateway", gateway, env, f"127.0.0.1:{g_port}")
    except BaseException:
        cluster.stop(15.0)
        raise
    return Services(cluster, verifier_cmd, drafter_cmd, f"127.0.0.1:{g_port}")


def wait_services(services: Services, timeout_s: float) -> None:
    """Return when every service answers health SERVING (stop them all on failure)."""
    try:
        wait_all_ready(services.cluster.processes, timeout_s)
    except BaseException:
        services.cluster.stop(at_once=True)
        raise


# ---------------------------------------------------------------------------------------------
# Models and prompts


def make_prompts(tokenizer, args) -> list[list[int]]:
    if args.tiny:
        rng = random.Random(args.seed)
        words = (tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else args.vocab_size) - 4
        return [[2] + [4 + rng.randrange(words) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    return [tokenizer.encode(CODE_PROMPTS[i % len(CODE_PROMPTS)]) for i in range(args.num_prompts)]


def load_models(draft_dir: Path, target_dir: Path, args) -> list:
    import torch

    from rsd_runtime.models import load_model, prepare_draft

    torch.set_num_threads(args.threads)
    draft = load_model(draft_dir)
    prepare_draft(draft, quantize=args.draft_quantize)
    return [draft, load_model(target_dir, dtype=args.dtype)]


class InProcess:
    """The in-process SpeculativeGenerator on the same models and settings (warmed up once)."""

    def __init__(self, models: list, prompts: list[list[int]], eos: tuple[int, ...], args):
        from rsd.methods import Method
        from rsd_runtime.generator import SpeculativeGenerator
        from rsd_runtime.runner import ModelRunner

        draft, target = models
        self.gen = SpeculativeGenerator(
            ModelRunner(target, args.max_len), ModelRunner(draft, args.max_len), draft_top_k=args.draft_top_k
        )
        self.method, self.eos, self.args = Method.parse(args.method, args.shape), eos, args
        self.run(prompts[0], 0.0, args.seed, max_new_tokens=min(8, args.max_new_tokens))  # warm-up

    def run(self, prompt: list[int], temperature: float, seed: int, max_new_tokens: int = 0) -> tuple:
        """-> (token_ids, wall_s, steps, draft_s, verify_s)"""
        from rsd.sampling import SamplingParams

        t0 = time.perf_counter()
        res = self.gen.generate(
            prompt, self.method, SamplingParams(temperature), max_new_tokens or self.args.max_new_tokens, self.eos, seed
        )
        st = res.stats
        return res.token_ids, time.perf_counter() - t0, st.target_calls, st.draft_s, st.verify_s


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.services", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a medium tiny qwen2 pair (the default without --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--target")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--vocab-size", type=int, default=2000)
    ap.add_argument("--hidden-size", type=int, default=384)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--sessions", default="1,4,8", help="concurrent sessions for the capacity part")
    ap.add_argument(
        "--batching",
        default="on,on/off,off/off",
        help="capacity part: batching settings in order, each verifier[/drafter] on|off (drafter default on)",
    )
    ap.add_argument("--overhead-only", action="store_true", help="skip the capacity part")
    ap.add_argument("--capacity-only", action="store_true", help="skip the overhead part (and its in-process runs)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16, help="tiny prompts: words")
    ap.add_argument("--method", default=DEFAULT_METHOD)
    ap.add_argument("--shape", default=DEFAULT_SHAPES[DEFAULT_METHOD])
    ap.add_argument(
        "--temperatures", default=TEMPERATURES, help="overhead part; capacity runs T=0, plus T=1 at max sessions"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (this one included)")
    ap.add_argument("--draft-top-k", type=int, default=256, help="the drafter's proposal_top_k (both sides)")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", help="the target's dtype (verifier and in-process)")
    ap.add_argument("--draft-quantize", default="none", help="the drafter's quantize: none, int8, auto")
    ap.add_argument("--predraft", choices=["true", "false"], default=None, help="the drafter's (default: its own)")
    ap.add_argument("--verifier-cores", default="", help="CPU list for the verifier (default: any)")
    ap.add_argument("--drafter-cores", default="", help="CPU list for the drafter (default: any)")
    ap.add_argument("--gateway-cores", default="", help="CPU list for the gateway (default: any)")
    ap.add_argument("--batch-wait-ms", type=float, default=None, help="the verifier's (default: its own)")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--request-timeout-s", type=float, default=3600.0)
    ap.add_argument("--name", default="services-cpu")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--run-dir", default=None, help="service logs (default: a temporary folder)")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, with the lists parsed (sessions always include 1)."""
    args = build_parser().parse_args(argv)
    args.tiny = args.tiny or not (args.draft or args.target)
    args.sessions = sorted({1, *(int(x) for x in args.sessions.split(",") if x)})
    args.batching = parse_batching(args.batching)
    args.temperatures = [float(x) for x in args.temperatures.split(",") if x]
    return args


def overhead_row(temp: float, runs: list[Run], ref: list[tuple], parts: dict, interleave: bool) -> dict:
    """Gateway runs (parts: their step_split) against the in-process runs (InProcess.run tuples) of the
    same prompts and seeds."""
    ref_tokens = sum(len(r[0]) for r in ref)
    gw_tokens = sum(len(r.token_ids) for r in runs)
    ip_tok_s, gw_tok_s = ref_tokens / sum(r[1] for r in ref), gw_tokens / sum(r.wall_s for r in runs)
    ref_steps = max(sum(r[2] for r in ref), 1)
    return {
        "temperature": temp,
        "inprocess_tok_s": round(ip_tok_s, 3),
        "gateway_tok_s": round(gw_tok_s, 3),
        "ratio": round(gw_tok_s / ip_tok_s, 4),
        "tokens_match": all(r.token_ids == x[0] for r, x in zip(runs, ref, strict=True)),
        "inprocess_tokens": ref_tokens,
        "gateway_tokens": gw_tokens,
        "inprocess_wall_s": round(sum(r[1] for r in ref), 3),
        "gateway_wall_s": round(sum(r.wall_s for r in runs), 3),
        "block_efficiency": round(gw_tokens / max(sum(r.num_steps for r in runs), 1), 3),
        "est_ratio_from_split": est_ratio(parts),
        # the in-process generator's own split (GenerationStats), per step: draft
        # includes applying the verdict; verify is the target forward + acceptance
        "inprocess_step_ms": round(1000 * sum(r[1] for r in ref) / ref_steps, 3),
        "inprocess_draft_ms": round(1000 * sum(r[3] for r in ref) / ref_steps, 3),
        "inprocess_verify_ms": round(1000 * sum(r[4] for r in ref) / ref_steps, 3),
        "interleaved": interleave,
    }


def measure_capacity(services: Services, prompts: list[list[int]], args, log) -> tuple[list[dict], list[dict]]:
    """N concurrent sessions per batching setting (services restarted between settings);
    -> (capacity rows, step split rows)."""
    address, capacity, split = services.gateway_address, [], []
    capacity_prompts = prompts * (max(args.sessions) // len(prompts) + 1)
    for k, (batching, draft_batching) in enumerate(args.batching):
        if k > 0:
            log(f"batching: verifier {_on_off(batching)}, drafter {_on_off(draft_batching)} (restarting)")
            services.set_batching((batching, draft_batching), args.start_timeout_s)
            gateway_run(address, prompts[0], args, 0.0, args.seed, max_new_tokens=8)  # warm-up
        cases = [(n, 0.0) for n in args.sessions] + [(max(args.sessions), 1.0)]
        base = None
        for n, temp in cases:
            runs, wall = concurrent_runs(address, capacity_prompts, args, n, temp)
            tokens = sum(len(r.token_ids) for r in runs)
            agg = tokens / wall
            if n == 1 and temp == 0.0:
                base = agg
            parts = step_split(runs)
            capacity.append(
                {
                    "batching": batching,
                    "draft_batching": draft_batching,
                    "temperature": temp,
                    "sessions": n,
                    "tokens": tokens,
                    "wall_s": round(wall, 3),
                    "aggregate_tok_s": round(agg, 3),
                    "per_session_tok_s": round(statistics.fmean(len(r.token_ids) / r.wall_s for r in runs), 3),
                    "speedup_vs_1": round(agg / base, 3),
                    "mean_batch_sessions": parts["mean_batch_sessions"],
                }
            )
            label = f"{n} session(s), T={temp:g}, batching {_on_off(batching)}/{_on_off(draft_batching)}"
            split.append({"run": label, **parts})
            log(f"capacity {label}: {agg:.1f} tok/s (x{agg / base:.2f})")
    return capacity, split


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    machine = machine_info()  # the CPU flags and the load before anything starts

    from rsd_runtime.tokenizer import load_tokenizer

    tiny_shape = {k: getattr(args, k) for k in ("vocab_size", "hidden_size", "num_layers", "draft_layers")}
    draft_dir, target_dir = model_dirs(args.draft, args.target, args.cache_dir, tiny=True, **tiny_shape)
    tokenizer = load_tokenizer(target_dir)
    eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    prompts = make_prompts(tokenizer, args)
    log = lambda msg: print(f"[bench_services {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr)  # noqa: E731

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="rsd-bench-services-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # Tiny models: the services import and load while this process does (nothing is timed before all
    # are healthy), and in-process and gateway runs alternate prompt by prompt, so that a change of
    # the machine's load hits both sides alike. Real models: in-process first, freed, then the
    # services (memory).
    interleave, services, ip, reference = args.tiny and not args.capacity_only, None, None, {}
    if interleave:
        log(f"starting services (logs in {run_dir})")
        services = start_services(draft_dir, target_dir, args, run_dir, batching=True)
    try:
        if not args.capacity_only:  # the in-process reference of the overhead part
            ip = InProcess(load_models(draft_dir, target_dir, args), prompts, eos, args)
        if services is not None:
            wait_services(services, args.start_timeout_s)
        elif not args.capacity_only:
            log(f"in-process reference: {len(prompts)} prompt(s) x T={args.temperatures}")
            reference = {t: [ip.run(p, t, args.seed + i) for i, p in enumerate(prompts)] for t in args.temperatures}
            ip = None
            gc.collect()
    except BaseException:
        if services is not None:
            services.cluster.stop(at_once=True)
        raise
    if services is None:
        log(f"starting services (logs in {run_dir})")
        services = start_services(draft_dir, target_dir, args, run_dir, batching=True)
        wait_services(services, args.start_timeout_s)
    overhead, split, capacity = [], [], []
    try:
        address = services.gateway_address
        gateway_run(address, prompts[0], args, 0.0, args.seed, max_new_tokens=8)  # warm-up (first forwards, channels)
        for temp in [] if args.capacity_only else args.temperatures:
            runs, ref = [], reference.get(temp, [])
            for i, prompt in enumerate(prompts):
                if ip is not None:
                    ref.append(ip.run(prompt, temp, args.seed + i))
                runs.append(gateway_run(address, prompt, args, temp, args.seed + i))
            parts = step_split(runs)
            overhead.append(overhead_row(temp, runs, ref, parts, interleave))
            split.append({"run": f"overhead T={temp:g} (1 session, batching on/on)", **parts})
            log(f"overhead T={temp:g}: ratio {overhead[-1]['ratio']:.3f}")
        ip = None
        gc.collect()
        if not args.overhead_only:
            capacity, capacity_split = measure_capacity(services, prompts, args, log)
            split += capacity_split
    finally:
        services.cluster.stop(at_once=True)

    report = {
        **run_record("services"),
        "name": args.name,
        "complete": True,  # written only after every part ran (a failure raises before this)
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m rsd_bench.services " + " ".join(argv if argv is not None else sys.argv[1:]),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "host": {"cpus": os.cpu_count(), **machine, "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "models": {
            "draft": str(draft_dir),
            "target": str(target_dir),
            "tiny": args.tiny,
            **(tiny_shape if args.tiny else {}),
        },
        "settings": {
            "method": args.method,
            "shape": args.shape,
            "max_new_tokens": args.max_new_tokens,
            "num_prompts": len(prompts),
            "prompt_lengths": [len(p) for p in prompts],
            "temperatures": args.temperatures,
            "sessions": args.sessions if not args.overhead_only else [],
            "threads": args.threads,
            "placement": {  # "" = not pinned
                "verifier_cores": args.verifier_cores,
                "drafter_cores": args.drafter_cores,
                "gateway_cores": args.gateway_cores,
            },
            "dtype": args.dtype,
            "draft_quantize": args.draft_quantize,
            "predraft": args.predraft or "the drafter's default",
            "draft_top_k": args.draft_top_k,
            "seed": args.seed,
            "batch_wait_ms": args.batch_wait_ms,
            "store": "embedded",
        },
        "overhead": overhead,
        "capacity": capacity,
        "step_split": split,
        "split_definitions": SPLIT_DEFINITIONS,
        "missing": MISSING,
        "run_dir": str(run_dir),
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{args.name}.md").write_text(render_md(report))
    log(f"wrote {out_dir / args.name}.json and .md in {report['elapsed_s']:.0f} s")
    print(render_md(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

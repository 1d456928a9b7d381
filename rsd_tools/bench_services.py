"""Benchmark of the distributed services: overhead, verifier capacity, and where a step's time goes.

    python -m rsd_tools.bench_services --tiny --name services-cpu
    python -m rsd_tools.bench_services --draft DIR --target DIR --overhead-only --num-prompts 1 \\
        --max-new-tokens 16 --name services-real

The services run as real processes (verifier, drafter, gateway; `python -m <service>`, one torch
thread each by default), so they share no GIL with this client or with each other. Three parts:

1. Overhead: the same prompts, seeds and settings through the in-process SpeculativeGenerator
   (this process, same torch threads) and through the gateway (one session at a time). Ratio =
   gateway tok/s / in-process tok/s; the token ids are compared too (they must match).
2. Capacity: N concurrent sessions through the gateway, batching on, then the verifier restarted
   with --batching false (same port). Aggregate tok/s = all tokens / wall time of the N sessions;
   speedup = aggregate / aggregate with 1 session (same batching setting).
3. Step split, from the StepStats of every delta: draft_ms (drafter), queue_ms and verify_ms
   (VerifierStats.queue_ms / forward_ms: batched target forward + acceptance walk), transfer_ms =
   round_trip_ms - queue_ms - verify_ms (gRPC both ways, (de)serialisation, verifier servicer), and
   residual_ms = the client-observed time between two deltas - draft_ms - round_trip_ms (the
   drafter applying the verdict, drafter -> gateway -> client streaming, gateway bookkeeping). The
   first step of a turn (attach + prefill) is excluded from the means and reported as first_step_ms.

--tiny builds a "medium tiny" qwen2 pair (see --vocab-size, --hidden-size, --num-layers,
--draft-layers) so that compute is not negligible next to the per-call overhead.
Writes benchmarks/results/<name>.json and <name>.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rsd_tools.cluster import Cluster, _wait_ready, free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CODE_PROMPTS = [
    "# Return the n-th Fibonacci number\ndef fibonacci(n):",
    "def is_prime(n: int) -> bool:\n    ",
    "import json\n\n\ndef load_config(path):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
]


# ---------------------------------------------------------------------------------------------
# Services as processes


@dataclass
class Services:
    cluster: Cluster
    verifier_port: int
    verifier_cmd: list[str]
    env: dict[str, str]
    gateway_address: str

    def restart_verifier(self, batching: bool, start_timeout_s: float) -> None:
        """Stop the verifier and start it again on the same port (the gateway's static list holds it)."""
        old = next(p for p in self.cluster.processes if p.name.startswith("verifier"))
        old.proc.terminate()
        old.proc.wait(30)
        self.cluster.processes.remove(old)
        cmd = [*self.verifier_cmd, "--batching", "true" if batching else "false"]
        name = f"verifier-batching-{'on' if batching else 'off'}"
        proc = self.cluster.spawn(name, cmd, self.env, old.address)
        asyncio.run(_wait_ready(proc, start_timeout_s))

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to all at once (the launcher stops them one by one), SIGKILL what is left."""
        procs = [p.proc for p in self.cluster.processes]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.cluster.processes.clear()


def start_services(
    draft_dir: Path, target_dir: Path, args: argparse.Namespace, run_dir: Path, batching: bool = True
) -> Services:
    """Verifier, drafter and gateway (embedded store, static service lists); returns when all are healthy."""
    cluster = Cluster(run_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    py, threads = sys.executable, ["--threads", str(args.threads)]
    slots = str(max(8, *args.sessions))
    v_port, d_port, g_port = free_port(), free_port(), free_port()
    verifier_cmd = [py, "-m", "verifier_service", "--port", str(v_port), "--model", str(target_dir)]
    verifier_cmd += ["--verifier-id", "verifier-0", "--num-slots", slots, "--max-len", str(args.max_len), *threads]
    if args.batch_wait_ms is not None:
        verifier_cmd += ["--batch-wait-ms", str(args.batch_wait_ms)]
    drafter_cmd = [py, "-m", "drafter_service", "--port", str(d_port), "--model", str(draft_dir)]
    drafter_cmd += ["--drafter-id", "drafter-0", "--max-sessions", slots, "--max-len", str(args.max_len), *threads]
    drafter_cmd += ["--proposal-top-k", str(args.draft_top_k)]
    gateway_cmd = [py, "-m", "gateway", "--port", str(g_port), "--tokenizer", str(target_dir)]
    gateway_cmd += ["--drafters", f"drafter-0=127.0.0.1:{d_port}", "--verifiers", f"verifier-0=127.0.0.1:{v_port}"]
    drain = ["--drain-s", "1"]
    verifier_cmd += drain
    drafter_cmd += drain
    gateway_cmd += drain
    try:
        [
            cluster.spawn(
                f"verifier-batching-{'on' if batching else 'off'}",
                [*verifier_cmd, "--batching", "true" if batching else "false"],
                env,
                f"127.0.0.1:{v_port}",
            ),
            cluster.spawn("drafter", drafter_cmd, env, f"127.0.0.1:{d_port}"),
            cluster.spawn("gateway", gateway_cmd, env, f"127.0.0.1:{g_port}"),
        ]
    except BaseException:
        cluster.stop(15.0)
        raise
    return Services(cluster, v_port, verifier_cmd, env, f"127.0.0.1:{g_port}")


def wait_services(services: Services, timeout_s: float) -> None:
    """Return when every service answers health SERVING (stop them all on failure)."""

    async def all_ready() -> None:
        await asyncio.gather(*(_wait_ready(p, timeout_s) for p in services.cluster.processes))

    try:
        asyncio.run(all_ready())
    except BaseException:
        services.stop()
        raise


# ---------------------------------------------------------------------------------------------
# Runs


@dataclass
class Run:
    """One generation through the gateway, timed on the client."""

    token_ids: list[int]
    wall_s: float
    start: float
    end: float
    steps: list = field(default_factory=list)  # common_pb2.StepStats per delta
    arrivals: list[float] = field(default_factory=list)  # perf_counter at each delta
    num_steps: int = 0


def gateway_run(
    address: str, prompt_ids: list[int], args, temperature: float, seed: int, barrier=None, max_new_tokens: int = 0
) -> Run:
    from rsd_service.client import RsdClient

    with RsdClient(address, timeout_s=args.request_timeout_s) as client:
        if barrier is not None:
            barrier.wait()
        t0 = time.perf_counter()
        gen = client.generate(
            token_ids=prompt_ids,
            method=args.method,
            shape=args.shape,
            temperature=temperature,
            max_new_tokens=max_new_tokens or args.max_new_tokens,
            seed=seed,
        )
        arrivals = []
        for _ in gen:
            arrivals.append(time.perf_counter())
        t1 = time.perf_counter()
    if gen.finished is None:
        raise RuntimeError("the gateway stream ended without a finish event")
    return Run(list(gen.token_ids), t1 - t0, t0, t1, list(gen.steps), [t0, *arrivals], gen.finished.num_steps)


def concurrent_runs(
    address: str, prompts: list[list[int]], args, n: int, temperature: float
) -> tuple[list[Run], float]:
    """n sessions started together (a barrier); -> (runs, wall from the first start to the last end)."""
    barrier = threading.Barrier(n)
    runs: list[Run | None] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            runs[i] = gateway_run(address, prompts[i % len(prompts)], args, temperature, args.seed + i, barrier)
        except BaseException as e:  # reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = max(r.end for r in runs) - min(r.start for r in runs)
    return runs, wall


def step_split(runs: list[Run]) -> dict:
    """Mean ms per step of each part (first step of each run excluded), plus what the runs carried."""
    parts: dict[str, list[float]] = {k: [] for k in ("draft", "transfer", "queue", "verify", "residual", "step")}
    first, batch_sessions, accepted, drafted = [], [], 0, 0
    for run in runs:
        for i, s in enumerate(run.steps):
            accepted, drafted = accepted + s.num_accepted_tokens, drafted + s.num_draft_tokens
            batch_sessions.append(s.verifier.batch_num_sessions)
            interval = (run.arrivals[i + 1] - run.arrivals[i]) * 1000
            if i == 0:
                first.append(interval)
                continue
            v = s.verifier
            parts["draft"].append(s.draft_ms)
            parts["queue"].append(v.queue_ms)
            parts["verify"].append(v.forward_ms)
            parts["transfer"].append(s.round_trip_ms - v.queue_ms - v.forward_ms)
            parts["residual"].append(interval - s.draft_ms - s.round_trip_ms)
            parts["step"].append(interval)
    out = {f"{k}_ms": round(statistics.fmean(v), 3) if v else None for k, v in parts.items()}
    out["first_step_ms"] = round(statistics.fmean(first), 3) if first else None
    out["num_steps"] = len(parts["step"])
    out["mean_batch_sessions"] = round(statistics.fmean(batch_sessions), 3) if batch_sessions else None
    out["acceptance"] = round(accepted / drafted, 4) if drafted else None
    tokens = sum(len(r.token_ids) for r in runs)
    out["block_efficiency"] = round(tokens / max(sum(r.num_steps for r in runs), 1), 3)
    return out


def est_ratio(parts: dict) -> float | None:
    """The overhead ratio the step split implies: compute (draft + verify) / client-observed step.
    Measured within the same steps, so it does not drift with the machine's load as two separate
    wall-time runs do; it slightly underestimates (the drafter's accept is in `residual`)."""
    if not parts["step_ms"]:
        return None
    return round((parts["draft_ms"] + parts["verify_ms"]) / parts["step_ms"], 4)


# ---------------------------------------------------------------------------------------------
# Models and prompts


def model_dirs(args) -> tuple[Path, Path]:
    if args.draft and args.target:
        return Path(args.draft), Path(args.target)
    if args.draft or args.target:
        raise SystemExit("give both --draft and --target, or --tiny")
    from rsd_tools.provision import default_cache_dir
    from rsd_tools.tiny import build_tiny_pair

    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    return build_tiny_pair(
        cache / "tiny",
        "qwen2",
        args.vocab_size,
        0,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        draft_layers=args.draft_layers,
    )


def make_prompts(tokenizer, args) -> list[list[int]]:
    if args.tiny:
        rng = random.Random(args.seed)
        words = (tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else args.vocab_size) - 4
        return [[2] + [4 + rng.randrange(words) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    return [tokenizer.encode(CODE_PROMPTS[i % len(CODE_PROMPTS)]) for i in range(args.num_prompts)]


def load_models(draft_dir: Path, target_dir: Path, args) -> list:
    import torch

    from rsd_runtime.models import load_model

    torch.set_num_threads(args.threads)
    return [load_model(draft_dir), load_model(target_dir)]


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


# ---------------------------------------------------------------------------------------------
# Report


def render_md(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"# {report['name']}",
        "",
        f"{report['created']}; `{report['command']}`; {report['elapsed_s']:.0f} s in all.",
        "",
        f"Models: draft `{report['models']['draft']}`, target `{report['models']['target']}`. "
        f"Method {s['method']} {s['shape']}, {s['max_new_tokens']} new tokens, {s['num_prompts']} prompt(s), "
        f"draft top-k {s['draft_top_k']}, torch threads {s['threads']} per process, "
        f"{report['host']['cpus']} CPUs. Services as processes, embedded gateway store, no Redis.",
        "",
        "## Distributed overhead (1 session; gateway tok/s / in-process tok/s)",
        "",
        "| T | in-process tok/s | gateway tok/s | ratio | ratio from step split | tokens match | block eff. "
        "| in-process ms/step: draft + verify = step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["overhead"]:
        lines.append(
            f"| {r['temperature']:g} | {r['inprocess_tok_s']:.2f} | {r['gateway_tok_s']:.2f} | "
            f"**{r['ratio']:.3f}** | {r['est_ratio_from_split']} | {r['tokens_match']} | {r['block_efficiency']:.2f} "
            f"| {r['inprocess_draft_ms']:.1f} + {r['inprocess_verify_ms']:.1f} = {r['inprocess_step_ms']:.1f} |"
        )
    order = (
        "alternating prompt by prompt"
        if report["overhead"] and report["overhead"][0]["interleaved"]
        else ("in-process first, then the services")
    )
    lines += [
        "",
        f"In-process and gateway runs: {order}. Ratio from step split = (draft + verify) / step of the "
        "same gateway steps (see below): the share of a step that is model compute.",
    ]
    if report["capacity"]:
        lines += [
            "",
            "## Verifier capacity (N concurrent sessions through the gateway)",
            "",
            "| batching | T | sessions | tokens | wall s | aggregate tok/s | × 1 session | mean sessions/forward |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in report["capacity"]:
            lines.append(
                f"| {'on' if r['batching'] else 'off'} | {r['temperature']:g} | {r['sessions']} | {r['tokens']} | "
                f"{r['wall_s']:.2f} | {r['aggregate_tok_s']:.2f} | **{r['speedup_vs_1']:.2f}** | "
                f"{r['mean_batch_sessions']} |"
            )
    lines += [
        "",
        "## Time per step (ms, mean over steps, first step of each turn excluded)",
        "",
        "| run | draft | transfer | queue | verify | residual | step | first step | steps | tok/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "–" if x is None else f"{x:.1f}"

    for r in report["step_split"]:
        lines.append(
            f"| {r['run']} | {f(r['draft_ms'])} | {f(r['transfer_ms'])} | {f(r['queue_ms'])} | {f(r['verify_ms'])} | "
            f"{f(r['residual_ms'])} | {f(r['step_ms'])} | {f(r['first_step_ms'])} | {r['num_steps']} | "
            f"{r['block_efficiency']:.2f} |"
        )
    lines += ["", "Columns: " + report["split_definitions"], "", "Not measured by the services' stats:", ""]
    lines += [f"- {m}" for m in report["missing"]]
    return "\n".join(lines) + "\n"


SPLIT_DEFINITIONS = (
    "draft = StepStats.draft_ms (drafter builds the tree); queue = VerifierStats.queue_ms; verify = "
    "VerifierStats.forward_ms (batched target forward + acceptance walk); transfer = round_trip_ms - queue - "
    "verify (gRPC both ways, (de)serialisation, verifier servicer); residual = client-observed time between "
    "two deltas - draft_ms - round_trip_ms (drafter applies the verdict, drafter -> gateway -> client stream, "
    "gateway bookkeeping); step = client-observed time between two deltas."
)
MISSING = [
    "accept: the drafter's time to apply a verdict (drafter.accept, K/V commit) is not in StepStats; it is "
    "inside `residual` together with the drafter -> gateway -> client hops and the gateway's work",
    "verify is not split into the target forward and the acceptance walk (VerifierStats.forward_ms holds both)",
    "transfer is not split into the two directions nor into serialisation vs network (no timestamps cross the wire)",
    "the verifier's Attach / prefill time is not reported; it is part of first_step_ms here",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rsd_tools.bench_services", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a medium tiny qwen2 pair (the default without --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--target")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--vocab-size", type=int, default=2000)
    ap.add_argument("--hidden-size", type=int, default=384)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--sessions", default="1,4,8", help="concurrent sessions for the capacity part")
    ap.add_argument("--batching", default="on,off", help="capacity part: verifier batching settings, in order")
    ap.add_argument("--overhead-only", action="store_true", help="skip the capacity part")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16, help="tiny prompts: words")
    ap.add_argument("--method", default="rsd_s")
    ap.add_argument("--shape", default="3x4")
    ap.add_argument("--temperatures", default="0,1", help="overhead part; capacity runs T=0, plus T=1 at max sessions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (this one included)")
    ap.add_argument("--draft-top-k", type=int, default=256, help="the drafter's proposal_top_k (both sides)")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--batch-wait-ms", type=float, default=None, help="the verifier's (default: its own)")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--request-timeout-s", type=float, default=3600.0)
    ap.add_argument("--name", default="services-cpu")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--run-dir", default=None, help="service logs (default: a temporary folder)")
    args = ap.parse_args(argv)
    args.tiny = args.tiny or not (args.draft or args.target)
    args.sessions = sorted({1, *(int(x) for x in args.sessions.split(",") if x)})
    args.batching = [{"on": True, "off": False}[x.strip()] for x in args.batching.split(",") if x.strip()]
    if args.batching and not args.batching[0]:
        raise SystemExit("--batching: the services start with batching on; list 'on' first")
    args.temperatures = [float(x) for x in args.temperatures.split(",") if x]
    t_start = time.perf_counter()

    from rsd_runtime.models import load_tokenizer

    draft_dir, target_dir = model_dirs(args)
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
    interleave, services, ip, reference = args.tiny, None, None, {}
    if interleave:
        log(f"starting services (logs in {run_dir})")
        services = start_services(draft_dir, target_dir, args, run_dir, batching=True)
    try:
        ip = InProcess(load_models(draft_dir, target_dir, args), prompts, eos, args)
        if services is not None:
            wait_services(services, args.start_timeout_s)
        else:
            log(f"in-process reference: {len(prompts)} prompt(s) x T={args.temperatures}")
            reference = {t: [ip.run(p, t, args.seed + i) for i, p in enumerate(prompts)] for t in args.temperatures}
            ip = None
            gc.collect()
    except BaseException:
        if services is not None:
            services.stop()
        raise
    if services is None:
        log(f"starting services (logs in {run_dir})")
        services = start_services(draft_dir, target_dir, args, run_dir, batching=True)
        wait_services(services, args.start_timeout_s)
    overhead, split, capacity = [], [], []
    try:
        address = services.gateway_address
        gateway_run(address, prompts[0], args, 0.0, args.seed, max_new_tokens=8)  # warm-up (first forwards, channels)
        for temp in args.temperatures:
            runs, ref = [], reference.get(temp, [])
            for i, prompt in enumerate(prompts):
                if ip is not None:
                    ref.append(ip.run(prompt, temp, args.seed + i))
                runs.append(gateway_run(address, prompt, args, temp, args.seed + i))
            parts = step_split(runs)
            ref_tokens = sum(len(r[0]) for r in ref)
            gw_tokens = sum(len(r.token_ids) for r in runs)
            ip_tok_s, gw_tok_s = ref_tokens / sum(r[1] for r in ref), gw_tokens / sum(r.wall_s for r in runs)
            overhead.append(
                {
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
                    "inprocess_step_ms": round(1000 * sum(r[1] for r in ref) / max(sum(r[2] for r in ref), 1), 3),
                    "inprocess_draft_ms": round(1000 * sum(r[3] for r in ref) / max(sum(r[2] for r in ref), 1), 3),
                    "inprocess_verify_ms": round(1000 * sum(r[4] for r in ref) / max(sum(r[2] for r in ref), 1), 3),
                    "interleaved": interleave,
                }
            )
            split.append({"run": f"overhead T={temp:g} (1 session, batching on)", **parts})
            log(f"overhead T={temp:g}: ratio {overhead[-1]['ratio']:.3f}")
        ip = None
        gc.collect()
        if not args.overhead_only:
            capacity_prompts = prompts * (max(args.sessions) // len(prompts) + 1)
            for k, batching in enumerate(args.batching):
                if k > 0:
                    log(f"restarting the verifier with --batching {str(batching).lower()}")
                    services.restart_verifier(batching, args.start_timeout_s)
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
                    label = f"{n} session(s), T={temp:g}, batching {'on' if batching else 'off'}"
                    split.append({"run": label, **parts})
                    log(f"capacity {label}: {agg:.1f} tok/s (x{agg / base:.2f})")
    finally:
        services.stop()

    import torch

    report = {
        "name": args.name,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m rsd_tools.bench_services " + " ".join(argv if argv is not None else sys.argv[1:]),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "models": {
            "draft": str(draft_dir),
            "target": str(target_dir),
            "tiny": args.tiny,
            **(
                {k: getattr(args, k) for k in ("vocab_size", "hidden_size", "num_layers", "draft_layers")}
                if args.tiny
                else {}
            ),
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

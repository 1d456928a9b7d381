"""The benchmark that decides issue 13: the pipeline through the real services, drafter and verifier on
cores of their own, against the target alone on the verifier's core and on the whole machine.

    python -m rsd_bench.disaggregated --name cpu-disaggregated                 # the real pair
    python -m rsd_bench.disaggregated --tiny --num-prompts 1 --max-new-tokens 8 --temperatures 0

Per setting of pre-drafting (on, off) it starts a verifier (--verifier-cores, one thread, the target in
--dtype), a drafter (--drafter-cores, one thread, --draft-quantize) and a gateway (--gateway-cores, by
default the drafter's: the verifier's forward is the critical path, and an unpinned gateway's work lands
on the verifier's core and lengthens every verification) as processes, and runs
every method x temperature x prompt through the gateway, one session at a time (a warm-up generation
first). The target alone runs in a child process per placement (--ar-placements: the verifier's core,
then the whole machine), same prompts, seeds and stop rule (the target's EOS, at most --max-new-tokens).

Rows: method, shape, temperature, pipelined, tokens_per_s (all tokens / all wall time, prefill included,
as for the target alone), block_efficiency with a 95% bootstrap interval over steps, predraft_hit_rate
(steps whose tree was drafted ahead, first step excluded), matches_ar (T = 0: the same tokens as the
target alone), speedup_vs_ar_same_core and speedup_vs_ar_whole_machine, and the per-step split (draft,
transfer, queue, verify, residual). Writes <out-dir>/<name>.json, .md and -tokens-per-s.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rsd.methods import VERIFICATIONS, Method
from rsd_bench.stats import bootstrap_interval
from rsd_tools.defaults import RESULTS_DIR

SPLIT = ("draft_ms", "transfer_ms", "queue_ms", "verify_ms", "residual_ms", "step_ms")


def load_workload(args) -> tuple[Path, Path, list[str], list[list[int]], list[int]]:
    """What every services benchmark runs (disaggregated, net, capacity): the pair's folders (--draft / --target,
    or --tiny), the stdlib prompts (--num-prompts, --prompt-seed) and their ids under the target's tokenizer, and
    its EOS. -> (draft dir, target dir, prompt texts, prompt ids, eos ids)."""
    from rsd_bench.prompts import stdlib_prompts
    from rsd_runtime.tokenizer import load_tokenizer
    from rsd_tools.launcher import model_dirs

    draft, target = model_dirs(args.draft, args.target, args.cache_dir, args.tiny)
    tok = load_tokenizer(target)
    texts = [p["prompt"] for p in stdlib_prompts(args.num_prompts, args.prompt_seed)]
    prompts = [tok(text)["input_ids"] for text in texts]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return draft, target, texts, prompts, eos


def add_model_flags(ap: argparse.ArgumentParser) -> None:
    """The pair and how each side computes: the flags every services benchmark takes (disaggregated, net, capacity)."""
    ap.add_argument("--draft", type=Path)
    ap.add_argument("--target", type=Path)
    ap.add_argument("--cache-dir", type=Path)
    ap.add_argument("--tiny", action="store_true", help="the tiny Qwen2 pair (a smoke run)")
    ap.add_argument("--dtype", default="float32", help="the target's dtype (verifier and target alone)")
    ap.add_argument("--draft-quantize", default="int8", choices=("none", "int8", "auto"))
    numerics = ("exact", "q8_activations")  # rsd_runtime.NUMERICS: a GGUF model's numeric mode
    ap.add_argument("--numeric", default="exact", choices=numerics, help="the target's (verifier and target alone)")
    ap.add_argument("--draft-numeric", default="exact", choices=numerics, help="the drafters'")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.disaggregated", description=__doc__.split("\n")[0])
    add_model_flags(ap)
    ap.add_argument("--methods", default="rsd_s:3x4;sd:4", help="';'-separated method:shape (default %(default)s)")
    ap.add_argument("--temperatures", default="0,0.6,1")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="prompt i runs with seed + i")
    ap.add_argument(
        "--verification",
        default="token",
        type=_verifications,
        help="the exact rule the verifier applies to every method, or several comma-separated: each method runs "
        f"under each, in one run ({', '.join(VERIFICATIONS)}; rsd.methods; block: chain shapes only)",
    )
    ap.add_argument(
        "--predraft", default="on,off", help="pre-drafting settings to run: on, off, on:W (W trees side by side)"
    )
    ap.add_argument("--drafter-cores", default="0")
    ap.add_argument("--verifier-cores", default="1")
    ap.add_argument("--gateway-cores", default=None, help="default: --drafter-cores")
    ap.add_argument("--verifier-threads", type=int, default=1)
    ap.add_argument("--drafter-threads", type=int, default=1)
    ap.add_argument("--ar-placements", default="1;0-1", help="';'-separated cores for the target alone")
    ap.add_argument(
        "--ar-dtypes",
        default="",
        help="more dtypes for the target alone; each placement's baseline is its fastest (T = 0 is checked "
        "against --dtype's run)",
    )
    ap.add_argument("--drafter-args", default="", help="more drafter flags, e.g. '--predraft-outcomes 2'")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples of the steps")
    ap.add_argument("--start-timeout-s", type=float, default=900)
    ap.add_argument("--name", default="cpu-disaggregated")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--ar-worker", help=argparse.SUPPRESS)  # JSON job of the child process
    return ap


# ---------------------------------------------------------------------------------------------
# The target alone, in a child process pinned to its cores


def ar_worker(job: dict) -> None:
    """Runs in the child: prints one JSON line per (prompt, temperature)."""
    from rsd_service.placement import apply_placement

    apply_placement(job["cores"], job["threads"])
    from rsd.sampling import SamplingParams
    from rsd_runtime.generator import SpeculativeGenerator
    from rsd_runtime.models import batch_variance, load_model
    from rsd_runtime.runner import ModelRunner

    model = load_model(job["target"], "cpu", job["dtype"], numeric=job["numeric"])
    print(json.dumps({"batch_variance": batch_variance(model)}), flush=True)  # the verifier loads it alike
    gen = SpeculativeGenerator(ModelRunner(model, job["max_len"]))
    eos = tuple(job["eos"])
    gen.generate(job["prompts"][0], None, SamplingParams(0.0), 4)  # warm-up
    for t in job["temperatures"]:
        for i, prompt in enumerate(job["prompts"]):
            t0 = time.perf_counter()
            out = gen.generate(prompt, None, SamplingParams(t), job["max_new_tokens"], eos, seed=job["seed"] + i)
            wall = time.perf_counter() - t0
            print(json.dumps({"temperature": t, "prompt": i, "token_ids": out.token_ids, "wall_s": wall}), flush=True)


def run_ar(target: Path, cores: str, prompts: list[list[int]], eos: list[int], args, dtype: str) -> list[dict]:
    threads = len(_cores(cores))
    job = {
        "target": str(target),
        "cores": cores,
        "threads": threads,
        "dtype": dtype,
        "numeric": args.numeric,
        "max_len": args.max_len,
        "prompts": prompts,
        "eos": eos,
        "temperatures": _temperatures(args),
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
    }
    cmd = [sys.executable, "-m", "rsd_bench.disaggregated", "--ar-worker", json.dumps(job)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _cores(text: str) -> tuple[int, ...]:
    from rsd_service.placement import parse_cores

    return parse_cores(text)


def _temperatures(args) -> list[float]:
    return [float(t) for t in args.temperatures.split(",")]


# ---------------------------------------------------------------------------------------------
# The services


def start_services(draft: Path, target: Path, args, predraft: bool, run_dir: Path, width: int = 1):
    from rsd_tools.launcher import (
        Cluster,
        drafter_command,
        free_port,
        gateway_command,
        service_env,
        verifier_command,
        wait_all_ready,
    )

    cluster, env = Cluster(run_dir), service_env()
    v_port, d_port, g_port = free_port(), free_port(), free_port()
    common = ["--max-len", str(args.max_len), "--drain-s", "1"]
    verifier = verifier_command(
        v_port, target, "verifier-0", "--dtype", args.dtype, "--numeric", args.numeric, "--num-slots", "2", *common,
        "--threads", str(args.verifier_threads), cores=args.verifier_cores,
    )  # fmt: skip
    drafter = drafter_command(
        d_port, draft, "drafter-0", "--quantize", args.draft_quantize, "--numeric", args.draft_numeric,
        "--predraft", "true" if predraft else "false",
        "--predraft-width", str(width), "--max-sessions", "2", *common, "--threads", str(args.drafter_threads),
        *shlex.split(args.drafter_args), cores=args.drafter_cores,
    )  # fmt: skip
    static = ["--drafters", f"drafter-0=127.0.0.1:{d_port}", "--verifiers", f"verifier-0=127.0.0.1:{v_port}"]
    gateway = gateway_command(g_port, target, *static, "--drain-s", "1", cores=args.gateway_cores)
    try:
        cluster.spawn("verifier", verifier, env, f"127.0.0.1:{v_port}")
        cluster.spawn("drafter", drafter, env, f"127.0.0.1:{d_port}")
        cluster.spawn("gateway", gateway, env, f"127.0.0.1:{g_port}")
        wait_all_ready(cluster.processes, args.start_timeout_s)
    except BaseException:
        cluster.stop(15.0, at_once=True)
        raise
    return cluster, f"127.0.0.1:{g_port}"


def _verifications(text: str) -> str:
    """ "token,coupled" -> itself, each a known verification; argparse reports the ValueError."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VERIFICATIONS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(VERIFICATIONS)}, got {text!r}")
    return ",".join(names)


def service_runs(
    address: str, prompts: list[list[int]], method: str, shape: str, t: float, args, verification: str = "token"
) -> list:
    from rsd_bench.gateway_runs import gateway_run

    opts = argparse.Namespace(method=method, shape=shape, max_new_tokens=args.max_new_tokens, request_timeout_s=3600)
    return [gateway_run(address, p, opts, t, args.seed + i, verification=verification) for i, p in enumerate(prompts)]


# ---------------------------------------------------------------------------------------------
# Rows


def service_row(
    method: str,
    shape: str,
    t: float,
    pipelined: bool,
    runs: list,
    ar: dict,
    greedy_ar: list[dict],
    args,
    width=1,
    verification: str = "token",
) -> dict:
    """greedy_ar: the target alone's T = 0 runs in the verifier's dtype (what T = 0 must equal)."""
    from rsd_bench.gateway_runs import step_split

    tokens = sum(len(r.token_ids) for r in runs)
    wall = sum(r.wall_s for r in runs)
    per_step = [n for r in runs for n in r.delta_tokens]
    later = [s for r in runs for s in r.steps[1:]]
    row = {
        "method": method,
        "shape": shape,
        "temperature": t,
        "verification": verification,
        "pipelined": pipelined,
        "predraft_width": width if pipelined else 0,  # trees pre-drafted side by side (drafter predraft_width)
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 4),
        "block_efficiency": round(tokens / max(len(per_step), 1), 3),
        "block_efficiency_ci95": bootstrap_interval(per_step, args.bootstrap),
        "steps": len(per_step),
        "predraft_hit_rate": round(sum(s.predraft_hit for s in later) / len(later), 3) if later else None,
        "wasted_draft_forwards_per_step": round(sum(s.wasted_draft_forwards for s in later) / len(later), 3)
        if later
        else None,
        "matches_ar": None,
    }
    same, whole = ar["same_core"][t], ar["whole_machine"][t]
    if t == 0:
        row["matches_ar"] = all(
            r.token_ids == a["token_ids"][: len(r.token_ids)] and len(r.token_ids) == len(a["token_ids"])
            for r, a in zip(runs, greedy_ar, strict=True)
        )
    row["speedup_vs_ar_same_core"] = round(row["tokens_per_s"] / same["tokens_per_s"], 3)
    row["speedup_vs_ar_whole_machine"] = round(row["tokens_per_s"] / whole["tokens_per_s"], 3)
    row["split"] = {k: v for k, v in step_split(runs).items() if k in SPLIT}
    return row


def ar_summary(results: list[dict], temperatures: list[float]) -> dict:
    out = {}
    for t in temperatures:
        runs = sorted((r for r in results if r.get("temperature") == t), key=lambda r: r["prompt"])
        tokens = sum(len(r["token_ids"]) for r in runs)
        out[t] = {"tokens_per_s": round(tokens / sum(r["wall_s"] for r in runs), 4), "tokens": tokens, "runs": runs}
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ar_worker:
        ar_worker(json.loads(args.ar_worker))
        return 0
    if args.gateway_cores is None:  # the drafter's core: the verifier's forward is the critical path
        args.gateway_cores = args.drafter_cores
    from rsd_bench.machine import machine_info, run_record, write_result

    draft, target, texts, prompts, eos = load_workload(args)
    temps = _temperatures(args)
    methods = [m.split(":", 1) for m in args.methods.split(";")]
    verifications = args.verification.split(",")
    for (name, shape), verification in itertools.product(methods, verifications):  # refused before anything starts
        try:
            Method.parse(name, shape).rule(False, verification)
        except ValueError as e:
            raise SystemExit(f"error: --verification {verification}, {name}:{shape}: {e}") from None
    machine = machine_info()
    log(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, T {temps}, methods {args.methods}")

    placements = args.ar_placements.split(";")
    if len(placements) != 2:
        raise SystemExit(
            f"error: --ar-placements takes two ';'-separated core lists (the verifier's, the whole machine's), "
            f"got {args.ar_placements!r}"
        )
    ar_dtypes = list(dict.fromkeys([args.dtype, *(d.strip() for d in args.ar_dtypes.split(",") if d.strip())]))
    ar_runs, variance = {}, {}
    for key, cores in zip(("same_core", "whole_machine"), placements, strict=True):
        by_dtype = {}
        for dtype in ar_dtypes:
            log(f"target alone on cores {cores} in {dtype}")
            results = run_ar(target, cores, prompts, eos, args, dtype)
            by_dtype[dtype] = ar_summary(results, temps)
            variance[dtype] = next((r["batch_variance"] for r in results if "batch_variance" in r), None)
        best = max(ar_dtypes, key=lambda d: sum(by_dtype[d][t]["tokens_per_s"] for t in temps))  # its fastest
        ar_runs[key] = {"cores": cores, "dtype": best, "by_t": by_dtype[best], "by_dtype": by_dtype}
    ar = {key: v["by_t"] for key, v in ar_runs.items()}
    greedy_ar = ar_runs["same_core"]["by_dtype"][args.dtype][0.0]["runs"] if 0.0 in temps else []

    rows = []
    for setting in args.predraft.split(","):
        pipelined, _, width = setting.partition(":")
        pipelined, width = pipelined == "on", int(width or 1)
        with tempfile.TemporaryDirectory(prefix="rsd-disagg-") as run_dir:
            cluster, address = start_services(draft, target, args, pipelined, Path(run_dir), width)
            try:
                service_runs(address, prompts[:1], methods[0][0], methods[0][1], 0.0, _short(args))  # warm-up
                for (method, shape), verification in itertools.product(methods, verifications):
                    for t in temps:
                        runs = service_runs(address, prompts, method, shape, t, args, verification)
                        row = service_row(method, shape, t, pipelined, runs, ar, greedy_ar, args, width, verification)
                        rows.append(row)
                        r = rows[-1]
                        log(f"{method} {shape} ({verification}) T={t} predraft {setting}: {r['tokens_per_s']} tok/s, "
                            f"BE {r['block_efficiency']}, hit {r['predraft_hit_rate']}, "
                            f"x{r['speedup_vs_ar_whole_machine']} whole machine")  # fmt: skip
            finally:
                cluster.stop(15.0, at_once=True)
    result = {
        **run_record("disaggregated"),
        "complete": True,
        "draft": str(draft),
        "target": str(target),
        "dtype": args.dtype,
        "draft_quantize": args.draft_quantize,
        "numeric": args.numeric,
        "draft_numeric": args.draft_numeric,
        "drafter_args": args.drafter_args,
        "small_gemm": os.environ.get("RSD_SMALL_GEMM", "1") != "0",  # the small-row kernels (RSD_SMALL_GEMM=0: off)
        "lean_draft_forward": os.environ.get("RSD_LEAN_FORWARD", "1") != "0",  # rsd_runtime.lean (=0: off)
        # per dtype, why the target's rows may depend on their batch ("" = never: matches_ar can hold at T = 0)
        "target_batch_variance": variance,
        "placement": {
            "drafter_cores": args.drafter_cores,
            "verifier_cores": args.verifier_cores,
            "gateway_cores": args.gateway_cores,
            "verifier_threads": args.verifier_threads,
            "drafter_threads": args.drafter_threads,
            "ar_same_core": placements[0],
            "ar_whole_machine": placements[1],
        },
        "prompts": texts,
        "max_new_tokens": args.max_new_tokens,
        "machine": machine,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "ar": {
            key: {
                "cores": v["cores"],
                "dtype": v["dtype"],  # the fastest of ar_dtypes here: the baseline
                **{str(t): {k: s[k] for k in ("tokens_per_s", "tokens")} for t, s in v["by_t"].items()},
                "tokens_per_s_by_dtype": {
                    d: {str(t): s["tokens_per_s"] for t, s in by_t.items()} for d, by_t in v["by_dtype"].items()
                },
            }
            for key, v in ar_runs.items()
        },
        "rows": rows,
    }
    write_result(args.out_dir, args.name, result, markdown(result))
    plot(result, args.out_dir / f"{args.name}-tokens-per-s.png")
    return 0


def _verification_label(row: dict) -> str:
    """Rows of the default rule say nothing; another one is named after the shape."""
    verification = row.get("verification", "token")
    return "" if verification == "token" else f" ({verification})"


def _short(args) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "max_new_tokens": min(8, args.max_new_tokens)})


def numeric_label(numeric: str | None) -> str:
    """A GGUF model's numeric mode as the markdown names it: nothing for the exact default."""
    return "" if numeric in (None, "exact") else f", numeric {numeric}"


def markdown(result: dict) -> str:
    m, p = result["machine"], result["placement"]
    lines = [
        f"# The pipeline through the services vs the target alone ({Path(result['target']).name}, {result['dtype']}"
        f"{numeric_label(result.get('numeric'))})",
        "",
        f"Drafter on cores {p['drafter_cores']} ({Path(result['draft']).name}, quantize {result['draft_quantize']}"
        f"{numeric_label(result.get('draft_numeric'))}"
        f"{(', ' + result['drafter_args']) if result.get('drafter_args') else ''}), "
        f"verifier on cores {p['verifier_cores']}, {p.get('drafter_threads', 1)} / {p.get('verifier_threads', 1)} "
        "thread(s) (drafter / verifier), gateway on cores "
        f"{p.get('gateway_cores') or 'any'}; {len(result['prompts'])} stdlib prompts x "
        f"{result['max_new_tokens']} new tokens (the target's EOS stops earlier). CPU: {m['cpu_model']}, flags "
        f"{' '.join(m['cpu_flags'])}; load {m['loadavg_start']} at the start, {result['loadavg_end']} at the end."
        + (
            f" Small-row kernels: {', '.join(f'{d} {k}' for d, k in m['small_gemm_kernels'].items() if k)}."
            if result.get("small_gemm", True) and m.get("small_gemm_kernels")
            else ""
        )
        + ("" if result.get("small_gemm", True) else " Small-row kernels off (RSD_SMALL_GEMM=0): torch's F.linear.")
        + (
            ""
            if "lean_draft_forward" not in result
            else " Lean draft forward: " + ("on." if result["lean_draft_forward"] else "off (RSD_LEAN_FORWARD=0).")
        ),
        "",
        "| target alone (its fastest dtype: the baseline) | " + " | ".join(f"T={t}" for t in _ar_temps(result)) + " |",
        "| --- | " + " | ".join("---" for _ in _ar_temps(result)) + " |",
    ]
    for key, label in (("same_core", "verifier's core"), ("whole_machine", "whole machine")):
        a = result["ar"][key]
        cells = [f"{a[t]['tokens_per_s']:.2f} tok/s" for t in _ar_temps(result)]
        lines.append(f"| {label} (cores {a['cores']}, {a.get('dtype', result['dtype'])}) | " + " | ".join(cells) + " |")
        for dtype, by_t in a.get("tokens_per_s_by_dtype", {}).items():
            if len(a["tokens_per_s_by_dtype"]) > 1:
                lines.append(f"| ... in {dtype} | " + " | ".join(f"{by_t[t]:.2f}" for t in _ar_temps(result)) + " |")
    lines += [
        "",
        "| method | T | pre-drafting | tok/s | x same core | x whole machine | block efficiency [95% CI] | "
        "pre-draft hits | matches target (T=0) | draft / transfer / queue / verify / residual ms per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        s = r["split"]
        split = " / ".join(f"{s[k]:.0f}" if s.get(k) is not None else "-" for k in SPLIT[:-1])
        lo, hi = r["block_efficiency_ci95"]
        lines.append(
            f"| {r['method']} {r['shape']}{_verification_label(r)} | {r['temperature']} | {_predraft_label(r)} | "
            f"{r['tokens_per_s']:.2f} | {r['speedup_vs_ar_same_core']:.2f} | {r['speedup_vs_ar_whole_machine']:.2f} | "
            f"{r['block_efficiency']:.2f} [{lo:.2f}, {hi:.2f}] | {r['predraft_hit_rate']} | "
            f"{'' if r['matches_ar'] is None else r['matches_ar']} | {split} |"
        )
    return "\n".join(lines) + "\n"


def _predraft_label(row: dict) -> str:
    width = row.get("predraft_width", 1)
    return "off" if not row["pipelined"] else "on" if width <= 1 else f"on, {width} side by side"


def _ar_temps(result: dict) -> list[str]:
    return [t for t in result["ar"]["same_core"] if t not in ("cores", "dtype", "tokens_per_s_by_dtype")]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(4 * len(temps), 3.5), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        rows = [r for r in result["rows"] if r["temperature"] == t]
        labels = [f"{r['method']} {r['shape']}\n{_predraft_label(r)}" for r in rows]
        ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color="tab:blue")
        for key, style in (("same_core", "--"), ("whole_machine", ":")):
            ax.axhline(result["ar"][key][str(t)]["tokens_per_s"], color="k", ls=style, label=f"target alone, {key}")
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(f"T = {t}")
        ax.set_ylabel("tokens/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log(msg: str) -> None:
    print(f"[disaggregated] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

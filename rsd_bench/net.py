"""Drafter and verifier across an emulated network: plain against pre-drafting at each one-way delay.

    python -m rsd_bench.net --name cpu-net                       # the real pair (RSD_MODEL_CACHE)
    python -m rsd_bench.net --tiny --delays 0,10 --num-prompts 1 --max-new-tokens 8

One verifier (--verifier-cores) sits behind a delay relay (rsd_bench.netem: the kernel here has no `tc
netem`; the result records which emulation ran). Two drafters, one plain (--predraft false) and one
pre-drafting, each with a gateway of its own, run on --drafter-cores and reach the verifier only through
the relay, as a drafter at an edge site would (the gateways' own calls to the verifier, release and
health, cross it too). Everything starts once; the relay's delay changes between blocks of runs, and
plain and pre-drafting alternate prompt by prompt, so that the machine's load hits both alike.

For each delay x method:shape x temperature x prompt (seed --seed + i) it runs one generation through
each gateway. The target alone runs first in a child process on the verifier's cores (no network: the
baseline a client of the target alone would get).

Rows: delay_ms, method, shape, temperature, adaptive (False: fixed shapes), pipelined, tokens_per_s,
block_efficiency, predraft_hit_rate (steps whose tree was drafted ahead, first step excluded),
speedup_vs_plain (the same delay, shape and T), speedup_vs_ar, same_tokens_as_plain (pre-drafting is
exact: the same seeded tokens), matches_ar (T = 0), the measured one-way delay of the relay and the
per-step split (draft, transfer = round trip - queue - verify, verify). Writes <out-dir>/<name>.json, .md
and -tokens-per-s.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from rsd.methods import Method
from rsd.shape_control import adaptive_family
from rsd_bench.disaggregated import add_model_flags, ar_summary, load_workload, run_ar, service_runs
from rsd_bench.netem import DelayRelay
from rsd_tools.defaults import RESULTS_DIR

SPLIT = ("draft_ms", "transfer_ms", "verify_ms", "step_ms")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.net", description=__doc__.split("\n")[0])
    add_model_flags(ap)
    ap.add_argument("--delays", default="0,10,25", help="one-way delays in ms, each direction")
    ap.add_argument("--jitter", type=float, default=0.1, help="fraction of the delay, uniform (default %(default)s)")
    ap.add_argument("--methods", default="rsd_s:3x4;sd:4", help="';'-separated method:shape (default %(default)s)")
    ap.add_argument(
        "--adaptive",
        default="",
        help="';'-separated method:largest shape run with adaptive_shape through the pre-drafting drafter "
        "(rsd.shape_control), e.g. 'rsd_s:3x8'; compared with the fixed shapes of the same method",
    )
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="prompt i runs with seed + i")
    ap.add_argument("--drafter-cores", default="0")
    ap.add_argument("--verifier-cores", default="1")
    ap.add_argument("--drafter-args", default="", help="more flags for both drafters, e.g. '--predraft-outcomes 2'")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--start-timeout-s", type=float, default=900)
    ap.add_argument("--name", default="cpu-net")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return ap


def start_services(draft: Path, target: Path, args, run_dir: Path):
    """The verifier, the relay in front of it, and per pre-drafting setting (False, True) a drafter and a
    gateway that know the verifier by the relay's address. -> (cluster, relay, {pipelined: gateway address})."""
    drafters = {
        f"drafter-{'predraft' if p else 'plain'}": ["--predraft", str(p).lower(), *args.drafter_args.split()]
        for p in (False, True)
    }
    cluster, relay, gateways = start_relay_cluster(draft, target, args, drafters, run_dir, ["--num-slots", "4"])
    return cluster, relay, dict(zip((False, True), gateways.values(), strict=True))


def start_relay_cluster(
    draft: Path, target: Path, args, drafters: dict[str, list[str]], run_dir: Path, verifier_flags: list[str]
):
    """The verifier (args.verifier_cores), a relay in front of it (args.jitter, args.seed; delay 0 until
    set_delay), and per drafter name a drafter with those extra flags and a gateway of its own
    (args.drafter_cores) that know the verifier only by the relay's address, as a drafter at an edge site
    would (the gateways' own calls to the verifier, release and health, cross it too).
    -> (cluster, relay, {drafter name: gateway address})."""
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
    common = ["--max-len", str(args.max_len), "--drain-s", "1", "--threads", "1"]
    v_port = free_port()
    verifier = verifier_command(
        v_port, target, "verifier-0", "--dtype", args.dtype, "--numeric", args.numeric, *verifier_flags, *common,
        cores=args.verifier_cores,
    )  # fmt: skip
    gateways, relay = {}, DelayRelay(f"127.0.0.1:{v_port}", jitter=args.jitter, seed=args.seed)
    try:
        cluster.spawn("verifier", verifier, env, f"127.0.0.1:{v_port}")
        remote = relay.start()
        for name, flags in drafters.items():
            d_port, g_port = free_port(), free_port()
            drafter = drafter_command(
                d_port, draft, name, "--quantize", args.draft_quantize, "--numeric", args.draft_numeric,
                "--max-sessions", "2", *common, *flags, cores=args.drafter_cores,
            )  # fmt: skip
            static = ["--drafters", f"{name}=127.0.0.1:{d_port}", "--verifiers", f"verifier-0={remote}"]
            gateway = gateway_command(g_port, target, *static, "--drain-s", "1", cores=args.drafter_cores)
            cluster.spawn(name, drafter, env, f"127.0.0.1:{d_port}")
            cluster.spawn(f"gateway-{name}", gateway, env, f"127.0.0.1:{g_port}")
            gateways[name] = f"127.0.0.1:{g_port}"
        wait_all_ready(cluster.processes, args.start_timeout_s)
    except BaseException:
        cluster.stop(15.0, at_once=True)
        relay.stop()
        raise
    return cluster, relay, gateways


def interleaved_runs(gateways: dict, prompts: list[list[int]], method: str, shape: str, t: float, args) -> dict:
    """Each prompt (seed args.seed + i) through the plain and the pre-drafting gateway, alternating which
    goes first, so that a change of the machine's load hits both alike. -> {pipelined: runs}."""
    done = {False: [], True: []}
    for i, prompt in enumerate(prompts):
        one = argparse.Namespace(**{**vars(args), "seed": args.seed + i})
        for pipelined in (False, True) if i % 2 == 0 else (True, False):
            done[pipelined] += service_runs(gateways[pipelined], [prompt], method, shape, t, one)
    return done


def adaptive_runs(address: str, prompts: list[list[int]], method: str, shape: str, t: float, args) -> list:
    """Each prompt with GenerationParams.adaptive_shape, `shape` the largest the drafter may pick."""
    from rsd_bench.gateway_runs import gateway_run

    opts = argparse.Namespace(method=method, shape=shape, max_new_tokens=args.max_new_tokens, request_timeout_s=3600)
    return [gateway_run(address, p, opts, t, args.seed + i, adaptive_shape=True) for i, p in enumerate(prompts)]


def row(
    delay_ms: float, method: str, shape: str, t: float, pipelined: bool, runs: list, link: dict, adaptive=False
) -> dict:
    from rsd_bench.gateway_runs import step_split

    tokens = sum(len(r.token_ids) for r in runs)
    later = [s for r in runs for s in r.steps[1:]]
    steps = [s for r in runs for s in r.steps]
    split = step_split(runs)
    return {
        "delay_ms": delay_ms,
        "method": method,
        "shape": shape,
        "temperature": t,
        "adaptive": adaptive,  # shape: the largest the controller may pick
        "pipelined": pipelined,
        "tokens": tokens,
        "tokens_per_s": round(tokens / sum(r.wall_s for r in runs), 4),
        "block_efficiency": round(tokens / max(sum(len(r.delta_tokens) for r in runs), 1), 3),
        "predraft_hit_rate": round(sum(s.predraft_hit for s in later) / len(later), 3) if later else None,
        "measured_one_way_ms": link,
        "split": {k: split[k] for k in SPLIT},
        "draft_nodes_per_step": round(sum(s.num_draft_tokens for s in steps) / max(len(steps), 1), 2),
    }


def compare(rows: list[dict], runs: dict, ar: dict) -> None:
    """speedup_vs_plain, speedup_vs_ar, same_tokens_as_plain and matches_ar, in place (runs: row index ->
    the runs; ar: the target alone per T). A fixed row's plain is the plain row of its shape; an adaptive
    row's is the best plain row of its method, and it also gets speedup_vs_best_fixed (the best fixed row
    of its method, plain or pre-drafting)."""
    case = lambda r: (r["delay_ms"], r["method"], r["temperature"])  # noqa: E731
    fixed = [r for r in rows if not r["adaptive"]]
    for i, r in enumerate(rows):
        if r["adaptive"]:
            same = [f for f in fixed if case(f) == case(r)]
            plain = max((f for f in same if not f["pipelined"]), key=lambda f: f["tokens_per_s"])
            r["speedup_vs_best_fixed"] = round(r["tokens_per_s"] / max(f["tokens_per_s"] for f in same), 3)
            r["same_tokens_as_plain"] = None  # other shapes, so other tokens at T > 0
        else:
            j = next(
                j for j, f in enumerate(rows) if not f["pipelined"] and f["shape"] == r["shape"] and case(f) == case(r)
            )
            plain = rows[j]
            r["same_tokens_as_plain"] = all(a.token_ids == b.token_ids for a, b in zip(runs[i], runs[j], strict=True))
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
        r["speedup_vs_ar"] = round(r["tokens_per_s"] / ar[r["temperature"]]["tokens_per_s"], 3)
        r["matches_ar"] = (
            all(a.token_ids == b["token_ids"] for a, b in zip(runs[i], ar[0.0]["runs"], strict=True))
            if r["temperature"] == 0
            else None
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rsd_bench.machine import machine_info, run_record, write_result

    delays = [float(d) for d in args.delays.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    methods = [m.split(":", 1) for m in args.methods.split(";")]
    adaptives = [m.split(":", 1) for m in args.adaptive.split(";") if m]
    for name, shape in methods + adaptives:  # refused before anything starts
        Method.parse(name, shape)
    for name, shape in adaptives:
        adaptive_family(Method.parse(name, shape))
    draft, target, texts, prompts, eos = load_workload(args)
    machine = machine_info()
    t_start = time.perf_counter()

    log(f"target alone on cores {args.verifier_cores}")
    ar = ar_summary(run_ar(target, args.verifier_cores, prompts, eos, args, args.dtype), temps)
    rows, runs, link = [], {}, []
    with tempfile.TemporaryDirectory(prefix="rsd-net-") as run_dir:
        cluster, relay, gateways = start_services(draft, target, args, Path(run_dir))
        try:
            for address in gateways.values():  # warm-up: first forwards, channels
                service_runs(address, prompts[:1], methods[0][0], methods[0][1], 0.0, _short(args))
            for delay in delays:
                relay.set_delay(delay)
                relay.reset_stats()
                for method, shape in methods:
                    for t in temps:
                        done = interleaved_runs(gateways, prompts, method, shape, t, args)
                        for pipelined in (False, True):
                            runs[len(rows)] = done[pipelined]
                            rows.append(row(delay, method, shape, t, pipelined, done[pipelined], None))
                            r = rows[-1]
                            log(
                                f"{delay:g} ms {method} {shape} T={t:g} pre-drafting {pipelined}: "
                                f"{r['tokens_per_s']} tok/s, BE {r['block_efficiency']}, hits {r['predraft_hit_rate']}"
                            )
                for method, shape in adaptives:
                    for t in temps:
                        done = adaptive_runs(gateways[True], prompts, method, shape, t, args)
                        runs[len(rows)] = done
                        rows.append(row(delay, method, shape, t, True, done, None, adaptive=True))
                        log(f"{delay:g} ms {method} <={shape} T={t:g} adaptive: {rows[-1]['tokens_per_s']} tok/s")
                link.append(relay.describe())
                for r in rows:
                    if r["delay_ms"] == delay:
                        r["measured_one_way_ms"] = {d: link[-1][d]["mean_delay_ms"] for d in ("up", "down")}
        finally:
            cluster.stop(15.0, at_once=True)
            relay.stop()
    compare(rows, runs, ar)
    result = {
        **run_record("net"),
        "complete": True,
        "draft": str(draft),
        "target": str(target),
        "dtype": args.dtype,
        "draft_quantize": args.draft_quantize,
        "numeric": args.numeric,
        "draft_numeric": args.draft_numeric,
        "drafter_args": args.drafter_args,
        "network": {
            "emulation": "userspace TCP relay (rsd_bench.netem); tc netem unavailable on this kernel",
            "jitter": args.jitter,
            "per_delay": link,
        },
        "placement": {"drafter_cores": args.drafter_cores, "verifier_cores": args.verifier_cores},
        "prompts": texts,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "machine": machine,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "ar": {str(t): {k: s[k] for k in ("tokens_per_s", "tokens")} for t, s in ar.items()},
        "rows": rows,
    }
    write_result(args.out_dir, args.name, result, markdown(result))
    plot(result, args.out_dir / f"{args.name}-tokens-per-s.png")
    return 0


def _short(args) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "max_new_tokens": min(8, args.max_new_tokens)})


def markdown(result: dict) -> str:
    m, p = result["machine"], result["placement"]
    ar = ", ".join(f"T={t}: {a['tokens_per_s']:.2f} tok/s" for t, a in result["ar"].items())
    lines = [
        f"# Drafter and verifier across an emulated network ({Path(result['target']).name}, {result['dtype']})",
        "",
        f"Network: {result['network']['emulation']}, one-way delay each direction ± "
        f"{100 * result['network']['jitter']:.0f} % (uniform, order kept). Drafters on cores {p['drafter_cores']} "
        f"({Path(result['draft']).name}, quantize {result['draft_quantize']}), verifier on cores "
        f"{p['verifier_cores']}, one thread each; {len(result['prompts'])} stdlib prompts x "
        f"{result['max_new_tokens']} new tokens. Target alone on the verifier's cores: {ar}. CPU: "
        f"{m['cpu_model']}, flags {' '.join(m['cpu_flags'] or [])}; load {m['loadavg_start']} at the start, "
        f"{result['loadavg_end']} at the end (a shared machine: compare rows of one run).",
        "",
        "| delay ms (measured up/down) | method | T | pre-drafting | tok/s | x plain | x target alone | block eff. | "
        "pre-draft hits | draft nodes a step | same tokens as plain | matches target (T=0) | "
        "draft / transfer / verify / step ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        s, mo = r["split"], r["measured_one_way_ms"] or {}
        shape = f"adaptive <= {r['shape']}" if r["adaptive"] else r["shape"]
        split = " / ".join(f"{s[k]:.0f}" if s.get(k) is not None else "-" for k in SPLIT)
        lines.append(
            f"| {r['delay_ms']:g} ({mo.get('up')}/{mo.get('down')}) | {r['method']} {shape} | "
            f"{r['temperature']:g} | {'on' if r['pipelined'] else 'off'} | {r['tokens_per_s']:.2f} | "
            f"{r['speedup_vs_plain']:.2f} | {r['speedup_vs_ar']:.2f} | {r['block_efficiency']:.2f} | "
            f"{r['predraft_hit_rate']} | {r.get('draft_nodes_per_step', '-')} | "
            f"{'' if r['same_tokens_as_plain'] is None else r['same_tokens_as_plain']} | "
            f"{'' if r['matches_ar'] is None else r['matches_ar']} | {split} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(4.5 * len(temps), 3.5), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for line in dict.fromkeys((r["method"], r["shape"], r["adaptive"], r["pipelined"]) for r in result["rows"]):
            method, shape, adaptive, pipelined = line
            rows = [r for r in result["rows"] if (r["method"], r["shape"], r["adaptive"], r["pipelined"]) == line]
            rows = [r for r in rows if r["temperature"] == t]
            how = "adaptive, pre-drafting" if adaptive else "pre-drafting" if pipelined else "plain"
            xs, ys = [r["delay_ms"] for r in rows], [r["tokens_per_s"] for r in rows]
            ax.plot(xs, ys, "-" if pipelined else "--", marker="o", label=f"{method} {shape}, {how}")
        ax.axhline(result["ar"][str(t)]["tokens_per_s"], color="k", ls=":", label="target alone")
        ax.set_title(f"T = {t:g}")
        ax.set_xlabel("one-way delay (ms)")
        ax.set_ylabel("tokens/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log(msg: str) -> None:
    print(f"[net] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

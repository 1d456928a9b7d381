"""Capacity per verifier: N drafter processes, each serving one client, against one verifier over the delay relay.

    python -m rsd_bench.capacity --draft D --target T --clients 1,2,4 --delay-ms 10    # the real pair
    python -m rsd_bench.capacity --tiny --clients 1,2 --num-prompts 1 --max-new-tokens 8

One verifier (--verifier-cores) sits behind a delay relay (rsd_bench.netem, as `rsd bench net`). max(N)
drafters, each with a gateway of its own (one client session at a time, as an edge device serves its
user), run on --drafter-cores and reach the verifier only through the relay. Everything starts once; for
each N of --clients, N clients start together (a barrier) and each runs every prompt through its own
gateway, back to back (closed loop) or one request every --request-interval-s (a fixed per-client rate;
a late request starts at once). Client i takes the prompts in the order i, i + 1, ... so that the
verifier batches different prompts; prompt j runs with seed --seed + j.

Baseline, the target alone: the services have no target-alone path, so the target alone runs in a child
process on the verifier's cores, each prompt once, sequentially, before and after the services' runs
(pooled; both recorded): one verifier serving N clients without drafts and without batching them (per
client: its tokens/s ÷ N). It is the same single-stream figure for every N. --rounds R sweeps over N R
times, every other sweep reversed, and pools each N's runs: the machine's load drift hits every N alike.

Per N: tokens/s per verifier (all clients' tokens / the wall from the first start to the last end),
per-client tokens/s, the verifier's batch (sessions per verified batch, from each step's StepStats), the
step split, block efficiency, draft nodes a step (γ), matches_ar (T = 0). Then:
- clients at --client-rate tokens/s each (default half the target alone's): the largest N whose every
  client got the rate, against the target alone's floor(tokens/s ÷ rate);
- the formula 1 + γ·t_d/t_v (t_d the draft ms a node, t_v the verify ms a step, the N = 1 run's): the
  sessions one verifier can interleave at one session's speed; measured: tokens/s per verifier at N ÷ the
  N = 1 client's tokens/s (and with the round trip as idle time too: 1 + (γ·t_d + transfer)/t_v);
- the simulator (rsd_bench.simulate) calibrated from the measured per-step costs (draft and transfer ms of
  the N = 1 run, verify ms per batch size fitted over all runs, each N's block efficiency), its predicted
  tokens/s per verifier for each N against the measured steady state (each client's block efficiency ÷
  mean step, summed); a second prediction takes each N's own draft ms (the drafters share cores here).

Writes <out-dir>/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from rsd.methods import Method
from rsd_bench.disaggregated import add_model_flags, ar_summary, load_workload, run_ar
from rsd_bench.net import start_relay_cluster
from rsd_bench.simulate import Pool, Site, simulate
from rsd_tools.defaults import RESULTS_DIR

SPLIT = ("draft_ms", "transfer_ms", "queue_ms", "verify_ms", "step_ms")
SAME_CORES = (
    "All drafters share --drafter-cores and the verifier its core(s) on one machine: N drafters compete for "
    "the same cores (and the machine's other jobs), so the figures show the mechanism (the verifier batching "
    "N sessions over the relay), not a deployment's capacity; SLED's 2.8x needs drafters on hosts of their "
    "own or a GPU verifier."
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.capacity", description=__doc__.split("\n")[0])
    add_model_flags(ap)
    ap.add_argument("--clients", default="1,2,4", help="numbers of clients (= drafters), each a run")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay, each direction")
    ap.add_argument("--jitter", type=float, default=0.1, help="fraction of the delay, uniform (default %(default)s)")
    ap.add_argument("--method", default="sd:4", help="method:shape (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=2, help="each client runs every prompt")
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0, help="prompt j runs with seed + j")
    ap.add_argument("--rounds", type=int, default=1, help="sweeps over --clients, every other one reversed")
    ap.add_argument("--request-interval-s", type=float, default=0.0, help="0: back to back (closed loop)")
    ap.add_argument("--client-rate", type=float, help="tokens/s each client must get (default: target alone / 2)")
    ap.add_argument("--drafter-cores", default="0")
    ap.add_argument("--verifier-cores", default="1")
    ap.add_argument("--batch-wait-ms", type=float, default=2.0, help="the verifier's")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--sim-steps", type=int, default=2000, help="steps the simulator runs per N")
    ap.add_argument(
        "--recompute", type=Path, help="a capacity result: recompute its comparisons from its rows, run nothing"
    )
    ap.add_argument("--start-timeout-s", type=float, default=900)
    ap.add_argument("--name", default="net-capacity")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return ap


# ---------------------------------------------------------------------------------------------
# The services and the clients


def start_services(draft: Path, target: Path, args, n: int, run_dir: Path):
    """The verifier (slots for n sessions, args.batch_wait_ms), the relay in front of it at args.delay_ms,
    and n drafters (no pre-drafting) each with its gateway. -> (cluster, relay, [gateway address])."""
    drafters = {f"drafter-{i}": ["--predraft", "false"] for i in range(n)}
    slots = ["--num-slots", str(n + 2), "--batch-wait-ms", str(args.batch_wait_ms)]
    cluster, relay, gateways = start_relay_cluster(draft, target, args, drafters, run_dir, slots)
    relay.set_delay(args.delay_ms)
    return cluster, relay, list(gateways.values())


def client_runs(gateways: list[str], prompts: list[list[int]], args) -> list[list[tuple[int, object]]]:
    """len(gateways) clients started together, client i through gateway i, each running every prompt
    (its own order: i, i + 1, ...). -> per client [(prompt index, gateway_runs.Run)]."""
    from rsd_bench.gateway_runs import gateway_run, run_together

    method, shape = args.method.split(":", 1)
    opts = argparse.Namespace(method=method, shape=shape, max_new_tokens=args.max_new_tokens, request_timeout_s=3600)

    def client(i: int, barrier: threading.Barrier) -> list[tuple[int, object]]:
        barrier.wait()
        start, out = time.perf_counter(), []
        for k in range(len(prompts)):
            j = (i + k) % len(prompts)
            if args.request_interval_s > 0:  # a fixed rate: the k-th request not before start + k * interval
                time.sleep(max(0.0, start + k * args.request_interval_s - time.perf_counter()))
            out.append((j, gateway_run(gateways[i], prompts[j], opts, args.temperature, args.seed + j)))
        return out

    return run_together(len(gateways), client)


# ---------------------------------------------------------------------------------------------
# Rows and the comparisons


def verify_by_batch(runs: list) -> dict[str, list[float]]:
    """Sessions in the verified batch -> [mean verify (forward) ms, steps], first steps excluded."""
    seen: dict[int, list[float]] = {}
    for run in runs:
        for s in run.steps[1:]:
            seen.setdefault(s.verifier.batch_num_sessions, []).append(s.verifier.forward_ms)
    return {str(b): [round(statistics.fmean(v), 3), len(v)] for b, v in sorted(seen.items())}


def row(n: int, rounds: list[list[list[tuple[int, object]]]], ar_runs: list[dict] | None) -> dict:
    """rounds: per round, per client, [(prompt index, Run)]; client i's runs of every round pooled."""
    from rsd_bench.gateway_runs import step_split

    clients = [[x for rnd in rounds for x in rnd[i]] for i in range(n)]
    runs = [r for c in clients for _, r in c]
    tokens = sum(len(r.token_ids) for r in runs)
    wall = sum(max(r.end for c in rnd for _, r in c) - min(r.start for c in rnd for _, r in c) for rnd in rounds)
    per_client = [sum(len(r.token_ids) for _, r in c) / sum(r.wall_s for _, r in c) for c in clients]
    steady = []  # each client's block efficiency / mean step (first steps excluded), the simulator's measure
    for c in clients:
        split = step_split([r for _, r in c])
        steady.append(1000 * split["block_efficiency"] / split["step_ms"] if split["step_ms"] else 0.0)
    split = step_split(runs)
    steps = [s for r in runs for s in r.steps]
    return {
        "clients": n,
        "rounds": len(rounds),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s_per_verifier": round(tokens / wall, 4),
        "per_client_tokens_per_s": [round(x, 4) for x in per_client],
        "min_client_tokens_per_s": round(min(per_client), 4),
        "steady_tokens_per_s_per_verifier": round(sum(steady), 4),
        "mean_batch_sessions": split["mean_batch_sessions"],
        "verify_ms_by_batch": verify_by_batch(runs),
        "block_efficiency": round(tokens / max(sum(len(r.delta_tokens) for r in runs), 1), 3),
        "draft_nodes_per_step": round(sum(s.num_draft_tokens for s in steps) / max(len(steps), 1), 3),
        "split": {k: split[k] for k in SPLIT},
        "matches_ar": None
        if ar_runs is None
        else all(r.token_ids == ar_runs[j]["token_ids"] for c in clients for j, r in c),
    }


def fit_verify(rows: list[dict]) -> tuple[float, float]:
    """verify ms = a + b * (sessions in the batch - 1), least squares over every run's steps (each batch
    size weighted by its steps). One batch size seen: b = 0."""
    pts = [(int(k), ms, n) for r in rows for k, (ms, n) in r["verify_ms_by_batch"].items()]
    w = sum(n for _, _, n in pts)
    mx, my = sum((x - 1) * n for x, _, n in pts) / w, sum(y * n for _, y, n in pts) / w
    sxx = sum(n * (x - 1 - mx) ** 2 for x, _, n in pts)
    b = sum(n * (x - 1 - mx) * (y - my) for x, y, n in pts) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def formula(rows: list[dict]) -> dict:
    """1 + γ·t_d/t_v from the N = 1 run (γ the draft nodes a step, t_d the draft ms a node, t_v the verify ms
    a step), with the round trip as idle time too, against the measured sessions at one session's speed:
    tokens/s per verifier at each N ÷ the single client's tokens/s."""
    one = min(rows, key=lambda r: r["clients"])
    s, gamma = one["split"], one["draft_nodes_per_step"]
    t_d, t_v = s["draft_ms"] / gamma, s["verify_ms"]
    single = one["tokens_per_s_per_verifier"] / one["clients"]
    measured = {str(r["clients"]): round(r["tokens_per_s_per_verifier"] / single, 3) for r in rows}
    return {
        "gamma": gamma,
        "t_d_ms": round(t_d, 3),
        "t_v_ms": round(t_v, 3),
        "transfer_ms": s["transfer_ms"],
        "clients_per_verifier": round(1 + gamma * t_d / t_v, 3),
        "clients_per_verifier_with_round_trip": round(1 + (gamma * t_d + s["transfer_ms"]) / t_v, 3),
        "measured_sessions_at_single_speed": measured,
    }


def simulator_check(result: dict, steps: int = 2000) -> dict:
    """The simulator calibrated from the measured per-step costs against each N's measured steady state.
    Verifier: fit_verify over every run, the verifier's batch wait; tokens a step: each N's block efficiency.
    Sites, three ways: "n1", the N = 1 run's draft ms and one way (transfer / 2), each drafter a device of
    its own (the simulator's edge sites); "shared_drafter", the same costs, but the drafts of all N queue
    for the drafters' cores (placement.drafter_cores), as they do on this machine; "own_draft", each N's
    own measured draft and transfer ms (the contention measured rather than modelled)."""
    from rsd_service.placement import parse_cores

    rows = result["rows"]
    one = min(rows, key=lambda r: r["clients"])
    devices = len(parse_cores(result["placement"]["drafter_cores"]))
    verify_ms, per_session = fit_verify(rows)
    pool = Pool(verify_ms=verify_ms, verify_ms_per_session=per_session, batch_wait_ms=result["batch_wait_ms"])
    ways = (("n1", one, 0), ("shared_drafter", one, devices), ("own_draft", None, 0))
    out = []
    for r in rows:
        n, measured = r["clients"], r["steady_tokens_per_s_per_verifier"]
        entry = {"clients": n, "measured_steady_tokens_per_s": measured}
        for how, base, shared in ways:
            s = (base or r)["split"]
            site = Site(one_way_ms=s["transfer_ms"] / 2, draft_ms=s["draft_ms"], tokens_per_step=r["block_efficiency"])
            step = n * site.draft_ms + 2 * site.one_way_ms + pool.batch_wait_ms + pool.batch_ms(n)  # a bound
            predicted = simulate([site] * n, pool, steps * step, draft_devices=shared).tokens_per_s
            key = "" if how == "n1" else f"_{how}"
            entry[f"predicted{key}_tokens_per_s"] = round(predicted, 4)
            entry[f"error{key}"] = round(predicted / measured - 1, 4)
        out.append(entry)
    return {
        "verify_ms": round(verify_ms, 3),
        "verify_ms_per_session": round(per_session, 3),
        "draft_devices_shared": devices,
        "rows": out,
    }


def clients_served(rows: list[dict], ar_tokens_per_s: float, rate: float) -> dict:
    """Clients each getting >= rate tokens/s: measured, the largest N whose every client got it (a lower
    bound where it is the largest N run), and the verifier's best tokens/s ÷ rate, were it shared evenly;
    the target alone: floor(its tokens/s ÷ rate)."""
    ok = [r["clients"] for r in rows if r["min_client_tokens_per_s"] >= rate]
    best = max(r["tokens_per_s_per_verifier"] for r in rows)
    ar = math.floor(ar_tokens_per_s / rate)
    measured = max(ok) if ok else 0
    return {
        "rate": rate,  # unrounded: --recompute must find the same clients
        "measured": measured,
        "measured_of": [r["clients"] for r in rows],
        "at_least": measured == max(r["clients"] for r in rows),  # the largest N run passed: more might
        "throughput_bound": math.floor(best / rate),
        "target_alone": ar,
        "ratio_vs_target_alone": round(measured / ar, 3) if ar else None,
    }


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rsd_bench.machine import git_commit, machine_info, run_record, write_result

    if args.recompute:
        result = json.loads(args.recompute.read_text())
        rate = args.client_rate or result["clients_at_rate"]["rate"]
        result["comparisons_recomputed_at"] = git_commit()  # the measurement's commit stays in "commit"
        write_result(args.out_dir, args.name, *summarise(result, rate, args.sim_steps))
        return 0

    ns = sorted({int(n) for n in args.clients.split(",")})
    if ns[0] < 1:
        raise SystemExit("error: --clients must be positive")
    Method.parse(*args.method.split(":", 1))  # refused before anything starts
    draft, target, texts, prompts, eos = load_workload(args)
    machine = machine_info()
    t_start = time.perf_counter()

    ar_args = argparse.Namespace(**{**vars(args), "temperatures": str(args.temperature)})

    def target_alone(when: str) -> list[dict]:
        log(f"target alone on cores {args.verifier_cores} ({when})")
        return run_ar(target, args.verifier_cores, prompts, eos, ar_args, args.dtype)

    ar_before = target_alone("before")
    by_n: dict[int, list] = {n: [] for n in ns}
    with tempfile.TemporaryDirectory(prefix="rsd-capacity-") as run_dir:
        cluster, relay, gateways = start_services(draft, target, args, ns[-1], Path(run_dir))
        try:
            warm = argparse.Namespace(**{**vars(args), "max_new_tokens": min(4, args.max_new_tokens)})
            for address in gateways:  # warm-up: first forwards, channels
                client_runs([address], prompts[:1], warm)
            relay.reset_stats()
            for k in range(args.rounds):  # every other sweep reversed: the machine's load drift hits every N alike
                for n in ns if k % 2 == 0 else ns[::-1]:
                    by_n[n].append(client_runs(gateways[:n], prompts, args))
                    r = row(n, by_n[n][-1:], None)
                    log(f"N={n}: {r['tokens_per_s_per_verifier']} tok/s per verifier, batch {r['mean_batch_sessions']}")
            link = relay.describe()
        finally:
            cluster.stop(15.0, at_once=True)
            relay.stop()
    ar_after = target_alone("after")  # before and after the services: the load's drift, pooled
    ar = ar_summary(ar_before + ar_after, [args.temperature])[args.temperature]
    drift = {w: ar_summary(x, [args.temperature])[args.temperature]["tokens_per_s"] for w, x in
             (("before", ar_before), ("after", ar_after))}  # fmt: skip
    rate = args.client_rate or ar["tokens_per_s"] / 2
    greedy = sorted((r for r in ar_before if "prompt" in r), key=lambda r: r["prompt"])
    rows = [row(n, by_n[n], greedy if args.temperature == 0 else None) for n in ns]
    for r in rows:
        r["speedup_vs_ar"] = round(r["tokens_per_s_per_verifier"] / ar["tokens_per_s"], 3)
    result = {
        **run_record("capacity"),
        "complete": True,
        "draft": str(draft),
        "target": str(target),
        "method": args.method,
        "temperature": args.temperature,
        "dtype": args.dtype,
        "draft_quantize": args.draft_quantize,
        "numeric": args.numeric,
        "draft_numeric": args.draft_numeric,
        "batch_wait_ms": args.batch_wait_ms,
        "request_interval_s": args.request_interval_s,
        "network": {
            "emulation": "userspace TCP relay (rsd_bench.netem); tc netem unavailable on this kernel",
            "delay_ms": args.delay_ms,
            "jitter": args.jitter,
            "measured": link,
        },
        "placement": {"drafter_cores": args.drafter_cores, "verifier_cores": args.verifier_cores, "note": SAME_CORES},
        "baseline": "target alone in one process on the verifier's cores, each prompt once, sequentially (the "
        "services have no target-alone path), before and after the services' runs, pooled: N clients share it, "
        "each at its tokens/s / N",
        "prompts": texts,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "machine": machine,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "ar": {
            "tokens_per_s": ar["tokens_per_s"],
            "tokens": ar["tokens"],
            **{f"tokens_per_s_{w}": v for w, v in drift.items()},
        },
        "rows": rows,
    }
    write_result(args.out_dir, args.name, *summarise(result, rate, args.sim_steps))
    return 0


def summarise(result: dict, rate: float, sim_steps: int) -> tuple[dict, str]:
    """The comparisons, computed from the record's rows alone (so --recompute gives what the run gave)."""
    rows = result["rows"]
    result["clients_at_rate"] = clients_served(rows, result["ar"]["tokens_per_s"], rate)
    result["formula"] = formula(rows)
    result["simulator"] = simulator_check(result, sim_steps)
    return result, markdown(result)


def markdown(result: dict) -> str:
    m, p, f, c = result["machine"], result["placement"], result["formula"], result["clients_at_rate"]
    sim, every = result["simulator"], result["request_interval_s"]
    pace = f"one request every {every:g} s" if every else "back to back"
    lines = [
        f"# Capacity per verifier over an emulated network ({Path(result['target']).name}, {result['method']}, "
        f"T={result['temperature']:g})",
        "",
        f"Network: {result['network']['emulation']}, {result['network']['delay_ms']:g} ms one way each direction ± "
        f"{100 * result['network']['jitter']:.0f} %. N drafters ({Path(result['draft']).name}, quantize "
        f"{result['draft_quantize']}, numeric {result['draft_numeric']}), each with its gateway and one client, on "
        f"cores {p['drafter_cores']}; one verifier (numeric {result['numeric']}, batch wait "
        f"{result['batch_wait_ms']:g} ms) on cores {p['verifier_cores']}; one thread each. Each client runs "
        f"{len(result['prompts'])} prompts x {result['max_new_tokens']} new tokens "
        f"{pace}, {result['rows'][0]['rounds']} sweep(s) over N. Baseline: {result['baseline']}: "
        f"{result['ar']['tokens_per_s']:.2f} tok/s ({result['ar']['tokens_per_s_before']:.2f} before, "
        f"{result['ar']['tokens_per_s_after']:.2f} after).",
        "",
        f"**{p['note']}**",
        "",
        f"CPU: {m['cpu_model']}, flags {' '.join(m['cpu_flags'] or [])}; load {m['loadavg_start']} at the start, "
        f"{result['loadavg_end']} at the end.",
        "",
        "| N clients | tok/s per verifier | x target alone | per-client tok/s | mean verifier batch | verify ms by "
        "batch (steps) | block eff. | draft nodes a step | draft / transfer / queue / verify / step ms | "
        "matches target (T=0) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        s = r["split"]
        split = " / ".join(f"{s[k]:.0f}" if s.get(k) is not None else "-" for k in SPLIT)
        by_batch = ", ".join(f"{b}: {ms:.0f} ({k})" for b, (ms, k) in r["verify_ms_by_batch"].items())
        lines.append(
            f"| {r['clients']} | {r['tokens_per_s_per_verifier']:.2f} | {r['speedup_vs_ar']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in r['per_client_tokens_per_s'])} | {r['mean_batch_sessions']} | "
            f"{by_batch} | {r['block_efficiency']:.2f} | {r['draft_nodes_per_step']} | {split} | "
            f"{'' if r['matches_ar'] is None else r['matches_ar']} |"
        )
    measured = ", ".join(f"N={n}: {x:.2f}" for n, x in f["measured_sessions_at_single_speed"].items())
    least = ">= " if c["at_least"] else ""  # the largest N run served every client at the rate
    lines += [
        "",
        f"Clients at {c['rate']:.2f} tok/s each: {least}{c['measured']} measured (of N = {c['measured_of']}; "
        f"{c['throughput_bound']} were the verifier's best tokens/s shared evenly), the target alone "
        f"{c['target_alone']}: {least}{c['ratio_vs_target_alone']}x.",
        "",
        f"Formula 1 + γ·t_d/t_v (N = 1 run: γ = {f['gamma']} draft nodes a step, t_d = {f['t_d_ms']:.1f} ms a node, "
        f"t_v = {f['t_v_ms']:.0f} ms a step): {f['clients_per_verifier']:.2f} sessions per verifier at one "
        f"session's speed ({f['clients_per_verifier_with_round_trip']:.2f} with the {f['transfer_ms']:.0f} ms round "
        f"trip as idle time too). Measured, tokens/s per verifier ÷ the single client's: {measured}.",
        "",
        f"Simulator (rsd_bench.simulate) calibrated from the measured costs: the N = 1 run's draft and transfer ms, "
        f"verify {sim['verify_ms']:.0f} ms + {sim['verify_ms_per_session']:.1f} ms per more session in a batch "
        "(fitted over every run's steps), each N's block efficiency; against the measured steady state (each "
        "client's block efficiency ÷ mean step, summed).",
        "",
        f"| N clients | measured tok/s | model, a drafter device each | error | model, drafts queue for "
        f"{sim['draft_devices_shared']} drafter core(s) | error | model with N's own draft and transfer ms | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['clients']} | {r['measured_steady_tokens_per_s']:.2f} | {r['predicted_tokens_per_s']:.2f} | "
        f"{100 * r['error']:+.1f} % | "
        f"{r['predicted_shared_drafter_tokens_per_s']:.2f} | {100 * r['error_shared_drafter']:+.1f} % | "
        f"{r['predicted_own_draft_tokens_per_s']:.2f} | "
        f"{100 * r['error_own_draft']:+.1f} % |"
        for r in sim["rows"]
    ]
    if result.get("comparisons_recomputed_at"):
        lines += ["", f"Comparisons recomputed from the rows (--recompute) at {result['comparisons_recomputed_at']}."]
    return "\n".join(lines) + "\n"


def log(msg: str) -> None:
    print(f"[capacity] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

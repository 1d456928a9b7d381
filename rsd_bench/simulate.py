"""A discrete-event model of E drafters (edge sites) x P verifier replicas, calibrated from measured costs.

    python -m rsd_bench.simulate --calibrate benchmarks/results/cpu-net.json     # model vs measured, per row
    python -m rsd_bench.simulate --sessions 1000 --one-way-ms 50 --draft-ms 40 --verify-ms 30 \\
        --verify-ms-per-session 2 --max-batch 32 --tokens-per-step 3.2 --replicas 1,2,4,8,16

Each session lives on a drafter of its own (an edge device) at one_way_ms from the verifiers. A step: the
drafter drafts (draft_ms; with pre-drafting, a hit (probability h) means the tree was drafted while the
verdict travelled, so only what the wait did not cover is paid), sends the tree (one_way_ms), it queues for
the first free replica, which verifies everything queued, up to max_batch trees, in one batch (after
batch_wait_ms) of verify_ms + verify_ms_per_session * (b - 1), the verdict travels back (one_way_ms) and the session
commits its tokens (tokens_per_step: a fixed number, or drawn: each of `depth` levels accepted with
probability p, plus one). No bandwidth, no loss, no prefill.

Closed forms the tests hold it to: one session, no delay, no pre-drafting: tokens/s = tokens_per_step /
(draft_ms + verify_ms); with the delay d: / (draft_ms + 2d + verify_ms); with every tree pre-drafted and
draft_ms <= 2d + verify_ms: / (2d + verify_ms); E identical sessions started together on one replica
stay in one batch: E * tokens_per_step / (draft_ms + verify_ms + verify_ms_per_session * (E - 1)).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from rsd.shape_control import Costs, Shape, ShapeController, best_fixed, expected_tokens, family
from rsd_tools.defaults import RESULTS_DIR


@dataclass(frozen=True)
class Site:
    """One session on its own drafter: its round trip, draft cost, pre-drafting and acceptance."""

    one_way_ms: float = 0.0
    draft_ms: float = 10.0
    predraft_hit_rate: float = 0.0  # h
    tokens_per_step: float = 2.0  # used when p is None
    p: float | None = None  # per-level acceptance: tokens = 1 + (levels accepted in a row, of depth)
    depth: int = 4


@dataclass(frozen=True)
class Pool:
    """P verifier replicas, each verifying up to max_batch queued trees in one batch."""

    replicas: int = 1
    verify_ms: float = 20.0  # a batch of one
    verify_ms_per_session: float = 0.0  # each more tree in the batch
    max_batch: int = 64
    batch_wait_ms: float = 0.0  # how long a replica lets a batch fill after a tree arrives (verifier batch_wait_ms)

    def batch_ms(self, b: int) -> float:
        return self.verify_ms + self.verify_ms_per_session * (b - 1)


@dataclass
class Outcome:
    tokens: float
    duration_ms: float
    steps: int
    mean_batch: float
    utilisation: float  # the replicas' busy fraction
    per_session_tokens_per_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return 1000 * self.tokens / self.duration_ms


def simulate(
    sites: list[Site], pool: Pool, duration_ms: float = 60_000.0, seed: int = 0, draft_devices: int = 0
) -> Outcome:
    """Run every session from time 0 (all start drafting) until duration_ms; tokens count when committed.
    draft_devices: 0, each site drafts on a device of its own; k > 0, every site's drafts queue (first come)
    for k shared devices, as drafters on one machine's cores do."""
    rng = random.Random(seed)
    events: list[tuple[float, int, str, int]] = []  # (time, order, kind, session)
    order = 0

    def push(t: float, kind: str, s: int) -> None:
        nonlocal order
        heapq.heappush(events, (t, order, kind, s))
        order += 1

    def tokens(site: Site) -> float:
        if site.p is None:
            return site.tokens_per_step
        accepted = 0
        while accepted < site.depth and rng.random() < site.p:
            accepted += 1
        return accepted + 1

    queue: list[int] = []  # sessions whose tree waits at the verifiers
    free, busy_ms, batches, batched = pool.replicas, 0.0, 0, 0
    sent_at = [0.0] * len(sites)
    committed, steps = [0.0] * len(sites), 0
    drafting: list[tuple[int, float]] = []  # (session, ms) waiting for a shared draft device
    free_drafters = draft_devices

    def draft(now: float, s: int, ms: float) -> None:
        nonlocal free_drafters
        if not draft_devices:
            push(now + ms, "send", s)
        elif free_drafters:
            free_drafters -= 1
            push(now + ms, "drafted", s)
        else:
            drafting.append((s, ms))

    for s, site in enumerate(sites):
        draft(0.0, s, site.draft_ms)

    def start_batches(now: float) -> None:
        nonlocal free, busy_ms, batches, batched
        while free and queue:
            batch, queue[:] = queue[: pool.max_batch], queue[pool.max_batch :]
            free -= 1
            cost = pool.batch_ms(len(batch))
            busy_ms += min(cost, max(0.0, duration_ms - now))
            batches, batched = batches + 1, batched + len(batch)
            push(now + cost, "verified", -1)  # the replica frees
            for s in batch:
                push(now + cost + sites[s].one_way_ms, "verdict", s)

    while events:
        now, _, kind, s = heapq.heappop(events)
        if now > duration_ms:
            break
        if kind == "drafted":  # a shared device frees: the next queued draft starts, this tree leaves
            free_drafters += 1
            if drafting:
                draft(now, *drafting.pop(0))
            kind = "send"
        if kind == "send":
            sent_at[s] = now
            push(now + sites[s].one_way_ms, "arrive", s)
        elif kind == "arrive":  # dispatched after every event of this instant (+ the batch wait): one batch
            queue.append(s)
            push(now + pool.batch_wait_ms, "dispatch", -1)
        elif kind == "verified":
            free += 1
            start_batches(now)
        elif kind == "dispatch":
            start_batches(now)
        else:  # verdict: commit, then the next tree (drafted during the wait if pre-drafting hit)
            site = sites[s]
            committed[s] += tokens(site)
            steps += 1
            hit = rng.random() < site.predraft_hit_rate
            draft(now, s, max(0.0, site.draft_ms - (now - sent_at[s])) if hit else site.draft_ms)
    return Outcome(
        tokens=sum(committed),
        duration_ms=duration_ms,
        steps=steps,
        mean_batch=batched / batches if batches else 0.0,
        utilisation=busy_ms / (duration_ms * pool.replicas),
        per_session_tokens_per_s=[1000 * c / duration_ms for c in committed],
    )


# ---------------------------------------------------------------------------------------------
# Calibration against a network run (rsd_bench.net), and sizing


def calibrated(base: dict, row: dict) -> tuple[Site, Pool]:
    """The site and replica that should reproduce `row` of a net result, from `base`, the plain row of the
    same method, shape and T at the smallest delay: its draft and verify ms per step and its transfer (the
    loopback round trip without added delay), plus the row's added one-way delay, its pre-draft hit rate and
    its block efficiency (the same seeds: the same tokens per step)."""
    split = base["split"]
    site = Site(
        one_way_ms=split["transfer_ms"] / 2 + row["delay_ms"] - base["delay_ms"],
        draft_ms=split["draft_ms"],
        predraft_hit_rate=row["predraft_hit_rate"] or 0.0 if row["pipelined"] else 0.0,
        tokens_per_step=row["block_efficiency"],
    )
    return site, Pool(verify_ms=split["verify_ms"])


def check_rows(result: dict, steps: int = 1000) -> list[dict]:
    """Per row of a net result: the model's tokens/s, calibrated on the plain row at the smallest delay,
    against the measured steady state (block efficiency / mean step after the first of each generation).
    The model runs for about `steps` steps (a horizon of few steps would cut the last one off)."""
    key = lambda r: (r["method"], r["shape"], r["temperature"])  # noqa: E731
    base = {}
    for r in sorted((r for r in result["rows"] if not r["pipelined"]), key=lambda r: r["delay_ms"], reverse=True):
        base[key(r)] = r
    out = []
    for row in result["rows"]:
        if row.get("adaptive"):  # its shape changes step by step: no one plain row calibrates it
            continue
        site, pool = calibrated(base[key(row)], row)
        duration_ms = steps * (site.draft_ms + 2 * site.one_way_ms + row["split"]["verify_ms"])
        predicted = simulate([site], pool, duration_ms).tokens_per_s
        own_verify = dataclasses.replace(pool, verify_ms=row["split"]["verify_ms"])  # the load's drift taken out
        predicted_own = simulate([site], own_verify, duration_ms).tokens_per_s
        measured = 1000 * row["block_efficiency"] / row["split"]["step_ms"]
        out.append(
            {
                "delay_ms": row["delay_ms"],
                "method": row["method"],
                "shape": row["shape"],
                "temperature": row["temperature"],
                "pipelined": row["pipelined"],
                "measured_steady_tokens_per_s": round(measured, 3),
                "predicted_tokens_per_s": round(predicted, 3),
                "error": round(predicted / measured - 1, 4),
                "predicted_own_verify_tokens_per_s": round(predicted_own, 3),
                "error_own_verify": round(predicted_own / measured - 1, 4),
            }
        )
    return out


def replicas_needed(site: Site, pool: Pool, sessions: int, rate: float, most: int, duration_ms: float) -> dict:
    """The fewest replicas (1..most, doubling then bisecting) at which every session gets >= rate tokens/s."""

    def ok(p: int) -> tuple[bool, Outcome]:
        o = simulate([site] * sessions, dataclasses.replace(pool, replicas=p), duration_ms)
        return min(o.per_session_tokens_per_s) >= rate, o

    lo, hi = 0, 1
    while not ok(hi)[0]:
        lo, hi = hi, hi * 2
        if hi > most:
            return {"replicas": None, "note": f"more than {most}"}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid)[0] else (mid, hi)
    o = ok(hi)[1]
    return {"replicas": hi, "tokens_per_s": round(o.tokens_per_s, 1), "mean_batch": round(o.mean_batch, 2)}


def shape_table(base: Costs, truth: dict[int, float], delays: list[float], shapes: list[Shape], steps: int) -> dict:
    """Per one-way delay: the best fixed shape (knowing truth, p_W per width), the controller's tokens/s over
    `steps` steps learnt from drawn outcomes (exploration included) and the shape it settled on, against the
    best single fixed shape for the whole delay range (the largest mean of tokens/s / best at each delay)."""
    rate = lambda shape, costs: 1000 * expected_tokens(truth[shape.width], shape.depth) / costs.step(shape)  # noqa: E731
    at = {d: dataclasses.replace(base, one_way_ms=d) for d in delays}
    best = {d: best_fixed(shapes, truth, at[d]) for d in delays}
    single = max(shapes, key=lambda s: sum(rate(s, at[d]) / rate(best[d], at[d]) for d in delays))
    rows = []
    for d in delays:
        ctl, rng, tokens, ms = ShapeController(list(shapes)), random.Random(int(d)), 0, 0.0
        for _ in range(steps):
            shape = ctl.choose(at[d])
            accepted = 0
            while accepted < shape.depth and rng.random() < truth[shape.width]:
                accepted += 1
            ctl.observe(shape, accepted)
            tokens, ms = tokens + accepted + 1, ms + at[d].step(shape)
        rows.append(
            {
                "one_way_ms": d,
                "best_shape": f"{best[d].width}x{best[d].depth}",
                "best_tokens_per_s": round(rate(best[d], at[d]), 3),
                "single_shape_tokens_per_s": round(rate(single, at[d]), 3),
                "controller_shape": f"{ctl.choose(at[d]).width}x{ctl.choose(at[d]).depth}",
                "controller_tokens_per_s": round(1000 * tokens / ms, 3),
            }
        )
    return {"single_shape": f"{single.width}x{single.depth}", "steps": steps, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.simulate", description=__doc__.split("\n")[0])
    ap.add_argument("--calibrate", type=Path, help="a net result (rsd_bench.net): the model against each row")
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--one-way-ms", type=float, default=50.0)
    ap.add_argument("--draft-ms", type=float, default=40.0)
    ap.add_argument("--predraft-hit-rate", type=float, default=0.0)
    ap.add_argument("--tokens-per-step", type=float, default=3.0)
    ap.add_argument("--verify-ms", type=float, default=30.0)
    ap.add_argument("--verify-ms-per-session", type=float, default=2.0)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--rate", type=float, default=10.0, help="tokens/s each session must get (sizing)")
    ap.add_argument("--most-replicas", type=int, default=4096)
    ap.add_argument("--duration-ms", type=float, default=20_000.0)
    shapes = ap.add_argument_group("tree shape per round-trip class (rsd.shape_control)")
    shapes.add_argument("--shape-delays", default="0,10,25,50,100,200,500", help="one-way ms")
    shapes.add_argument("--p-by-width", default="1:0.82,2:0.88,3:0.9,4:0.91", help="W:p_W, per-level acceptance")
    shapes.add_argument("--max-depth", type=int, default=10)
    shapes.add_argument("--draft-ms-per-level", type=float, default=57.8, help="a draft forward (one row)")
    shapes.add_argument("--draft-ms-per-row", type=float, default=4.4)
    shapes.add_argument("--verify-ms-base", type=float, default=122.0, help="a target forward (one token)")
    shapes.add_argument("--verify-ms-per-node", type=float, default=18.0)
    shapes.add_argument("--controller-steps", type=int, default=2000)
    ap.add_argument("--name", default="net-sim")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rsd_bench.machine import machine_info, run_record, write_result

    result: dict = {**run_record("simulate"), "complete": True, "settings": vars(args) | {"out_dir": None}}
    result["machine"] = machine_info()  # the model runs anywhere; recorded for the index's machine class
    result["settings"]["calibrate"] = str(args.calibrate) if args.calibrate else None
    lines = ["# The network simulator (rsd_bench.simulate)", ""]
    if args.calibrate:
        rows = check_rows(json.loads(args.calibrate.read_text()))
        result["check"] = rows
        lines += [
            f"Model against the measured steady state of {args.calibrate.name}: one session, calibrated on the plain "
            "row at the smallest delay of each method, shape and T (its draft, verify and loopback transfer ms), "
            "then the row's added delay, hit rate and block efficiency.",
            "",
            "| delay ms | method | T | pre-drafting | measured tok/s | model tok/s | error | model with the row's "
            "own verify ms | error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {r['delay_ms']:g} | {r['method']} {r['shape']} | {r['temperature']:g} | "
            f"{'on' if r['pipelined'] else 'off'} | {r['measured_steady_tokens_per_s']:.2f} | "
            f"{r['predicted_tokens_per_s']:.2f} | {100 * r['error']:+.1f} % | "
            f"{r['predicted_own_verify_tokens_per_s']:.2f} | {100 * r['error_own_verify']:+.1f} % |"
            for r in rows
        ]
        lines.append("")
    site = Site(args.one_way_ms, args.draft_ms, args.predraft_hit_rate, args.tokens_per_step)
    pool = Pool(1, args.verify_ms, args.verify_ms_per_session, args.max_batch)
    sizing = replicas_needed(site, pool, args.sessions, args.rate, args.most_replicas, args.duration_ms)
    result["sizing"] = sizing
    lines += [
        f"Sizing: {args.sessions} sessions at {args.one_way_ms:g} ms one way, draft {args.draft_ms:g} ms, "
        f"{args.tokens_per_step:g} tokens per step, batches of up to {args.max_batch} costing {args.verify_ms:g} + "
        f"{args.verify_ms_per_session:g} ms per more tree: {sizing} to give each >= {args.rate:g} tokens/s.",
    ]
    truth = {int(w): float(p) for w, p in (x.split(":") for x in args.p_by_width.split(","))}
    base = Costs(0.0, args.draft_ms_per_level, args.draft_ms_per_row, args.verify_ms_base, args.verify_ms_per_node)
    delays = [float(d) for d in args.shape_delays.split(",")]
    table = shape_table(base, truth, delays, family(truth, range(1, args.max_depth + 1)), args.controller_steps)
    result["shapes"] = table
    lines += [
        "",
        f"Tree shape (WxL) per round-trip class: p_W {truth}, draft {args.draft_ms_per_level:g} ms a level + "
        f"{args.draft_ms_per_row:g} a row, verify {args.verify_ms_base:g} + {args.verify_ms_per_node:g} ms a node; "
        f"the controller learns from {table['steps']} drawn steps per delay (its tokens/s include the exploring); "
        f"the best single shape for the whole range is {table['single_shape']}. (The default costs are the real "
        "pair's: docs/performance.md#across-a-network.)",
        "",
        "| one-way ms | best shape | best tok/s | controller settles on | controller tok/s (x best) | "
        f"{table['single_shape']} tok/s (x best) | controller x single shape |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in table["rows"]:
        b = r["best_tokens_per_s"]
        lines.append(
            f"| {r['one_way_ms']:g} | {r['best_shape']} | {b:.2f} | {r['controller_shape']} | "
            f"{r['controller_tokens_per_s']:.2f} ({r['controller_tokens_per_s'] / b:.3f}) | "
            f"{r['single_shape_tokens_per_s']:.2f} ({r['single_shape_tokens_per_s'] / b:.3f}) | "
            f"{r['controller_tokens_per_s'] / r['single_shape_tokens_per_s']:.3f} |"
        )
    write_result(args.out_dir, args.name, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

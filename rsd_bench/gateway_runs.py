"""Generations through a gateway, timed on the client (rsd_bench.services): one at a time or N
started together, and the split of their steps' time from the StepStats of every delta."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


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
    delta_tokens: list[int] = field(default_factory=list)  # tokens committed by each delta (step)


def gateway_run(
    address: str,
    prompt_ids: list[int],
    args,
    temperature: float,
    seed: int,
    barrier=None,
    max_new_tokens: int = 0,
    verification: str | None = None,
    adaptive_shape: bool = False,
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
            verification=verification,
            adaptive_shape=adaptive_shape,
        )
        arrivals, delta_tokens = [], []
        for delta in gen:
            arrivals.append(time.perf_counter())
            delta_tokens.append(len(delta.token_ids))
        t1 = time.perf_counter()
    if gen.finished is None:
        raise RuntimeError("the gateway stream ended without a finish event")
    steps = list(gen.steps)
    return Run(list(gen.token_ids), t1 - t0, t0, t1, steps, [t0, *arrivals], gen.finished.num_steps, delta_tokens)


def concurrent_runs(
    address: str, prompts: list[list[int]], args, n: int, temperature: float
) -> tuple[list[Run], float]:
    """n sessions started together (a barrier); -> (runs, wall from the first start to the last end)."""

    def one(i: int, barrier: threading.Barrier) -> Run:
        return gateway_run(address, prompts[i % len(prompts)], args, temperature, args.seed + i, barrier)

    runs = run_together(n, one)
    wall = max(r.end for r in runs) - min(r.start for r in runs)
    return runs, wall


def run_together(n: int, work: Callable[[int, threading.Barrier], T]) -> list[T]:
    """work(i, barrier) in n threads, each waiting on the shared barrier before it starts timing;
    -> the n results in order. The first error is raised (after every thread ended)."""
    barrier = threading.Barrier(n)
    out: list = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = work(i, barrier)
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
    return out


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

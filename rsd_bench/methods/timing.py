"""Measuring: the models' forward costs (for c and MBSU), the time of each target step, and the
sums over prompts that become the result rows."""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass

from rsd_bench.methods.planning import AR_DTYPES, Spec
from rsd_bench.stats import BOOTSTRAP_RESAMPLES, bootstrap_interval

MBSU_FORMULA = (
    "mbsu = block_efficiency / (1 + c * draft_forwards_per_step), c = draft / target single-token forward "
    "time (minimum over interleaved repetitions, measured in this run on the first prompt's context); "
    "draft_forwards_per_step = draft forwards / target calls"
)


def forward_costs(
    target,
    draft,
    prompt_ids: list[int],
    tree_sizes: list[int],
    reps: int,
    drafts: dict | None = None,
    draft_tokens: tuple[int, ...] = (),
) -> dict:
    """Single-token forward times of both models (for c) and the target's forward time for each n in
    tree_sizes (n new tokens as a chain), all after the prompt sits in the cache. `drafts` (name ->
    runner, e.g. {"none": fp32, "int8": quantised}) are each timed at 1 and every n in draft_tokens:
    draft_ms_by_tokens[name][n] and c_by_draft[name]. The timings are interleaved (each rep runs every
    case once) and summarised by their minimum: a background load only ever adds time, and it then hits
    draft and target alike. The first rep is a warm-up."""
    import torch

    drafts = drafts or {}
    cases = [("target", target, 1)] + ([("draft", draft, 1)] if draft is not None else [])
    cases += [("target", target, n) for n in sorted(set(tree_sizes) - {1})]
    cases += [(f"draft:{name}", runner, n) for name, runner in drafts.items() for n in sorted({1, *draft_tokens})]
    for runner in {id(r): r for _, r, _ in cases}.values():
        runner.reset()
        runner.forward(torch.tensor(prompt_ids), torch.arange(-1, len(prompt_ids) - 1))
        runner.commit(list(range(len(prompt_ids))))
    times: dict[tuple[str, int], list[float]] = {(role, n): [] for role, _, n in cases}
    for rep in range(reps + 1):
        for role, runner, n in cases:
            t = time.perf_counter()
            runner.forward(torch.tensor([prompt_ids[-1]] * n), torch.arange(-1, n - 1))
            if rep:
                times[(role, n)].append(1000 * (time.perf_counter() - t))
            runner.commit([])
    for _, runner, _ in cases:
        runner.reset()
    out = {"context_tokens": len(prompt_ids), "reps": reps, "summary": "min over reps (median in *_median)"}
    for role in ("target", "draft"):
        if (role, 1) in times:
            out[f"{role}_1tok_ms"] = min(times[(role, 1)])
            out[f"{role}_1tok_ms_median"] = statistics.median(times[(role, 1)])
    if draft is not None:
        out["c"] = out["draft_1tok_ms"] / out["target_1tok_ms"]
    out["target_ms_by_tokens"] = {str(n): min(ts) for (role, n), ts in times.items() if role == "target"}
    if drafts:
        out["draft_ms_by_tokens"] = {
            name: {str(n): min(ts) for (role, n), ts in times.items() if role == f"draft:{name}"} for name in drafts
        }
        out["c_by_draft"] = {
            name: by_n["1"] / out["target_1tok_ms"] for name, by_n in out["draft_ms_by_tokens"].items()
        }
    return out


def token_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def instrument_steps(gen) -> list[tuple[float, int]]:
    """Make gen's verifier append (time, tokens) after each target step, into the returned list (the
    first step of a generation also prefills both models: steady-state rates start after it).

    The one place the benchmark reaches into the generator: it wraps the two methods of gen.verifier
    (a rsd_runtime.engines.Verifier) that run a target step. SpeculativeGenerator's public hook
    after_verdict sees only speculative steps; the autoregressive path (Verifier.step_autoregressive)
    has none, so one wrapper of both keeps every method timed the same way."""
    marks: list[tuple[float, int]] = []
    verifier = gen.verifier
    verify, step_autoregressive = verifier.verify, verifier.step_autoregressive

    def timed_verify(*args, **kwargs):
        verdict = verify(*args, **kwargs)
        marks.append((time.perf_counter(), len(verdict.token_ids)))
        return verdict

    def timed_step(*args, **kwargs):
        token = step_autoregressive(*args, **kwargs)
        marks.append((time.perf_counter(), 1))
        return token

    verifier.verify, verifier.step_autoregressive = timed_verify, timed_step
    return marks


@dataclass
class Tally:
    """Sums over the prompts of one (method, temperature)."""

    new_tokens: int = 0
    target_calls: int = 0
    draft_forwards: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    total_s: float = 0.0
    accepted: list | None = None
    tried: list | None = None

    def add(self, stats) -> None:
        """Add one generation's rsd_runtime.generator.GenerationStats."""
        self.new_tokens += stats.new_tokens
        self.target_calls += stats.target_calls
        self.draft_forwards += stats.draft_forwards
        self.draft_s += stats.draft_s
        self.verify_s += stats.verify_s
        self.accept_s += stats.accept_s
        self.total_s += stats.total_s
        if stats.tried_by_depth:
            if self.tried is None:
                self.accepted, self.tried = [0] * len(stats.tried_by_depth), [0] * len(stats.tried_by_depth)
            self.accepted = [a + b for a, b in zip(self.accepted, stats.accepted_by_depth, strict=True)]
            self.tried = [a + b for a, b in zip(self.tried, stats.tried_by_depth, strict=True)]

    def add_counted(self, new_tokens: int, wall_s: float, counts: dict[str, int]) -> None:
        """Add one generation measured from outside (hf_assisted: forwards counted by hooks)."""
        self.new_tokens += new_tokens
        self.total_s += wall_s
        self.target_calls += counts["target"]
        self.draft_forwards += counts["draft"]


def make_row(
    spec: Spec, temperature: float, tally: Tally, outputs: list[dict], costs: dict, resamples: int = BOOTSTRAP_RESAMPLES
) -> dict:
    method = spec.method()
    is_hf = spec.name == "hf_assisted"
    calls = tally.target_calls
    be = tally.new_tokens / calls if calls else None  # hf_assisted: target forwards counted by a hook
    fwd_per_step = tally.draft_forwards / calls if calls else None
    c = costs.get("c_by_draft", {}).get(spec.draft) if spec.draft else costs.get("c")
    mbsu = None if be is None else (be / (1 + c * fwd_per_step) if c is not None else (be if method is None else None))
    steady_tokens = tally.new_tokens - sum(o["first_step_tokens"] for o in outputs)
    steady_s = sum(o["steady_s"] for o in outputs)
    per_step = [n for o in outputs for n in (o.get("step_tokens") or [])]
    whole = bool(outputs) and all(o.get("step_tokens") is not None for o in outputs)
    ci95 = bootstrap_interval(per_step, resamples) if whole and per_step and resamples > 0 else None
    acceptance = None
    if tally.tried is not None:
        acceptance = [round(a / t, 4) if t else None for a, t in zip(tally.accepted, tally.tried, strict=True)]
    return {
        "method": spec.name,
        "label": spec.label,
        "protocol": None,  # set by place_rows
        "budget": None,  # fixed_nodes: the budget this row competes in
        "best": None,  # fixed_nodes: the highest block efficiency of its method within the budget
        "temperature": temperature,
        "shape": spec.shape or None,
        "draft_quantize": None,  # speculative rows: the drafter's quantisation (set in main)
        "verification": None,  # speculative rows: the rule's choice, rsd.methods (set in main)
        "depth": method.depth if method else (0 if spec.name == "ar" else None),
        "nodes": method.max_draft_tokens if method else (0 if spec.name == "ar" else None),
        "prompts": len(outputs),
        "new_tokens": tally.new_tokens,
        "target_calls": calls or None,
        "draft_forwards": tally.draft_forwards if calls else None,
        "draft_forwards_per_step": fwd_per_step,
        "block_efficiency": be,
        "block_efficiency_ci95": ci95,  # percentile bootstrap over steps (rsd_bench.stats)
        "steps": len(per_step) if whole else None,
        "mbsu": mbsu,
        "acceptance_by_depth": acceptance,
        # the counts behind it: steps that accepted a draft at depth d+1 / reached depth d at a node with
        # children (a path ending at a leaf above the tree's depth, e.g. RSD-S's early truncation, is neither)
        "accepted_by_depth": tally.accepted,
        "tried_by_depth": tally.tried,
        "tokens_per_s": tally.new_tokens / tally.total_s if tally.total_s > 0 else None,
        "speedup_vs_ar": None,  # filled in once every row exists
        "first_step_s": sum(o["first_step_s"] for o in outputs),  # holds both prefills
        "steady_tokens_per_s": steady_tokens / steady_s if steady_s > 0 else None,  # after the first step
        "steady_speedup_vs_ar": None,
        "total_s": tally.total_s,
        "draft_s": None if is_hf else tally.draft_s,
        "verify_s": None if is_hf else tally.verify_s,
        "accept_s": None if is_hf else tally.accept_s,
        "other_s": None if is_hf else tally.total_s - tally.draft_s - tally.verify_s - tally.accept_s,
        # the per-step time split: draft, verify (target forward), accept (rule + commits), other
        "step_ms": None
        if is_hf
        else {
            "draft": 1000 * tally.draft_s / max(calls, 1),
            "verify": 1000 * tally.verify_s / max(calls, 1),
            "accept": 1000 * tally.accept_s / max(calls, 1),
            "other": 1000 * (tally.total_s - tally.draft_s - tally.verify_s - tally.accept_s) / max(calls, 1),
        },
        "verify_ms_per_call": None if is_hf else 1000 * tally.verify_s / max(calls, 1),
        "draft_ms_per_forward": 1000 * tally.draft_s / tally.draft_forwards if tally.draft_forwards else None,
        "matches_ar": None,  # T = 0 only: every prompt's tokens equal the ar row's
        "outputs": outputs,
    }


def finish_rows(rows: list[dict]) -> None:
    """Speed-ups against the fastest ar row at the same temperature, and T=0 equality with the ar row
    of the same target (label "ar": ar:DTYPE loads another target, whose greedy text may differ)."""
    fastest: dict[float, dict] = {}
    same_target = {r["temperature"]: r for r in rows if r["label"] == "ar"}
    for r in rows:
        if r["method"] == "ar" and r["tokens_per_s"]:
            best = fastest.get(r["temperature"])
            if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
                fastest[r["temperature"]] = r
    for r in rows:
        base = fastest.get(r["temperature"])
        if base is None:
            continue
        r["ar_reference"] = base["label"]
        for rate, ratio in (("tokens_per_s", "speedup_vs_ar"), ("steady_tokens_per_s", "steady_speedup_vs_ar")):
            if r[rate] and base[rate]:
                r[ratio] = r[rate] / base[rate]
        if r["temperature"] == 0 and r["temperature"] in same_target and r["shape"] not in AR_DTYPES:
            ref = {o["prompt"]: o["token_sha"] for o in same_target[r["temperature"]]["outputs"]}
            r["matches_ar"] = all(ref.get(o["prompt"]) == o["token_sha"] for o in r["outputs"])


def place_rows(rows: list[dict], where: dict[str, list]) -> list[dict]:
    """One row per (measurement, place it is reported at); fixed_nodes rows get their budget and the
    best-in-budget mark."""
    out = []
    for r in rows:
        for protocol, budget in where.get(r["label"], [("custom", None)]):
            out.append({**r, "protocol": protocol, "budget": budget})
    groups: dict[tuple, list[dict]] = {}
    for r in out:
        if r["protocol"] == "fixed_nodes" and r["block_efficiency"] is not None:
            groups.setdefault((r["method"], r.get("draft_quantize"), r["budget"], r["temperature"]), []).append(r)
    for group in groups.values():
        top = max(group, key=lambda r: r["block_efficiency"])
        for r in group:
            r["best"] = r is top
    return out

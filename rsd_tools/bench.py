"""Benchmark speculative methods against autoregressive decoding on one loaded drafter/target pair.

    rsd bench --quick                                          # the real pair (provisioned/cached)
    rsd bench --protocol all --temperatures 0,0.6,1 --name cpu-full   # both paper protocols
    python -m rsd_tools.bench --config "ar;sd:4;specinfer:2,2,1;spectr:2x4;rsd_c:2,2,1;rsd_s:3x4" \\
        --temperatures 0,1 --num-prompts 3 --max-new-tokens 32 --threads 2 --name cpu-quick
    python -m rsd_tools.bench --method ar --method rsd_s:3x4 --draft DIR --target DIR --prompts FILE

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
own dtype (as the drafter and verifier services do). --draft-quantize none,int8 compares drafters in
one run: every speculative method runs again with each further drafter (label +int8), and each
drafter's forward is timed at --draft-cost-tokens (--costs-only: only those timings). --cores pins the
process; the result files record the placement and the CPU's notable flags.

Prompts: by default functions of the Python standard library of the running interpreter (a fixed
module list; module-level functions with a docstring and a body after it), cut after the signature
and the docstring, drawn with a fixed seed. --prompts FILE reads JSON lines with a "prompt" field.

Metrics per (method, temperature), summed over prompts:
    block_efficiency  new tokens / target calls
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
import ast
import hashlib
import importlib
import inspect
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from rsd_runtime import DTYPE_NAMES, QUANTIZE_MODES
from rsd_service.placement import add_placement_flags

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here reaches a model hub

DEFAULT_SHAPES = {"sd": "4", "specinfer": "2,2,1", "spectr": "3x4", "rsd_c": "2,2,1", "rsd_s": "3x4", "hf_assisted": ""}
QUICK_CONFIG = "ar;sd:4;specinfer:2,2,1;spectr:3x4;rsd_c:2,2,1;rsd_s:3x4;hf_assisted"  # ~10 min on 2 cores
DEPTHS = (2, 3, 4, 5)
BUDGETS = (6, 10, 14, 21, 30)
# fixed_nodes: per budget (draft tokens), the shapes each method may use: a deep-narrow and a
# shallow-wide tree for every tree method (nodes <= budget). SD's chain is capped at depth 8 to bound
# its drafting cost (8 draft forwards per target call).
BUDGET_CANDIDATES = {
    6: {"sd": ["6"], "tree": ["2,2", "2,1,1"], "kxl": ["2x3", "3x2"]},
    10: {"sd": ["8"], "tree": ["2,2,1", "2,1,1,1,1"], "kxl": ["2x5", "3x3"]},
    14: {"sd": ["8"], "tree": ["2,2,1,1", "2,2,2"], "kxl": ["2x7", "3x4"]},
    21: {"sd": ["8"], "tree": ["3,2,1,1", "2,2,1,1,1"], "kxl": ["3x7", "4x5"]},
    30: {"sd": ["8"], "tree": ["2,2,2,1,1", "3,3,1"], "kxl": ["5x6", "6x5"]},
}
AR_DTYPES = DTYPE_NAMES  # ar:DTYPE: the target alone, loaded again in that dtype
METHOD_ORDER = ("ar", "sd", "specinfer", "spectr", "rsd_c", "rsd_s", "hf_assisted")
MBSU_FORMULA = (
    "mbsu = block_efficiency / (1 + c * draft_forwards_per_step), c = draft / target single-token forward "
    "time (minimum over interleaved repetitions, measured in this run on the first prompt's context); "
    "draft_forwards_per_step = draft forwards / target calls"
)
# Pure-Python standard-library modules whose module-level functions make the built-in prompt set.
STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "codecs", "colorsys", "copy", "csv", "dataclasses",
    "difflib", "dis", "email.utils", "fnmatch", "fractions", "functools", "genericpath", "gettext", "glob",
    "heapq", "html", "inspect", "ipaddress", "json", "keyword", "linecache", "locale", "logging", "mimetypes",
    "ntpath", "os", "platform", "posixpath", "pprint", "quopri", "random", "re", "reprlib", "shlex", "shutil",
    "statistics", "string", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "tokenize",
    "traceback", "types", "urllib.parse", "uuid", "warnings", "zipfile",
)  # fmt: skip
# transformers 5.24's defaults for assisted generation (GenerationConfig._get_default_generation_params).
_HF_DEFAULTS = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}
PROMPT_CHARS = (120, 1500)  # prompt length bounds, in characters


# ---------------------------------------------------------------- prompts


def _signature_and_docstring(source: str) -> str | None:
    """The source of a module-level function cut after its docstring, or None when it has no
    docstring or nothing after it."""
    try:
        node = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or ast.get_docstring(node) is None:
        return None
    if len(node.body) < 2:  # nothing to complete after the docstring
        return None
    lines = source.splitlines()
    return "\n".join(lines[: node.body[0].end_lineno]) + "\n"


def stdlib_candidates() -> list[dict]:
    """Every usable (module, function) of STDLIB_MODULES, sorted: dicts with id, prompt, source."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mod_name in STDLIB_MODULES:
            try:
                module = importlib.import_module(mod_name)
            except ImportError:
                continue
            for name, fn in sorted(vars(module).items()):
                if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                    continue
                try:
                    source = inspect.getsource(fn)
                except (OSError, TypeError):
                    continue
                prompt = _signature_and_docstring(source)
                if prompt and PROMPT_CHARS[0] <= len(prompt) <= PROMPT_CHARS[1]:
                    out.append({"id": f"{mod_name}.{name}", "prompt": prompt})
    return out


def stdlib_prompts(n: int, seed: int) -> list[dict]:
    """n prompts drawn without replacement, with random.Random(seed), from stdlib_candidates()."""
    cands = stdlib_candidates()
    if n > len(cands):
        raise ValueError(f"only {len(cands)} standard-library prompts are available, asked for {n}")
    return random.Random(seed).sample(cands, n)


def file_prompts(path: Path, n: int | None, seed: int) -> list[dict]:
    """JSON lines with a "prompt" field (and an optional "id"); all of them in file order when n is
    None or covers the file, else n drawn with random.Random(seed)."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            obj = json.loads(line)
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                raise ValueError(f"{path}:{i + 1}: expected a JSON object with a non-empty string 'prompt'")
            rows.append({"id": str(obj.get("id", f"line{i + 1}")), "prompt": obj["prompt"]})
    if n is None or n >= len(rows):
        return rows
    return random.Random(seed).sample(rows, n)


# ---------------------------------------------------------------- methods


@dataclass(frozen=True)
class Spec:
    name: str  # "ar", "hf_assisted" or an rsd.methods name
    shape: str = ""
    draft: str = ""  # another drafter of --draft-quantize (e.g. "int8"); "" = the first one

    @property
    def label(self) -> str:
        base = f"{self.name}:{self.shape}" if self.shape else self.name
        return f"{base}+{self.draft}" if self.draft else base

    def method(self):
        """The rsd.methods.Method, or None for ar and hf_assisted."""
        from rsd.methods import Method

        return None if self.name in ("ar", "hf_assisted") else Method.parse(self.name, self.shape)


def parse_spec(text: str) -> Spec:
    """ "rsd_s:3x4" / "sd" (default shape) / "ar" / "ar:plain" / "ar:float32" / "hf_assisted:4" -> Spec."""
    name, _, shape = text.strip().partition(":")
    name, shape = name.strip(), shape.strip()
    if name == "ar":
        if shape not in ("", "plain", *AR_DTYPES):
            raise ValueError(
                "ar takes no shape, 'plain' (the target alone with plain F.linear) or a dtype "
                f"({', '.join(AR_DTYPES)}: the target alone loaded in that dtype)"
            )
        return Spec("ar", shape)
    if name == "hf_assisted":
        if shape and not (shape.isdigit() and int(shape) > 0):
            raise ValueError(f"hf_assisted takes a number of draft tokens, got {shape!r}")
        return Spec(name, shape)
    if name not in DEFAULT_SHAPES:
        raise ValueError(f"unknown method {name!r}; expected ar, hf_assisted or one of {', '.join(DEFAULT_SHAPES)}")
    spec = Spec(name, shape or DEFAULT_SHAPES[name])
    spec.method()  # raises ValueError on a bad shape
    return spec


def parse_config(text: str) -> list[Spec]:
    """ "ar;sd:4;rsd_c:2,2,1" -> [Spec, ...] (';' separates methods: shapes use commas)."""
    specs = [parse_spec(part) for part in text.split(";") if part.strip()]
    if not specs:
        raise ValueError(f"no methods in {text!r}")
    return specs


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return values


def fixed_depth_specs(depth: int) -> list[Spec]:
    """Matched shapes of draft length `depth` (>= 2): every method's tree is `depth` tokens deep."""
    branching = ",".join(["2", "2"] + ["1"] * (depth - 2))
    return [
        Spec("sd", str(depth)),
        Spec("specinfer", branching),
        Spec("spectr", f"3x{depth}"),
        Spec("rsd_c", branching),
        Spec("rsd_s", f"3x{depth}"),
    ]


def fixed_nodes_specs(budget: int) -> list[Spec]:
    """The candidate shapes of every method within `budget` draft tokens (BUDGET_CANDIDATES)."""
    if budget not in BUDGET_CANDIDATES:
        raise ValueError(f"no candidate shapes for a budget of {budget}; known: {sorted(BUDGET_CANDIDATES)}")
    table = BUDGET_CANDIDATES[budget]
    kinds = {"sd": "sd", "specinfer": "tree", "spectr": "kxl", "rsd_c": "tree", "rsd_s": "kxl"}
    specs = [Spec(name, shape) for name, kind in kinds.items() for shape in table[kind]]
    for spec in specs:
        assert spec.method().max_draft_tokens <= budget, spec
    return specs


def plan(protocol: str, depths: list[int], budgets: list[int]) -> tuple[list[Spec], dict[str, list]]:
    """The specs a protocol runs (each once) and, per label, where its rows are reported:
    a list of (protocol, budget or None)."""
    where: dict[str, list] = {"ar": [("baseline", None)]}  # ar and the outside peer belong to no protocol
    specs = [Spec("ar")]
    if protocol in ("fixed_depth", "all"):
        for depth in depths:
            if depth < 2:
                raise ValueError("fixed_depth needs depths >= 2")
            for spec in fixed_depth_specs(depth):
                where.setdefault(spec.label, []).append(("fixed_depth", None))
                specs += [spec] if spec not in specs else []
    if protocol in ("fixed_nodes", "all"):
        for budget in budgets:
            for spec in fixed_nodes_specs(budget):
                where.setdefault(spec.label, []).append(("fixed_nodes", budget))
                specs += [spec] if spec not in specs else []
    hf = Spec("hf_assisted", "")
    where[hf.label] = [("baseline", None)]
    return [*specs, hf], where


def parse_temperatures(text: str) -> list[float]:
    temps = [float(t) for t in text.split(",") if t.strip()]
    if not temps or any(not (t >= 0 and t < float("inf")) for t in temps):
        raise ValueError(f"temperatures must be finite and >= 0, got {text!r}")
    return temps


# ---------------------------------------------------------------- measuring


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


def _token_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


class _StepStreamer:
    """A transformers streamer that timestamps each put: the prompt first, then one put per step."""

    def __init__(self, marks: list):
        self.marks, self.seen_prompt = marks, False

    def put(self, value) -> None:
        if self.seen_prompt:
            self.marks.append((time.perf_counter(), int(value.numel())))
        self.seen_prompt = True

    def end(self) -> None:
        pass


def _instrument(gen) -> list[tuple[float, int]]:
    """Make gen's verifier append (time, tokens) after each target step, into the returned list (the
    first step of a generation also prefills both models: steady-state rates start after it)."""
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


def run_hf_assisted(
    target_model,
    draft_model,
    prompt_ids,
    spec: Spec,
    temperature,
    max_new,
    eos,
    seed,
    ignore_eos,
    marks: list,
    counts: dict | None = None,
):
    """One transformers assisted generation; returns (new token ids, wall seconds, settings used,
    (start, end) times); appends (time, tokens) per step to marks and adds the forwards of each model
    to counts["target"] / counts["draft"] (forward hooks: transformers reports no target calls)."""
    import copy

    import torch

    gen_cfg = copy.deepcopy(target_model.generation_config)
    gen_cfg.max_new_tokens = max_new
    gen_cfg.do_sample = temperature > 0
    gen_cfg.temperature = temperature if temperature > 0 else None
    # Explicit "off" values: None would fall back to transformers' defaults (top_k 50).
    gen_cfg.top_k, gen_cfg.top_p, gen_cfg.repetition_penalty = 0, 1.0, 1.0
    gen_cfg.eos_token_id = list(eos) or None
    gen_cfg.pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (eos[0] if eos else 0)
    if ignore_eos:
        gen_cfg.min_new_tokens = max_new
    # transformers reads the drafting settings from the assistant's own generation config (and its
    # "heuristic" schedule writes back into it): set them for this call only, then restore.
    assistant_cfg = draft_model.generation_config
    saved = copy.deepcopy(assistant_cfg)
    settings = dict(_HF_DEFAULTS)
    if spec.shape:  # k drafts per step, always: like sd:k
        settings.update(num_assistant_tokens=int(spec.shape), assistant_confidence_threshold=0.0)
    for k, v in settings.items():
        setattr(assistant_cfg, k, v)
    ids = torch.tensor([prompt_ids])
    counts = {} if counts is None else counts
    counts.setdefault("target", 0)
    counts.setdefault("draft", 0)

    def counter(role: str):
        def hook(*_):
            counts[role] += 1

        return hook

    hooks = [target_model.register_forward_hook(counter("target")), draft_model.register_forward_hook(counter("draft"))]
    torch.manual_seed(seed)
    t = time.perf_counter()
    try:
        with torch.inference_mode():
            out = target_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=gen_cfg,
                assistant_model=draft_model,
                streamer=_StepStreamer(marks),
            )
    finally:
        draft_model.generation_config = saved
        for hook in hooks:
            hook.remove()
    t_end = time.perf_counter()
    return out[0, len(prompt_ids) :].tolist(), t_end - t, settings, (t, t_end)


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


def _row(spec: Spec, temperature: float, tally: Tally, outputs: list[dict], costs: dict) -> dict:
    method = spec.method()
    is_hf = spec.name == "hf_assisted"
    calls = tally.target_calls
    be = tally.new_tokens / calls if calls else None  # hf_assisted: target forwards counted by a hook
    fwd_per_step = tally.draft_forwards / calls if calls else None
    c = costs.get("c_by_draft", {}).get(spec.draft) if spec.draft else costs.get("c")
    mbsu = None if be is None else (be / (1 + c * fwd_per_step) if c is not None else (be if method is None else None))
    steady_tokens = tally.new_tokens - sum(o["first_step_tokens"] for o in outputs)
    steady_s = sum(o["steady_s"] for o in outputs)
    acceptance = None
    if tally.tried is not None:
        acceptance = [round(a / t, 4) if t else None for a, t in zip(tally.accepted, tally.tried, strict=True)]
    return {
        "method": spec.name,
        "label": spec.label,
        "protocol": None,  # set by _placed
        "budget": None,  # fixed_nodes: the budget this row competes in
        "best": None,  # fixed_nodes: the highest block efficiency of its method within the budget
        "temperature": temperature,
        "shape": spec.shape or None,
        "draft_quantize": None,  # speculative rows: the drafter's quantisation (set in main)
        "depth": method.depth if method else (0 if spec.name == "ar" else None),
        "nodes": method.max_draft_tokens if method else (0 if spec.name == "ar" else None),
        "prompts": len(outputs),
        "new_tokens": tally.new_tokens,
        "target_calls": calls or None,
        "draft_forwards": tally.draft_forwards if calls else None,
        "draft_forwards_per_step": fwd_per_step,
        "block_efficiency": be,
        "mbsu": mbsu,
        "acceptance_by_depth": acceptance,
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


def _finish_rows(rows: list[dict]) -> None:
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


def _placed(rows: list[dict], where: dict[str, list]) -> list[dict]:
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


# ---------------------------------------------------------------- report


def _method_cell(r: dict) -> str:
    """The method, with its drafter's quantisation when it has one (e.g. "rsd_s int8")."""
    q = r.get("draft_quantize")
    return r["method"] + (f" {q}" if q and q != "none" else "")


def _fmt(v, digits=2) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown(result: dict) -> str:
    costs, prompts = result["forward_costs"], result["prompts"]
    lines = [
        f"# {result['name']}",
        "",
        f"- target `{result['models']['target']['path']}` ({result['models']['target']['params'] / 1e9:.2f}B "
        f"params), draft `{result['models']['draft']['path']}` ({result['models']['draft']['params'] / 1e9:.2f}B), "
        f"target {result['models']['target']['dtype']}"
        + (f", draft {result['models']['draft']['dtype']}" if result["models"]["draft"] else "")
        + f" on {result['models']['target']['device']}",
        f"- machine: {result['machine']['cpu_model']}, {result['machine']['cores']} cores, torch "
        f"{result['machine']['torch']} with {result['machine']['torch_threads']} threads"
        + (
            f" on cores {result['machine']['placement']['cores']}"
            if result["machine"].get("placement", {}).get("pinned")
            else ""
        )
        + f"; CPU flags {' '.join(result['machine'].get('cpu_flags', [])) or '–'}; load average "
        f"{result['machine']['loadavg_start']} at start, "
        + (
            f"{result['machine']['loadavg_end']} at end"
            if result["complete"]
            else f"{result['machine']['loadavg_now']} now"
        ),
        f"- prompts: {prompts['count']} from {prompts['source']} (seed {prompts['seed']}),"
        f" {result['settings']['max_new_tokens']} new tokens max, seeds {result['settings']['seed']}+prompt index",
        f"- single-token forward: target {costs['target_1tok_ms']:.0f} ms, draft "
        f"{_fmt(costs.get('draft_1tok_ms'), 0)} ms → c = {_fmt(costs.get('c'), 3)}; target forward by tokens: "
        + ", ".join(
            f"{k}: {v:.0f} ms" for k, v in sorted(costs["target_ms_by_tokens"].items(), key=lambda kv: int(kv[0]))
        ),
        *(
            [
                "- drafter forward by tokens (ms; c = 1-token draft / target): "
                + "; ".join(
                    f"{name}: "
                    + ", ".join(f"{n}: {v:.1f}" for n, v in sorted(by_n.items(), key=lambda kv: int(kv[0])))
                    + f" (c = {costs['c_by_draft'][name]:.3f})"
                    for name, by_n in costs["draft_ms_by_tokens"].items()
                )
            ]
            if costs.get("draft_ms_by_tokens")
            else []
        ),
        f"- {result['mbsu_formula']}",
        f"- prompt tokens {', '.join(str(i['tokens']) for i in prompts['items'])}; each generation's first step holds "
        "the prefill of both models: steady tok/s counts only the tokens and seconds after it",
        f"- wall time of the whole run: {result['wall_s']:.0f} s"
        + ("" if result["complete"] else " so far (**a snapshot: the run has not finished**)"),
        "",
        "| protocol | method | shape | T | depth | nodes | block eff. | draft fwd/step | MBSU | tok/s | vs ar "
        "| steady vs ar | draft ms/step | verify ms/step | accept ms/step | other ms/step | acceptance by depth "
        "| T=0 = ar |",
        "|" + " --- |" * 18,
    ]
    for r in result["rows"]:
        acc = "–" if r["acceptance_by_depth"] is None else " ".join(_fmt(a) for a in r["acceptance_by_depth"])
        split = r.get("step_ms") or {}
        protocol = r["protocol"] + (f" {r['budget']}" if r["budget"] else "") + (" **best**" if r["best"] else "")
        lines.append(
            f"| {protocol} | {_method_cell(r)} | {_fmt(r['shape'])} | {_fmt(r['temperature'], 1)} | "
            f"{_fmt(r['depth'])} | "
            f"{_fmt(r['nodes'])} | {_fmt(r['block_efficiency'])} | {_fmt(r['draft_forwards_per_step'])} | "
            f"{_fmt(r['mbsu'])} | {_fmt(r['tokens_per_s'], 3)} | {_fmt(r['speedup_vs_ar'])} | "
            f"{_fmt(r['steady_speedup_vs_ar'])} | "
            + " | ".join(_fmt(split.get(k), 0) for k in ("draft", "verify", "accept", "other"))
            + f" | {acc} | {_fmt(r['matches_ar'])} |"
        )
    return "\n".join([*lines, "", *summary_tables(result["rows"])]) + "\n"


def summary_tables(rows: list[dict]) -> list[str]:
    """Markdown pivots for the README: block efficiency by budget (best shape) and by depth, per T."""
    out = []
    temps = sorted({r["temperature"] for r in rows})
    for protocol, key, title in (
        ("fixed_nodes", "budget", "Block efficiency at a fixed target budget (best shape per method)"),
        ("fixed_depth", "depth", "Block efficiency at a fixed draft length"),
    ):
        chosen = [r for r in rows if r["protocol"] == protocol and (protocol != "fixed_nodes" or r["best"])]
        if not chosen:
            continue
        columns = sorted({r[key] for r in chosen})
        out += [f"### {title}", ""]
        out.append("| T | method | " + " | ".join(f"{key} {c}" for c in columns) + " |")
        out.append("|" + " --- |" * (len(columns) + 2))
        for t in temps:
            for method in METHOD_ORDER:
                cells = {r[key]: r for r in chosen if r["method"] == method and r["temperature"] == t}
                if cells:
                    values = [
                        f"{cells[c]['block_efficiency']:.2f} ({cells[c]['shape']})" if c in cells else "–"
                        for c in columns
                    ]
                    out.append(f"| {_fmt(t, 1)} | {method} | " + " | ".join(values) + " |")
        out.append("")
    speed = [r for r in rows if r["protocol"] != "fixed_depth" and r["tokens_per_s"]]
    if speed:
        out += ["### Tokens per second: the fastest shape of each method", ""]
        out += ["| T | method | shape | tok/s | vs fastest ar | steady vs ar | block eff. | MBSU |", "|" + " --- |" * 8]
        for t in temps:
            for method in METHOD_ORDER:
                cands = [r for r in speed if r["method"] == method and r["temperature"] == t]
                if cands:
                    r = max(cands, key=lambda r: r["tokens_per_s"])
                    out.append(
                        f"| {_fmt(t, 1)} | {_method_cell(r)} | {_fmt(r['shape'])} | {r['tokens_per_s']:.3f} | "
                        f"{_fmt(r['speedup_vs_ar'])} | {_fmt(r['steady_speedup_vs_ar'])} | "
                        f"{_fmt(r['block_efficiency'])} | {_fmt(r['mbsu'])} |"
                    )
        out.append("")
    return out


def plots(result: dict, out_dir: Path, name: str) -> list[Path]:
    """<name>-block-efficiency.png (vs budget and vs depth, one panel per temperature) and
    <name>-tokens-per-s.png (the fastest shape of each method, per temperature)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, paths = result["rows"], []
    temps = sorted({r["temperature"] for r in rows})
    panels = [
        (protocol, key, label)
        for protocol, key, label in (
            ("fixed_nodes", "budget", "target budget (draft tokens per tree)"),
            ("fixed_depth", "depth", "draft length (tree depth)"),
        )
        if any(r["protocol"] == protocol for r in rows)
    ]
    if not panels:  # a custom set of shapes: block efficiency against tree size
        panels = [("custom", "nodes", "draft tokens per tree")]
    fig, axes = plt.subplots(len(panels), len(temps), figsize=(4.5 * len(temps), 3.8 * len(panels)), squeeze=False)
    for (protocol, key, xlabel), ax_row in zip(panels, axes, strict=True):
        for t, ax in zip(temps, ax_row, strict=True):
            for method in METHOD_ORDER[1:-1]:
                pts = sorted(
                    (r[key], r["block_efficiency"])
                    for r in rows
                    if r["method"] == method
                    and r["temperature"] == t
                    and r["block_efficiency"] is not None
                    and (protocol == "custom" or r["protocol"] == protocol)
                    and (protocol != "fixed_nodes" or r["best"])
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=method)
            ax.set(title=f"{protocol}, T={t:g}", xlabel=xlabel, ylabel="block efficiency")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"{name}-block-efficiency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(temps), figsize=(4.5 * len(temps), 3.8), squeeze=False)
    for t, ax in zip(temps, axes[0], strict=True):
        labels, values = [], []
        for method in METHOD_ORDER:
            cands = [r for r in rows if r["method"] == method and r["temperature"] == t and r["tokens_per_s"]]
            cands = [r for r in cands if r["protocol"] != "fixed_depth"] or cands
            if cands:
                best = max(cands, key=lambda r: r["tokens_per_s"])
                labels.append(best["label"] if method != "ar" else "ar")
                values.append(best["tokens_per_s"])
        ax.bar(range(len(values)), values, color=["0.5"] + ["C0"] * (len(values) - 1))
        ax.set_xticks(range(len(values)), labels, rotation=45, ha="right", fontsize=8)
        ax.set(title=f"T={t:g}: fastest shape per method", ylabel="tokens / s")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    paths.append(out_dir / f"{name}-tokens-per-s.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------- main


def _model_info(path: Path, model, dtype: str, device: str, params: int | None = None) -> dict:
    info = {
        "path": str(path),
        "name": path.name,
        "model_type": model.config.model_type,
        "params": params or sum(p.numel() for p in model.parameters()),  # int8 layers hold no parameters
        "dtype": str(model.dtype).removeprefix("torch."),  # "auto" resolved
        "dtype_asked": dtype,
        "device": device,
    }
    marker = path / "rsd_provision.json"
    if marker.is_file():
        info["gguf_sha256"] = json.loads(marker.read_text()).get("gguf_sha256")
    return info


def _machine_info() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": _cpu_flags(),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


# The CPU features that decide what is fast here (bf16 and int8 dot products, vector width).
_NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")


def _cpu_flags() -> list[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = {f for line in info.splitlines() if line.startswith(("flags", "Features")) for f in line.split()}
    return [f for f in _NOTABLE_FLAGS if f in flags]


def parse_quantize_modes(text: str) -> list[str]:
    """ "none,int8" -> ["none", "int8"]: the drafters to compare (the first is the main one)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in QUANTIZE_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise ValueError(f"--draft-quantize: expected distinct modes from {QUANTIZE_MODES}, got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rsd bench",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[1:]),
    )
    ap.add_argument("--quick", action="store_true", help=f"preset: {QUICK_CONFIG}; 2 prompts, 24 tokens, T 0,1")
    ap.add_argument("--config", help=f"';'-separated methods, e.g. {QUICK_CONFIG!r}")
    ap.add_argument("--method", action="append", default=[], help="one method 'name[:shape]'; repeatable")
    ap.add_argument("--temperatures", default=None, help="comma-separated, e.g. 0,1 (default 0,1)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 3 with --quick, else 10")
    ap.add_argument("--prompts", type=Path, help="JSON lines with a 'prompt' field (default: stdlib functions)")
    ap.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt draw")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 32 with --quick, else 64")
    ap.add_argument("--seed", type=int, default=0, help="prompt i is generated with seed + i by every method")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    ap.add_argument("--draft", type=Path, help="draft model folder (default: the provisioned Qwen pair)")
    ap.add_argument("--target", type=Path, help="target model folder, same tokenizer as the draft")
    ap.add_argument("--cache-dir", type=Path, default=None, help="model cache for the provisioned pair")
    ap.add_argument("--device", default="cpu")
    dtypes = [*AR_DTYPES, "auto"]
    ap.add_argument("--dtype", default="float32", choices=dtypes, help="both models' dtype (auto: rsd_runtime.models)")
    ap.add_argument("--draft-dtype", choices=dtypes, help="the drafter's dtype (default: --dtype)")
    ap.add_argument("--target-dtype", choices=dtypes, help="the target's dtype (default: --dtype)")
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
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--name", default="bench", help="result file stem")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[1] / "benchmarks" / "results")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.protocol and (args.config or args.method or args.quick):
            raise ValueError("--protocol chooses the shapes itself: drop --config/--method/--quick")
        if args.config or args.method or args.quick:
            specs = (parse_config(args.config) if args.config else []) + [parse_spec(m) for m in args.method]
            specs = specs or parse_config(QUICK_CONFIG)
            where = {s.label: [("custom", None)] for s in specs}
        else:
            depths, budgets = parse_ints(args.depths, "--depths"), parse_ints(args.budgets, "--budgets")
            specs, where = plan(args.protocol or "all", depths, budgets)
        if args.small_batch_linear and any(s.name == "ar" for s in specs) and Spec("ar", "plain") not in specs:
            specs.insert(1 + [s.name for s in specs].index("ar"), Spec("ar", "plain"))  # the other ar baseline
            where["ar:plain"] = where["ar"]
        target_dtype, draft_dtype = args.target_dtype or args.dtype, args.draft_dtype or args.dtype
        from rsd_runtime.models import parse_dtype

        for dtype in args.ar_dtype:
            if parse_dtype(dtype) is parse_dtype(target_dtype, args.device):
                raise ValueError(f"--ar-dtype {dtype} is the target's own dtype: the ar row runs it already")
            if any(s.name == "ar" for s in specs) and Spec("ar", dtype) not in specs:
                specs.insert(1 + [s.name for s in specs].index("ar"), Spec("ar", dtype))
                where[f"ar:{dtype}"] = where["ar"]
        temperatures = parse_temperatures(args.temperatures or "0,1")
        quantize_modes = parse_quantize_modes(args.draft_quantize)
        draft_cost_tokens = tuple(parse_ints(args.draft_cost_tokens, "--draft-cost-tokens"))
        speculative = [s for s in specs if s.method() is not None]
        for mode in quantize_modes[1:]:  # each further drafter runs every speculative method again
            for spec in speculative:
                variant = Spec(spec.name, spec.shape, mode)
                specs.append(variant)
                where[variant.label] = where.get(spec.label, [("custom", None)])
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    num_prompts = args.num_prompts or (2 if args.quick else 10)
    max_new = args.max_new_tokens or (24 if args.quick else 64)
    if len({s.label for s in specs}) != len(specs):
        raise SystemExit("error: a method is listed twice")

    from transformers.utils import logging as hf_logging

    from rsd.sampling import SamplingParams
    from rsd_runtime.generator import SpeculativeGenerator
    from rsd_runtime.models import (
        load_model,
        load_tokenizer,
        prune_draft_vocab,
        quantize_draft,
        set_small_batch_rows,
        use_small_batch_linear,
    )
    from rsd_runtime.runner import ModelRunner
    from rsd_service.placement import apply_placement

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        placement = apply_placement(args.cores, args.threads)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    t_start = time.perf_counter()
    machine = {**_machine_info(), "placement": placement.as_dict()}

    if args.prompts:
        prompts = file_prompts(args.prompts, args.num_prompts, args.prompt_seed)
        source = str(args.prompts)
    else:
        prompts = stdlib_prompts(num_prompts, args.prompt_seed)
        source = f"python {platform.python_version()} standard library ({len(STDLIB_MODULES)} modules)"

    if args.draft and args.target:
        draft_dir, target_dir = args.draft, args.target
        for flag, path in (("--draft", draft_dir), ("--target", target_dir)):
            if not (path / "config.json").is_file():
                raise SystemExit(f"error: {flag} {path} is not a model folder (no config.json)")
    elif args.draft or args.target:
        raise SystemExit("error: give both --draft and --target, or neither")
    else:
        from rsd_tools.provision import provision_pair

        paths = provision_pair(args.cache_dir)
        draft_dir, target_dir = paths["draft"], paths["target"]

    log(f"loading target {target_dir} ({target_dtype}) and draft {draft_dir} ({draft_dtype}) on {args.device}")
    tokenizer = load_tokenizer(target_dir)
    target_model = load_model(target_dir, args.device, target_dtype)
    needs_draft = any(s.name != "ar" for s in specs) or args.costs_only
    draft_models, quantized, draft_params = {}, {}, None  # by --draft-quantize mode (the first: draft_model)
    for mode in quantize_modes if needs_draft else []:
        model = load_model(draft_dir, args.device, draft_dtype)
        draft_params = sum(p.numel() for p in model.parameters())
        try:  # prune, then quantise, then (below) small-batch linear: rsd_runtime.models.quantize_draft
            prune_draft_vocab(model, args.draft_vocab)
            quantized[mode] = quantize_draft(model, mode, draft_dtype)
        except ValueError as e:
            raise SystemExit(f"error: --draft-quantize {mode}: {e}") from None
        log(f"drafter --draft-quantize {mode}: {quantized[mode]}")
        draft_models[mode] = model
    draft_model = draft_models.get(quantize_modes[0])
    # the target again in other dtypes, for the ar:DTYPE baselines
    other_targets = {s.shape: load_model(target_dir, args.device, s.shape) for s in specs if s.shape in AR_DTYPES}
    if args.small_batch_linear:
        for model in (target_model, *draft_models.values(), *other_targets.values()):
            if model is not None:
                use_small_batch_linear(model, args.small_batch_linear)
    encoded = [tokenizer.encode(p["prompt"]) for p in prompts]
    if any(not ids for ids in encoded):
        raise SystemExit("error: a prompt encodes to no tokens")
    eos: tuple[int, ...] = ()
    if not args.ignore_eos:
        cfg_eos = target_model.generation_config.eos_token_id
        cfg_eos = cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]
        eos = tuple(sorted({i for i in [tokenizer.eos_token_id, *cfg_eos] if i is not None}))
    methods = {s.label: s.method() for s in specs}
    max_nodes = max([m.max_draft_tokens for m in methods.values() if m is not None] + [0])
    max_len = max(len(ids) for ids in encoded) + max_new + 2 * max_nodes + 16
    target = ModelRunner(target_model, max_len)
    draft = ModelRunner(draft_model, max_len) if draft_model is not None else None
    gen = SpeculativeGenerator(target, draft)
    variant_runners = {m: ModelRunner(draft_models[m], max_len) for m in quantize_modes[1:] if m in draft_models}
    variant_gens = {m: SpeculativeGenerator(target, r) for m, r in variant_runners.items()}
    other_gens = {d: SpeculativeGenerator(ModelRunner(m, max_len), None) for d, m in other_targets.items()}

    tree_sizes = [m.max_draft_tokens + 1 for m in methods.values() if m is not None] if args.tree_costs else []
    log("timing single-token forwards" + (" and trees" if tree_sizes else ""))
    drafts_timed = {quantize_modes[0]: draft, **variant_runners} if draft is not None else {}
    costs = forward_costs(target, draft, encoded[0], tree_sizes, args.cost_reps, drafts_timed, draft_cost_tokens)
    log(f"forward costs: {json.dumps({k: v for k, v in costs.items() if k != 'target_ms_by_tokens'})}")
    marks_by_draft = {"": _instrument(gen), **{m: _instrument(g) for m, g in variant_gens.items()}}

    tallies = {(s.label, t): Tally() for t in temperatures for s in specs}
    outputs = {key: [] for key in tallies}
    hf_settings = {}
    json_path, md_path = args.out_dir / f"{args.name}.json", args.out_dir / f"{args.name}.md"

    def write(complete: bool) -> dict:
        """Write the JSON and the markdown of every (method, temperature) run so far."""
        rows = [
            _row(s, t, tallies[(s.label, t)], outputs[(s.label, t)], costs)
            for t in temperatures
            for s in specs
            if outputs[(s.label, t)]
        ]
        for row in rows:
            if row["label"] in hf_settings:
                row["hf_settings"] = hf_settings[row["label"]]
        for row, spec in zip(rows, [s for t in temperatures for s in specs if outputs[(s.label, t)]], strict=True):
            if spec.method() is not None:
                row["draft_quantize"] = quantized.get(spec.draft or quantize_modes[0])
        _finish_rows(rows)
        rows = _placed(rows, where)
        machine["loadavg_end" if complete else "loadavg_now"] = [round(x, 2) for x in os.getloadavg()]
        if complete:
            machine.pop("loadavg_now", None)
        result = {
            "name": args.name,
            "models": {
                "target": _model_info(Path(target_dir), target_model, target_dtype, args.device),
                "draft": {
                    **_model_info(Path(draft_dir), draft_model, draft_dtype, args.device, draft_params),
                    "quantize": quantized[quantize_modes[0]],
                    "quantize_variants": {m: quantized[m] for m in quantize_modes[1:]},
                }
                if draft_model
                else None,
            },
            "machine": machine,
            "prompts": {
                "source": source,
                "count": len(prompts),
                "seed": args.prompt_seed,
                "sha256": hashlib.sha256(json.dumps([p["prompt"] for p in prompts]).encode()).hexdigest(),
                "items": [
                    {"id": p["id"], "chars": len(p["prompt"]), "tokens": len(ids)}
                    for p, ids in zip(prompts, encoded, strict=True)
                ],
            },
            "settings": {
                "methods": [s.label for s in specs],
                "temperatures": temperatures,
                "protocol": args.protocol or ("custom" if args.config or args.method or args.quick else "all"),
                "budget_candidates": BUDGET_CANDIDATES,
                "small_batch_linear_rows": args.small_batch_linear,
                "draft_vocab": args.draft_vocab or None,
                "draft_quantize": {m: quantized.get(m) for m in quantize_modes},  # asked -> applied
                "placement": placement.as_dict(),
                "max_new_tokens": max_new,
                "seed": args.seed,
                "eos_token_ids": list(eos),
                "order": "for each prompt, for each temperature, every method in turn",
            },
            "mbsu_formula": MBSU_FORMULA,
            "forward_costs": costs,
            "rows": rows,
            "wall_s": time.perf_counter() - t_start,
            "complete": complete,  # false: a snapshot written while the run goes on
        }
        args.out_dir.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
        md_path.write_text(markdown(result))
        return result

    if args.costs_only:
        result = write(complete=True)
        log(f"wrote {json_path} and {md_path} (forward costs only)")
        print(markdown(result))
        return 0
    for i, ids in enumerate(encoded):
        seed = args.seed + i
        for temperature in temperatures:
            params = SamplingParams(temperature=temperature)
            for spec in specs:
                tally, key = tallies[(spec.label, temperature)], (spec.label, temperature)
                step_marks = marks_by_draft.get(spec.draft, marks_by_draft[""])
                step_marks.clear()
                if spec.name == "hf_assisted":
                    counts: dict[str, int] = {}
                    new, wall, hf_settings[spec.label], (t0, t_end) = run_hf_assisted(
                        target_model,
                        draft_model,
                        ids,
                        spec,
                        temperature,
                        max_new,
                        eos,
                        seed,
                        args.ignore_eos,
                        step_marks,
                        counts,
                    )
                    tally.new_tokens += len(new)
                    tally.total_s += wall
                    calls = counts["target"]
                    tally.target_calls += calls
                    tally.draft_forwards += counts["draft"]
                else:
                    if spec.shape == "plain":
                        set_small_batch_rows(target_model, 0)
                    t0 = time.perf_counter()
                    try:
                        res = (variant_gens[spec.draft] if spec.draft else other_gens.get(spec.shape, gen)).generate(
                            ids, methods[spec.label], params, max_new, eos, seed
                        )
                    finally:
                        t_end = time.perf_counter()
                        if spec.shape == "plain":
                            set_small_batch_rows(target_model, args.small_batch_linear)
                    s, new, wall, calls = res.stats, res.token_ids, res.stats.total_s, res.stats.target_calls
                    tally.new_tokens += s.new_tokens
                    tally.target_calls += s.target_calls
                    tally.draft_forwards += s.draft_forwards
                    tally.draft_s += s.draft_s
                    tally.verify_s += s.verify_s
                    tally.accept_s += s.accept_s
                    tally.total_s += s.total_s
                    if s.tried_by_depth:
                        if tally.tried is None:
                            tally.accepted, tally.tried = [0] * len(s.tried_by_depth), [0] * len(s.tried_by_depth)
                        tally.accepted = [a + b for a, b in zip(tally.accepted, s.accepted_by_depth, strict=True)]
                        tally.tried = [a + b for a, b in zip(tally.tried, s.tried_by_depth, strict=True)]
                outputs[key].append(
                    {
                        "prompt": i,
                        "seed": seed,
                        "new_tokens": len(new),
                        "target_calls": calls,
                        "total_s": wall,
                        "first_step_s": step_marks[0][0] - t0 if step_marks else wall,
                        "first_step_tokens": min(step_marks[0][1], len(new)) if step_marks else len(new),
                        "steady_s": t_end - step_marks[0][0] if step_marks else 0.0,
                        "token_sha": _token_hash(new),
                        "token_ids": new,
                    }
                )
                be = f", block eff. {len(new) / calls:.2f}" if calls else ""
                log(f"T={temperature} prompt {i} {spec.label}: {len(new)} tokens in {wall:.1f} s{be}")
            write(complete=False)  # a snapshot after every (prompt, T): a stopped run keeps its results
    result = write(complete=True)
    log(f"wrote {json_path} and {md_path} in {result['wall_s']:.0f} s")
    if not args.no_plots:
        for path in plots(result, args.out_dir, args.name):
            log(f"wrote {path}")
    print(markdown(result))
    return 0


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

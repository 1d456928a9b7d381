"""One benchmark run (imported by rsd_bench.methods.cli once the flags are checked: torch and transformers
load here): the models loaded once, every generation interleaved (for each prompt, for each
temperature, every spec in turn), and the result files rewritten after every (prompt, temperature)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rsd.sampling import SamplingParams
from rsd_bench.machine import model_info, run_record
from rsd_bench.methods.hf_assisted import run_hf_assisted
from rsd_bench.methods.planning import AR_DTYPES, BUDGET_CANDIDATES, Plan, Spec
from rsd_bench.methods.report import markdown
from rsd_bench.methods.timing import (
    MBSU_FORMULA,
    Tally,
    finish_rows,
    forward_costs,
    instrument_steps,
    make_row,
    place_rows,
    token_hash,
)
from rsd_bench.stats import step_tokens
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.linear import set_small_batch_rows, use_small_batch_linear
from rsd_runtime.models import load_model, prepare_draft
from rsd_runtime.runner import ModelRunner
from rsd_runtime.tokenizer import load_tokenizer


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Models:
    """The loaded models: the target, one drafter per --draft-quantize mode, the target again per ar:DTYPE."""

    draft_dir: Path
    target_dir: Path
    tokenizer: Any
    target_model: Any
    draft_models: dict[str, Any]  # by quantize mode, in the plan's order (none without a speculative method)
    quantized: dict[str, str]  # quantize mode asked -> applied
    draft_params: int | None  # counted before quantising (int8 layers hold no parameters)
    other_targets: dict[str, Any]  # dtype -> the target loaded in it (ar:DTYPE)


def load_models(args: argparse.Namespace, plan: Plan, draft_dir: Path, target_dir: Path) -> Models:
    tokenizer = load_tokenizer(target_dir)
    try:
        target_model = load_model(target_dir, args.device, plan.target_dtype, numeric=args.target_numeric)
    except ValueError as e:
        raise SystemExit(f"error: --target-numeric {args.target_numeric}: {e}") from None
    needs_draft = any(s.name != "ar" for s in plan.specs) or args.costs_only
    draft_models, quantized, draft_params = {}, {}, None
    for mode in plan.quantize_modes if needs_draft else []:
        try:
            model = load_model(draft_dir, args.device, plan.draft_dtype, numeric=args.draft_numeric)
        except ValueError as e:
            raise SystemExit(f"error: --draft-numeric {args.draft_numeric}: {e}") from None
        draft_params = sum(p.numel() for p in model.parameters())
        try:  # prune, quantise, lean forward: rsd_runtime.models.prepare_draft
            quantized[mode] = prepare_draft(model, args.draft_vocab, mode, plan.draft_dtype)
        except ValueError as e:
            raise SystemExit(f"error: --draft-quantize {mode}: {e}") from None
        log(f"drafter --draft-quantize {mode}: {quantized[mode]}")
        draft_models[mode] = model
    other_targets = {s.shape: load_model(target_dir, args.device, s.shape) for s in plan.specs if s.shape in AR_DTYPES}
    if args.small_batch_linear:
        for model in (target_model, *draft_models.values(), *other_targets.values()):
            use_small_batch_linear(model, args.small_batch_linear)
    return Models(draft_dir, target_dir, tokenizer, target_model, draft_models, quantized, draft_params, other_targets)


def eos_ids(args: argparse.Namespace, models: Models) -> tuple[int, ...]:
    """The tokenizer's and the generation config's EOS ids; none with --ignore-eos."""
    if args.ignore_eos:
        return ()
    cfg_eos = models.target_model.generation_config.eos_token_id
    cfg_eos = cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]
    return tuple(sorted({i for i in [models.tokenizer.eos_token_id, *cfg_eos] if i is not None}))


class BenchRun:
    """Every generation of a Plan on loaded Models, their tallies, and the result files."""

    def __init__(self, args, plan: Plan, models: Models, prompts, source: str, machine: dict, placement, t_start):
        self.args, self.plan, self.models, self.prompts, self.source = args, plan, models, prompts, source
        self.machine, self.placement, self.t_start = machine, placement, t_start
        self.record = run_record("methods")  # once: the result is rewritten after every prompt
        self.encoded = [models.tokenizer.encode(p["prompt"]) for p in prompts]
        if any(not ids for ids in self.encoded):
            raise SystemExit("error: a prompt encodes to no tokens")
        self.eos = eos_ids(args, models)
        self.methods = {s.label: s.method() for s in plan.specs}
        max_nodes = max([m.max_draft_tokens for m in self.methods.values() if m is not None] + [0])
        max_len = max(len(ids) for ids in self.encoded) + plan.max_new_tokens + 2 * max_nodes + 16
        self.draft_model = models.draft_models.get(plan.quantize_modes[0])
        target = ModelRunner(models.target_model, max_len)
        draft = ModelRunner(self.draft_model, max_len) if self.draft_model is not None else None
        self.gen = SpeculativeGenerator(target, draft)
        variant_runners = {
            m: ModelRunner(models.draft_models[m], max_len) for m in plan.quantize_modes[1:] if m in models.draft_models
        }
        self.variant_gens = {m: SpeculativeGenerator(target, r) for m, r in variant_runners.items()}
        self.other_gens = {
            d: SpeculativeGenerator(ModelRunner(m, max_len), None) for d, m in models.other_targets.items()
        }

        methods = self.methods.values()
        tree_sizes = [m.max_draft_tokens + 1 for m in methods if m is not None] if args.tree_costs else []
        log("timing single-token forwards" + (" and trees" if tree_sizes else ""))
        drafts_timed = {plan.quantize_modes[0]: draft, **variant_runners} if draft is not None else {}
        self.costs = forward_costs(
            target, draft, self.encoded[0], tree_sizes, args.cost_reps, drafts_timed, plan.draft_cost_tokens
        )
        log(f"forward costs: {json.dumps({k: v for k, v in self.costs.items() if k != 'target_ms_by_tokens'})}")
        self.marks_by_draft = {"": instrument_steps(self.gen)}
        self.marks_by_draft.update({m: instrument_steps(g) for m, g in self.variant_gens.items()})

        self.tallies = {(s.label, t): Tally() for t in plan.temperatures for s in plan.specs}
        self.outputs: dict[tuple[str, float], list[dict]] = {key: [] for key in self.tallies}
        self.hf_settings: dict[str, dict] = {}
        self.json_path, self.md_path = args.out_dir / f"{args.name}.json", args.out_dir / f"{args.name}.md"

    def generate_all(self) -> None:
        """For each prompt, for each temperature, every spec in turn; a snapshot after each (prompt, T),
        so that a stopped run keeps its results."""
        for i, ids in enumerate(self.encoded):
            for temperature in self.plan.temperatures:
                for spec in self.plan.specs:
                    self.generate_one(spec, i, ids, temperature)
                self.write(complete=False)

    def generate_one(self, spec: Spec, i: int, ids: list[int], temperature: float) -> None:
        """Prompt i at `temperature` with `spec`: added to its tally and outputs."""
        args, seed, max_new = self.args, self.args.seed + i, self.plan.max_new_tokens
        tally = self.tallies[(spec.label, temperature)]
        step_marks = self.marks_by_draft.get(spec.draft, self.marks_by_draft[""])
        step_marks.clear()
        if spec.name == "hf_assisted":
            counts: dict[str, int] = {}
            new, wall, self.hf_settings[spec.label], (t0, t_end) = run_hf_assisted(
                self.models.target_model,
                self.draft_model,
                ids,
                spec,
                temperature,
                max_new,
                self.eos,
                seed,
                args.ignore_eos,
                step_marks,
                counts,
            )
            tally.add_counted(len(new), wall, counts)
            calls = counts["target"]
        else:
            gen = self.variant_gens[spec.draft] if spec.draft else self.other_gens.get(spec.shape, self.gen)
            if spec.shape == "plain":
                set_small_batch_rows(self.models.target_model, 0)
            t0 = time.perf_counter()
            try:
                params, verification = SamplingParams(temperature=temperature), self.plan.verification
                res = gen.generate(ids, self.methods[spec.label], params, max_new, self.eos, seed, verification)
            finally:
                t_end = time.perf_counter()
                if spec.shape == "plain":
                    set_small_batch_rows(self.models.target_model, args.small_batch_linear)
            new, wall, calls = res.token_ids, res.stats.total_s, res.stats.target_calls
            tally.add(res.stats)
        marks = [n for _, n in step_marks]
        self.outputs[(spec.label, temperature)].append(
            {
                "prompt": i,
                "seed": seed,
                "new_tokens": len(new),
                "target_calls": calls,
                "total_s": wall,
                "first_step_s": step_marks[0][0] - t0 if step_marks else wall,
                "first_step_tokens": min(step_marks[0][1], len(new)) if step_marks else len(new),
                "steady_s": t_end - step_marks[0][0] if step_marks else 0.0,
                "token_sha": token_hash(new),
                # tokens per target call (the bootstrap's unit); None where the steps were not all seen
                "step_tokens": step_tokens(marks, len(new)) if len(marks) == calls else None,
                "token_ids": new,
            }
        )
        be = f", block eff. {len(new) / calls:.2f}" if calls else ""
        log(f"T={temperature} prompt {i} {spec.label}: {len(new)} tokens in {wall:.1f} s{be}")

    def rows(self) -> list[dict]:
        """One row per (spec, temperature) run so far, per place it is reported at."""
        plan, quantized = self.plan, self.models.quantized
        ran = [(s, t) for t in plan.temperatures for s in plan.specs if self.outputs[(s.label, t)]]
        resamples = self.args.bootstrap
        rows = [
            make_row(s, t, self.tallies[(s.label, t)], self.outputs[(s.label, t)], self.costs, resamples)
            for s, t in ran
        ]
        for row in rows:
            if row["label"] in self.hf_settings:
                row["hf_settings"] = self.hf_settings[row["label"]]
        for row, (spec, _) in zip(rows, ran, strict=True):
            if spec.method() is not None:
                row["draft_quantize"] = quantized.get(spec.draft or plan.quantize_modes[0])
                row["verification"] = plan.verification
        finish_rows(rows)
        return place_rows(rows, plan.where)

    def result(self, complete: bool) -> dict:
        """The JSON result of every (method, temperature) run so far."""
        args, plan, models, modes = self.args, self.plan, self.models, self.plan.quantize_modes
        rows = self.rows()
        self.machine["loadavg_end" if complete else "loadavg_now"] = [round(x, 2) for x in os.getloadavg()]
        if complete:
            self.machine.pop("loadavg_now", None)
        draft = None
        if self.draft_model:
            draft = {
                **model_info(
                    Path(models.draft_dir), self.draft_model, plan.draft_dtype, args.device, models.draft_params
                ),
                "quantize": models.quantized[modes[0]],
                "quantize_variants": {m: models.quantized[m] for m in modes[1:]},
            }
        return {
            **self.record,
            "name": args.name,
            "models": {
                "target": model_info(Path(models.target_dir), models.target_model, plan.target_dtype, args.device),
                "draft": draft,
            },
            "machine": self.machine,
            "prompts": {
                "source": self.source,
                "count": len(self.prompts),
                "seed": args.prompt_seed,
                "sha256": hashlib.sha256(json.dumps([p["prompt"] for p in self.prompts]).encode()).hexdigest(),
                "items": [
                    {"id": p["id"], "chars": len(p["prompt"]), "tokens": len(ids)}
                    for p, ids in zip(self.prompts, self.encoded, strict=True)
                ],
            },
            "settings": {
                "methods": [s.label for s in plan.specs],
                "temperatures": plan.temperatures,
                "protocol": args.protocol or ("custom" if args.config or args.method or args.quick else "all"),
                "budget_candidates": BUDGET_CANDIDATES,
                "small_batch_linear_rows": args.small_batch_linear,
                "draft_vocab": args.draft_vocab or None,
                "draft_quantize": {m: models.quantized.get(m) for m in modes},  # asked -> applied
                "placement": self.placement.as_dict(),
                "max_new_tokens": plan.max_new_tokens,
                "seed": args.seed,
                "bootstrap_resamples": args.bootstrap,
                "eos_token_ids": list(self.eos),
                "order": "for each prompt, for each temperature, every method in turn",
            },
            "mbsu_formula": MBSU_FORMULA,
            "forward_costs": self.costs,
            "rows": rows,
            "wall_s": time.perf_counter() - self.t_start,
            "complete": complete,  # false: a snapshot written while the run goes on
        }

    def write(self, complete: bool) -> dict:
        """Write the JSON and the markdown of every (method, temperature) run so far; returns the result."""
        result = self.result(complete)
        self.args.out_dir.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(result, indent=1) + "\n")
        self.md_path.write_text(markdown(result))
        return result

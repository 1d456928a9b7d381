"""benchmarks/results/INDEX.md from the result files: the current run of each benchmark per machine class.

    rsd bench index              # rewrite INDEX.md
    rsd bench index --archive    # first move each superseded run to archive/, then rewrite INDEX.md
    rsd bench index --check      # exit 1 if INDEX.md or the folder is not as this module writes and wants it

A run is <name>.json with <name>.md and its plots (<name>-tokens-per-s.png, <name>-block-efficiency.png)
beside it. The json's first keys say which benchmark ran, when, and on what code (rsd_bench.machine.run_record);
its machine record gives the machine class. A run is superseded by a later run of the same benchmark on the
same machine class. A <name>.md without a json is a report (exactness, architectures, ...): listed, undated.
The headline is read from the rows as recorded; a figure a result does not hold is "-", never estimated.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rsd_bench.cli import BENCHMARKS
from rsd_tools.defaults import RESULTS_DIR

INDEX = "INDEX.md"
ARCHIVE = "archive"
PLOTS = ("-tokens-per-s.png", "-block-efficiency.png")


@dataclass(frozen=True)
class Run:
    name: str  # the file stem
    benchmark: str
    machine: str
    date: str  # ISO 8601, UTC
    commit: str
    dated_from_git: bool  # recorded after the run: the commit that added the file (see run_record)
    headline: str
    files: tuple[str, ...]


def machine_class(record: dict) -> str:
    """The machine class of a result, from its machine record: the GPU's name, or the CPU's vendor line and
    its widest matrix/vector feature (the kernels the project picks follow these flags)."""
    machine = record.get("machine") or record.get("host") or record.get("setup", {}).get("cpu") or {}
    if not isinstance(machine, dict):
        return "-"
    if machine.get("device_name"):
        return f"GPU: {machine['device_name']}"
    model = " ".join(w for w in str(machine.get("cpu_model", "")).replace("(R)", "").split() if w != "Processor")
    flags = machine.get("cpu_flags")
    if flags is None:
        return f"{model}, CPU flags not recorded" if model else "CPU not recorded"
    tiers = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2"))
    feature = next((name for flag, name in tiers if flag in flags), "no AVX2")
    return f"{model or 'CPU'}, {feature}"


def _best(rows: list[dict], key: str) -> dict:
    return max((r for r in rows if isinstance(r.get(key), (int, float))), key=lambda r: r[key])


def _methods(r: dict) -> str:
    rows = [row for row in r["rows"] if row.get("method") != "ar"]
    if any(isinstance(row.get("speedup_vs_ar"), (int, float)) for row in rows):
        best = _best(rows, "speedup_vs_ar")
        return f"{best['speedup_vs_ar']:.2f}x the target alone: {best['label']}, T={best['temperature']:g}"
    best = _best(rows, "block_efficiency")  # a run without the target alone (--only)
    return f"block efficiency {best['block_efficiency']:.2f}: {best['label']}, T={best['temperature']:g} (no ar row)"


def _disaggregated(r: dict) -> str:
    best = _best(r["rows"], "speedup_vs_ar_whole_machine")
    how = f"{best['method']} {best['shape']}" + (", pre-drafting" if best.get("pipelined") else "")
    speedup = best["speedup_vs_ar_whole_machine"]
    return f"{speedup:.2f}x the target alone on the whole machine: {how}, T={best['temperature']:g}"


def _net(r: dict) -> str:
    best = _best([row for row in r["rows"] if row["pipelined"] and not row.get("adaptive")], "speedup_vs_plain")
    text = (
        f"pre-drafting {best['speedup_vs_plain']:.2f}x plain at {best['delay_ms']:g} ms one way: "
        f"{best['method']} {best['shape']}, T={best['temperature']:g}"
    )
    adaptive = [row for row in r["rows"] if row.get("adaptive")]
    if adaptive:
        top = _best(adaptive, "speedup_vs_best_fixed")
        text += f"; adaptive shapes {top['speedup_vs_best_fixed']:.2f}x the best fixed at {top['delay_ms']:g} ms"
    return text


def _capacity(r: dict) -> str:
    best = _best(r["rows"], "tokens_per_s_per_verifier")
    c, sim = r["clients_at_rate"], r["simulator"]["rows"]
    worst = {k: max(abs(x[k]) for x in sim) for k in ("error", "error_own_draft")}
    return (
        f"{best['speedup_vs_ar']:.2f}x the target alone's tokens/s per verifier at N={best['clients']}; clients at "
        f"{c['rate']:.2f} tok/s {'>= ' if c.get('at_least') else ''}{c['measured']} vs {c['target_alone']}; "
        f"simulator within {100 * worst['error']:.0f} % ({100 * worst['error_own_draft']:.0f} % with each N's draft ms)"
    )


def _simulate(r: dict) -> str:
    s, sizing = r["settings"], r["sizing"]
    check = r.get("check") or []
    worst = (
        f"; model vs measured within {100 * max(abs(c['error']) for c in check):.0f} % "
        f"({100 * max(abs(c['error_own_verify']) for c in check):.0f} % with each row's own verify ms)"
        if check
        else ""
    )
    return f"{sizing['replicas']} verifier replica(s) for {s['sessions']} sessions at {s['one_way_ms']:g} ms{worst}"


def _vs_llamacpp(r: dict) -> str:
    best = _best([row for row in r["rows"] if row["system"] == "rsd"], "vs_llamacpp_target")
    llama = _best([row for row in r["rows"] if row["system"] == "llama.cpp"], "vs_llamacpp_target")
    return (
        f"rsd {best['vs_llamacpp_target']:.2f}x llama.cpp's target alone ({best['method']} {best['shape']}, "
        f"T={best['temperature']:g}); llama.cpp's best {llama['vs_llamacpp_target']:.2f}x"
    )


def _services(r: dict) -> str:
    if r.get("capacity"):
        best = _best(r["capacity"], "speedup_vs_1")
        sessions, temperature = best["sessions"], best["temperature"]
        return f"{best['speedup_vs_1']:.2f}x one session's tokens/s at {sessions} sessions, T={temperature:g}"
    ratios = [o["ratio"] for o in r["overhead"]]
    return f"through the services {min(ratios):.2f}-{max(ratios):.2f}x the in-process tokens/s"


def _forward_cost(r: dict) -> str:
    one = min((row for row in r["rows"] if row["tokens"] == 1), key=lambda row: row["ms"])
    rows = [row for row in r["rows"] if row["kernel"] == one["kernel"]]
    most = max(rows, key=lambda row: row["tokens"])
    return f"{one['kernel']} ({r['dtype']}): {most['tokens']} tokens cost {most['ratio_to_1_token']:.2f}x one token"


def _prefill_cost(r: dict) -> str:
    saved = [row["saved"] for row in r["rows"]]
    lengths = [row["prompt_tokens"] for row in r["rows"]]
    return f"tree-only logits save {min(saved):.0%}-{max(saved):.0%} ({min(lengths)}-{max(lengths)} prompt tokens)"


def _draft_batching(r: dict) -> str:
    best = _best([row for row in r["rows"] if row.get("packed")], "vs_alone_same_sessions")
    return f"packed {best['vs_alone_same_sessions']:.2f}x drafting alone at {best['sessions']} sessions"


def _predraft_coverage(r: dict) -> str:
    first = [c["hit_rate_at_k"]["1"] for c in r["coverage"]]
    k = max((k for c in r["coverage"] for k in c["hit_rate_at_k"]), key=int)
    last = [c["hit_rate_at_k"][k] for c in r["coverage"]]
    return f"hit rate at k=1 {min(first):.0%}-{max(first):.0%}, at k={k} {min(last):.0%}-{max(last):.0%}"


def _loadtest(r: dict) -> str:
    errors = sum(r["errors"].values())
    return (
        f"{r['throughput_tok_s']:g} tok/s, {r['clients']} clients, {errors} errors, TTFT p50 {r['ttft_ms']['p50']:g} ms"
    )


def _gpu_check(r: dict) -> str:
    tests = r.get("tests") or {}
    parts = [f"tests {tests['passed']} passed, {tests['failures'] + tests['errors']} failed"] if tests else []
    for dtype, d in r["dtypes"].items():
        rows = d["generation"]
        most = d["forward_cost"]["target"][-1]
        matches = [g["matches_ar"] for g in rows if "matches_ar" in g]
        equal = [g["equals_plain"] for g in rows if "equals_plain" in g]
        parts.append(
            f"{dtype}: {most['nodes']}-node tree {most['ratio_to_1']:.2f}x one node, T=0 = target alone "
            f"{sum(matches)}/{len(matches)}, pipelined = plain {sum(equal)}/{len(equal)}"
        )
    return "; ".join(parts)


def _rule_gap(r: dict) -> str:
    def mean_gap(verification: str) -> float:
        gaps = [row["gap"] for row in r["rows"] if row["verification"] == verification]
        return sum(gaps) / len(gaps)

    return (
        f"mean gap to the optimal acceptance: traversal {mean_gap('traversal'):.3f}, token rules "
        f"{mean_gap('token'):.3f} tokens/step (toy laws)"
    )


def _rule_replay(r: dict) -> str:
    top = max(row["temperature"] for row in r["rows"])
    gains = [row for row in r["rows"] if row["temperature"] == top and row["verification"] != "token"]
    best = {}
    for row in gains:  # each method's best other rule
        if row["method"] not in best or row["vs_token"] > best[row["method"]]["vs_token"]:
            best[row["method"]] = row
    return f"T = {top:g}, best rule vs token (coupled: its own run): " + ", ".join(
        f"{m} {row['verification']} {row['vs_token_pct']:+.1f} %" for m, row in best.items()
    )


HEADLINES: dict[str, Callable[[dict], str]] = {
    "methods": _methods,
    "disaggregated": _disaggregated,
    "net": _net,
    "capacity": _capacity,
    "simulate": _simulate,
    "vs_llamacpp": _vs_llamacpp,
    "services": _services,
    "forward_cost": _forward_cost,
    "prefill_cost": _prefill_cost,
    "draft_batching": _draft_batching,
    "predraft_coverage": _predraft_coverage,
    "loadtest": _loadtest,
    "gpu_check": _gpu_check,
    "rule_gap": _rule_gap,
    "rule_replay": _rule_replay,
}


def headline(record: dict) -> str:
    try:
        text = HEADLINES[record["benchmark"]](record)
    except (KeyError, TypeError, ValueError):  # a result without the figure (costs only, an older schema)
        return "-"
    return text + (" (incomplete run)" if record.get("complete") is False else "")


def files_of(folder: Path, name: str) -> tuple[str, ...]:
    candidates = [f"{name}.json", f"{name}.md", *(name + suffix for suffix in PLOTS)]
    return tuple(f for f in candidates if (folder / f).is_file())


def read_runs(folder: Path) -> list[Run]:
    runs = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        runs.append(
            Run(
                name=path.stem,
                benchmark=record.get("benchmark", "-"),
                machine=machine_class(record),
                date=record.get("date", "-"),
                commit=record.get("commit", "-"),
                dated_from_git="dated_from" in record,
                headline=headline(record),
                files=files_of(folder, path.stem),
            )
        )
    return runs


def reports(folder: Path) -> list[str]:
    """The .md files that belong to no run: reports written by hand or by a command without a json."""
    return sorted(p.name for p in folder.glob("*.md") if p.name != INDEX and not (folder / f"{p.stem}.json").exists())


def superseded(runs: list[Run]) -> list[Run]:
    """Every run but the latest of its (benchmark, machine class); ValueError where two tie for the latest."""
    out = []
    for key in {(r.benchmark, r.machine) for r in runs}:
        group = sorted((r for r in runs if (r.benchmark, r.machine) == key), key=lambda r: r.date)
        if len(group) > 1 and group[-1].date == group[-2].date:
            tied = [r.name for r in group if r.date == group[-1].date]
            raise ValueError(f"{key}: {tied} share the latest date; move all but one to {ARCHIVE}/ by hand")
        out += group[:-1]
    return sorted(out, key=lambda r: r.name)


def problems(folder: Path) -> list[str]:
    """What keeps the folder from being an index's: runs without their .md, stray files, a superseded run."""
    runs = read_runs(folder)
    out = [f"{r.name}.json has no {r.name}.md" for r in runs if f"{r.name}.md" not in r.files]
    out += [f"{r.name}.json records no benchmark" for r in runs if r.benchmark == "-"]
    known = {f for r in runs for f in r.files} | set(reports(folder)) | {INDEX}
    out += [f"{p.name}: belongs to no run" for p in sorted(folder.iterdir()) if p.is_file() and p.name not in known]
    try:
        out += [f"{r.name} is superseded: rsd bench index --archive" for r in superseded(runs)]
    except ValueError as e:
        out.append(str(e))
    return out


def _order(r: Run) -> tuple:
    names = list(BENCHMARKS)
    return (names.index(r.benchmark) if r.benchmark in names else len(names), r.benchmark, r.machine, r.date)


def _table(runs: list[Run], prefix: str) -> list[str]:
    lines = ["| benchmark | machine | date | commit | headline | files |", "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        date = r.date[:10] + ("*" if r.dated_from_git else "")
        links = " ".join(f"[{f.removeprefix(r.name).lstrip('-.').removesuffix('.png')}]({prefix}{f})" for f in r.files)
        lines.append(f"| {r.benchmark} | {r.machine} | {date} | {r.commit[:7]} | {r.headline} | {links} |")
    return lines


def render(folder: Path) -> str:
    current = sorted(read_runs(folder), key=_order)
    archived = sorted(read_runs(folder / ARCHIVE), key=_order) if (folder / ARCHIVE).is_dir() else []
    lines = [
        "# Benchmark results",
        "",
        f"Written by `rsd bench index` (rsd_bench/index.py) from the result files; do not edit. Current: the latest "
        f"run of each benchmark per machine class. Superseded runs and A/B variants are in [{ARCHIVE}/]({ARCHIVE}/), "
        "listed below. Date: the run's (UTC); `*`: recorded after the run, the date of the commit that added the "
        "file. Commit: the code measured (`+dirty`: with changes not committed). Headline: the best figure the "
        "result holds, as recorded (benchmarks/README.md describes each benchmark's fields).",
        "",
        "## Current",
        "",
        *_table(current, ""),
        "",
        "## Reports",
        "",
        "Written by a command without a json, or by hand: " + ", ".join(f"[{n}]({n})" for n in reports(folder)) + ".",
        "",
        f"## Archive ({len(archived)} runs)",
        "",
        *_table(archived, f"{ARCHIVE}/"),
    ]
    archived_reports = reports(folder / ARCHIVE) if archived else []
    if archived_reports:
        lines += ["", "Reports: " + ", ".join(f"[{n}]({ARCHIVE}/{n})" for n in archived_reports) + "."]
    return "\n".join(lines) + "\n"


def archive(folder: Path) -> list[str]:
    """Move each superseded run's files to archive/; the names moved."""
    moved = []
    (folder / ARCHIVE).mkdir(exist_ok=True)
    for run in superseded(read_runs(folder)):
        for f in run.files:
            (folder / f).rename(folder / ARCHIVE / f)
        moved.append(run.name)
    return moved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.index", description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--archive", action="store_true", help="first move superseded runs to archive/")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if INDEX.md or the folder is off")
    args = ap.parse_args(argv)
    folder = args.results_dir
    if args.check:
        issues = problems(folder)
        index = folder / INDEX
        if not index.is_file() or index.read_text() != render(folder):
            issues.append(f"{INDEX} is stale: rsd bench index")
        print("\n".join(issues) or f"{INDEX} is current")
        return 1 if issues else 0
    if args.archive:
        try:
            for name in archive(folder):
                print(f"archived {name}")
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    (folder / INDEX).write_text(render(folder))
    print(f"wrote {folder / INDEX}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

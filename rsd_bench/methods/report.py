"""The benchmark's report: the markdown table of every row, pivots (by budget, by depth) and the PNG plots."""

from __future__ import annotations

from pathlib import Path

from rsd_bench.methods.planning import METHOD_ORDER


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
    return "\n".join([*lines, "", *interval_table(result["rows"]), *summary_tables(result["rows"])]) + "\n"


def _interval(r: dict) -> str:
    ci = r.get("block_efficiency_ci95")
    return "–" if not ci else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def interval_table(rows: list[dict]) -> list[str]:
    """Every measured (method, shape, T) once, with its block efficiency's 95% bootstrap interval."""
    seen, out = set(), []
    for r in rows:
        if r.get("block_efficiency_ci95") and (r["label"], r["temperature"]) not in seen:
            seen.add((r["label"], r["temperature"]))
            out.append(
                f"| {_fmt(r['temperature'], 1)} | {_method_cell(r)} | {_fmt(r['shape'])} | {_fmt(r['depth'])} | "
                f"{_fmt(r['nodes'])} | {_fmt(r['block_efficiency'])} | {_interval(r)} | {r['steps']} | "
                f"{r['prompts']} | {r['new_tokens']} |"
            )
    if not out:
        return []
    head = "| T | method | shape | depth | nodes | block eff. | 95% interval | steps | prompts | tokens |"
    title = "### Block efficiency with 95% intervals (percentile bootstrap over steps)"
    return [title, "", head, "|" + " --- |" * 10, *out, ""]


def summary_tables(rows: list[dict]) -> list[str]:
    """Markdown pivots: block efficiency by budget (best shape) and by depth, per T."""
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
                        f"{cells[c]['block_efficiency']:.2f} ({cells[c]['shape']})"
                        + (f" {_interval(cells[c])}" if cells[c].get("block_efficiency_ci95") else "")
                        if c in cells
                        else "–"
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
                    (r[key], r["block_efficiency"], r.get("block_efficiency_ci95"))
                    for r in rows
                    if r["method"] == method
                    and r["temperature"] == t
                    and r["block_efficiency"] is not None
                    and (protocol == "custom" or r["protocol"] == protocol)
                    and (protocol != "fixed_nodes" or r["best"])
                )
                if pts:
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    if all(p[2] for p in pts):  # the 95% bootstrap intervals as error bars
                        err = [
                            [y - p[2][0] for y, p in zip(ys, pts, strict=True)],
                            [p[2][1] - y for y, p in zip(ys, pts, strict=True)],
                        ]
                        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
                    else:
                        ax.plot(xs, ys, marker="o", label=method)
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

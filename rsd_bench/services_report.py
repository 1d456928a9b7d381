"""The markdown report of rsd_bench.services, and what its step split means."""

from __future__ import annotations


def render_md(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"# {report['name']}",
        "",
        f"{report['created']}; `{report['command']}`; {report['elapsed_s']:.0f} s in all.",
        "",
        f"Models: draft `{report['models']['draft']}`, target `{report['models']['target']}`. "
        f"Method {s['method']} {s['shape']}, {s['max_new_tokens']} new tokens, {s['num_prompts']} prompt(s), "
        f"draft top-k {s['draft_top_k']}, torch threads {s['threads']} per process, "
        f"{report['host']['cpus']} CPUs. Services as processes, embedded gateway store, no Redis.",
        "",
        *_placement_lines(report),
        "## Distributed overhead (1 session; gateway tok/s / in-process tok/s)",
        "",
        "| T | in-process tok/s | gateway tok/s | ratio | ratio from step split | tokens match | block eff. "
        "| in-process ms/step: draft + verify = step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["overhead"]:
        lines.append(
            f"| {r['temperature']:g} | {r['inprocess_tok_s']:.2f} | {r['gateway_tok_s']:.2f} | "
            f"**{r['ratio']:.3f}** | {r['est_ratio_from_split']} | {r['tokens_match']} | {r['block_efficiency']:.2f} "
            f"| {r['inprocess_draft_ms']:.1f} + {r['inprocess_verify_ms']:.1f} = {r['inprocess_step_ms']:.1f} |"
        )
    order = (
        "alternating prompt by prompt"
        if report["overhead"] and report["overhead"][0]["interleaved"]
        else ("in-process first, then the services")
    )
    lines += [
        "",
        f"In-process and gateway runs: {order}. Ratio from step split = (draft + verify) / step of the "
        "same gateway steps (see below): the share of a step that is model compute.",
    ]
    if report["capacity"]:
        lines += [
            "",
            "## Capacity (N concurrent sessions through the gateway)",
            "",
            "Batching: verifier / drafter (on: one packed forward serves every session that is ready).",
            "",
            "| batching | T | sessions | tokens | wall s | aggregate tok/s | × 1 session | mean sessions/forward |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in report["capacity"]:
            on_off = "/".join("on" if r.get(k, True) else "off" for k in ("batching", "draft_batching"))
            lines.append(
                f"| {on_off} | {r['temperature']:g} | {r['sessions']} | {r['tokens']} | "
                f"{r['wall_s']:.2f} | {r['aggregate_tok_s']:.2f} | **{r['speedup_vs_1']:.2f}** | "
                f"{r['mean_batch_sessions']} |"
            )
    lines += [
        "",
        "## Time per step (ms, mean over steps, first step of each turn excluded)",
        "",
        "| run | draft | transfer | queue | verify | residual | step | first step | steps | tok/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "–" if x is None else f"{x:.1f}"

    for r in report["step_split"]:
        lines.append(
            f"| {r['run']} | {f(r['draft_ms'])} | {f(r['transfer_ms'])} | {f(r['queue_ms'])} | {f(r['verify_ms'])} | "
            f"{f(r['residual_ms'])} | {f(r['step_ms'])} | {f(r['first_step_ms'])} | {r['num_steps']} | "
            f"{r['block_efficiency']:.2f} |"
        )
    lines += ["", "Columns: " + report["split_definitions"], "", "Not measured by the services' stats:", ""]
    lines += [f"- {m}" for m in report["missing"]]
    return "\n".join(lines) + "\n"


SPLIT_DEFINITIONS = (
    "draft = StepStats.draft_ms (drafter builds the tree); queue = VerifierStats.queue_ms; verify = "
    "VerifierStats.forward_ms (batched target forward + acceptance walk); transfer = round_trip_ms - queue - "
    "verify (gRPC both ways, (de)serialisation, verifier servicer); residual = client-observed time between "
    "two deltas - draft_ms - round_trip_ms (drafter applies the verdict, drafter -> gateway -> client stream, "
    "gateway bookkeeping); step = client-observed time between two deltas."
)
MISSING = [
    "accept: the drafter's time to apply a verdict (drafter.accept, K/V commit) is not in StepStats; it is "
    "inside `residual` together with the drafter -> gateway -> client hops and the gateway's work",
    "verify is not split into the target forward and the acceptance walk (VerifierStats.forward_ms holds both)",
    "transfer is not split into the two directions nor into serialisation vs network (no timestamps cross the wire)",
    "the verifier's Attach / prefill time is not reported; it is part of first_step_ms here",
]


def _placement_lines(report: dict) -> list[str]:
    """The CPU, the load and where each service ran (reports written before these fields: nothing)."""
    host, s = report["host"], report["settings"]
    if "placement" not in s:
        return []
    cores = {k: v or "any" for k, v in s["placement"].items()}
    return [
        f"Target dtype {s['dtype']}, drafter quantize {s['draft_quantize']}, pre-drafting {s['predraft']}; "
        f"cores: verifier {cores['verifier_cores']}, drafter {cores['drafter_cores']}, gateway "
        f"{cores['gateway_cores']}. CPU: {host.get('cpu_model', '?')}, flags {' '.join(host.get('cpu_flags', []))}; "
        f"load {host.get('loadavg_start')} at the start, {host.get('loadavg_end')} at the end.",
        "",
    ]

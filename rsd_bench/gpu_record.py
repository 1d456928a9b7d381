"""The record of an rsd_bench.gpu_check run: the machine, the models' configs, each generation's figures,
pytest's outcome, the summary table and the .md written beside the json."""

from __future__ import annotations

import platform
import statistics
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from rsd_bench.machine import cpu_info


def config_record(config) -> dict:
    record = config.to_diff_dict()
    record.pop("layer_types", None)  # one entry a layer, all "full_attention"
    return record


def stats_record(stats) -> dict:
    return {
        "tokens_per_s": round(stats.tokens_per_s, 2),
        "block_efficiency": round(stats.block_efficiency, 3),
        "new_tokens": stats.new_tokens,
        "target_calls": stats.target_calls,
        "draft_forwards": stats.draft_forwards,
        "acceptance_by_depth": [round(a, 3) for a in stats.acceptance_by_depth],
        "total_s": round(stats.total_s, 3),
        "draft_s": round(stats.draft_s, 3),
        "verify_s": round(stats.verify_s, 3),
        "accept_s": round(stats.accept_s, 3),
        "predraft_hits": stats.predraft_hits,
        "predraft_misses": stats.predraft_misses,
        "predraft_trees": stats.predraft_trees,
        "wasted_draft_forwards": stats.wasted_draft_forwards,
    }


def summarise(rows: list[dict]) -> list[dict]:
    """One row per (method, temperature): means over prompts, pipelined beside plain, speed against ar."""
    done = [r for r in rows if "tokens_per_s" in r]
    keys = list(dict.fromkeys((r["method"], r["temperature"]) for r in done))
    ar_speed = {
        t: statistics.mean(r["tokens_per_s"] for r in done if r["kind"] == "ar" and r["temperature"] == t)
        for t in {r["temperature"] for r in done if r["kind"] == "ar"}
    }
    table = []
    for method, temperature in keys:
        entry: dict = {"method": method, "temperature": temperature}
        for kind in ("ar", "plain", "pipelined"):
            mine = [r for r in done if (r["method"], r["temperature"], r["kind"]) == (method, temperature, kind)]
            if not mine:
                continue
            speed = statistics.mean(r["tokens_per_s"] for r in mine)
            entry[f"{kind}_tokens_per_s"] = round(speed, 2)
            entry[f"{kind}_block_efficiency"] = round(statistics.mean(r["block_efficiency"] for r in mine), 3)
            if kind != "ar" and temperature in ar_speed:
                entry[f"{kind}_speedup_vs_ar"] = round(speed / ar_speed[temperature], 3)
            for flag in ("matches_ar", "equals_plain"):
                if any(flag in r for r in mine):
                    entry[flag] = all(r.get(flag, False) for r in mine)
        table.append(entry)
    return table


def machine_record(device: str) -> dict:
    """The machine without machine_info's small_gemm probe (it compiles CPU kernels)."""
    import torch
    import transformers

    record = {
        **cpu_info(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.update(
            device_name=torch.cuda.get_device_name(device),
            device_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            cudnn=torch.backends.cudnn.version(),
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
        )
        try:
            smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            record["driver"] = subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            record["driver"] = "unknown"
    return record


def tests_record(junit: Path | None, rc: int | None, command: str | None) -> dict | None:
    """pytest's outcome from its junit file: counts, the failing tests' names, its exit status."""
    if junit is None:
        return None
    record: dict = {"command": command, "rc": rc}
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError) as e:
        record["junit_error"] = f"{type(e).__name__}: {e}"
        return record
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for key in ("tests", "failures", "errors", "skipped"):
        record[key] = sum(int(s.get(key, 0)) for s in suites)
    record["time_s"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    record["passed"] = record["tests"] - record["failures"] - record["errors"] - record["skipped"]
    record["failed"] = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in root.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    return record


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# GPU check: every step path on {m.get('device_name', m['device'])}, random-weight "
        f"{'tiny' if result['tiny'] else 'Qwen2.5 1.5B/0.5B-shaped'} pair",
        "",
        f"{result['date']}, commit {result['commit']}; torch {m['torch']} (CUDA {m['cuda']}), transformers "
        f"{m['transformers']}; CPU {m['cpu_model']}. Weights {result['weights']}: near-uniform "
        "laws, so the draft rarely agrees with the target and speculation runs slower than the target alone; "
        "the figures are the forwards' costs and whether every path runs and agrees.",
        "",
    ]
    tests = result.get("tests")
    if tests:
        lines += [
            f"Tests (`{tests.get('command')}`): rc {tests.get('rc')}, {tests.get('passed', '?')} passed, "
            f"{tests.get('failures', '?')} failed, {tests.get('errors', '?')} errors, "
            f"{tests.get('skipped', '?')} skipped in {tests.get('time_s', '?')} s"
            + (f"; failing: {', '.join(tests['failed'])}" if tests.get("failed") else "")
            + ".",
            "",
        ]
    for dtype, d in result["dtypes"].items():
        if "error" in d:
            lines += [f"## {dtype}", "", f"Failed: {d['error']}", ""]
            continue
        fc = d["forward_cost"]
        lines += [
            f"## {dtype}",
            "",
            f"Target tree forward after {fc['context_tokens']} cached tokens (median of {fc['reps']}); draft "
            f"one-token forward {fc['draft_1_token_ms']} ms; root row vs one-token logits max |diff| "
            f"{fc['max_abs_logit_diff_root_vs_one_token']:.1e}.",
            "",
            "| nodes | " + " | ".join(str(r["nodes"]) for r in fc["target"]) + " |",
            "| --- | " + " | ".join("---" for _ in fc["target"]) + " |",
            "| ms | " + " | ".join(f"{r['ms']:.2f}" for r in fc["target"]) + " |",
            "| x 1 node | " + " | ".join(f"{r['ratio_to_1']:.2f}" for r in fc["target"]) + " |",
            "",
            "| method | T | tok/s plain | tok/s pipelined | x ar | block eff. | matches ar | pipelined = plain |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for s in d["summary"]:
            speed = s.get("ar_tokens_per_s", s.get("plain_tokens_per_s"))
            lines.append(
                f"| {s['method']} | {s['temperature']:g} | {speed if speed is not None else '-'} | "
                f"{s.get('pipelined_tokens_per_s', '-')} | {s.get('plain_speedup_vs_ar', '-')} | "
                f"{s.get('plain_block_efficiency', s.get('ar_block_efficiency', '-'))} | "
                f"{_yes_no(s.get('matches_ar'))} | {_yes_no(s.get('equals_plain'))} |"
            )
        if d.get("profile"):
            lines += [
                "",
                "Profiled (host ops only): ms a target call, scalar reads to the host a call (each a synchronisation "
                "on a GPU), the op with the most host time.",
                "",
                "| method | T | ms / target call | scalar reads / call | top host op (self ms) |",
                "| --- | --- | --- | --- | --- |",
            ]
            for p in d["profile"]:
                top = p["top_host_ops"][0] if p["top_host_ops"] else {"op": "-", "self_ms": "-"}
                lines.append(
                    f"| {p['method']} | {p['temperature']:g} | {p['ms_per_target_call']} | "
                    f"{p['scalar_reads_per_target_call']} | {top['op']} ({top['self_ms']}) |"
                )
        if d.get("hf_generate"):
            h = d["hf_generate"]
            lines += [
                "",
                f"transformers' own greedy generate on the target: {h['tokens_per_s']} tok/s ({h['tokens']} tokens).",
            ]
        lines += [
            "",
            f"Skipped cases (budget): {d['skipped_cases']}; errors: {d['errors']}; load {d['load_s']} s"
            + (f"; peak memory {d['max_memory_allocated_gib']} GiB" if "max_memory_allocated_gib" in d else "")
            + ".",
            "",
        ]
    return "\n".join(lines)


def _yes_no(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "NO")

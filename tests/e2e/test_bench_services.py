"""Smoke test of rsd_bench.services on tiny models: the services start as processes, the
three parts run (2 sessions, 8 tokens, batching verifier/drafter on/on, on/off, off/off), and the JSON /
Markdown have their fields.
Through the gateway the tokens equal the in-process SpeculativeGenerator's (T=0 and T=1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

OVERHEAD_KEYS = {
    "temperature",
    "inprocess_tok_s",
    "gateway_tok_s",
    "ratio",
    "tokens_match",
    "inprocess_tokens",
    "gateway_tokens",
    "inprocess_wall_s",
    "gateway_wall_s",
    "block_efficiency",
    "est_ratio_from_split",
    "interleaved",
    "inprocess_step_ms",
    "inprocess_draft_ms",
    "inprocess_verify_ms",
}
CAPACITY_KEYS = {
    "batching",
    "draft_batching",
    "temperature",
    "sessions",
    "tokens",
    "wall_s",
    "aggregate_tok_s",
    "per_session_tok_s",
    "speedup_vs_1",
    "mean_batch_sessions",
}
SPLIT_KEYS = {
    "run",
    "draft_ms",
    "transfer_ms",
    "queue_ms",
    "verify_ms",
    "residual_ms",
    "step_ms",
    "first_step_ms",
    "num_steps",
    "mean_batch_sessions",
    "acceptance",
    "block_efficiency",
}


def test_bench_services_smoke(tmp_path):
    cmd = [sys.executable, "-m", "rsd_bench.services", "--tiny", "--cache-dir", str(tmp_path / "models")]
    cmd += ["--vocab-size", "256", "--hidden-size", "64", "--num-layers", "2", "--draft-layers", "1"]
    cmd += ["--sessions", "2", "--max-new-tokens", "8", "--num-prompts", "1", "--method", "rsd_s", "--shape", "2x3"]
    cmd += ["--name", "smoke", "--out-dir", str(tmp_path / "out"), "--run-dir", str(tmp_path / "logs")]
    cmd += ["--start-timeout-s", "120", "--batching", "on,on/off,off/off"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]

    report = json.loads((tmp_path / "out" / "smoke.json").read_text())
    md = (tmp_path / "out" / "smoke.md").read_text()
    assert {
        "name",
        "command",
        "elapsed_s",
        "models",
        "settings",
        "overhead",
        "capacity",
        "step_split",
        "missing",
    } <= set(report)
    assert report["settings"]["sessions"] == [1, 2]
    assert [r["temperature"] for r in report["overhead"]] == [0.0, 1.0]
    for row in report["overhead"]:
        assert set(row) == OVERHEAD_KEYS
        assert row["tokens_match"] is True  # the services reproduce the in-process run exactly
        assert row["gateway_tokens"] == row["inprocess_tokens"] > 0
        assert row["ratio"] > 0 and row["est_ratio_from_split"] > 0  # timings: no bound (a loaded machine)
        assert row["interleaved"] is True  # tiny models: in-process and gateway runs alternate
    # batching (verifier, drafter) on/on, on/off, off/off: 1 and 2 sessions at T=0, then 2 sessions at T=1
    cases = [(r["batching"], r["draft_batching"], r["sessions"], r["temperature"]) for r in report["capacity"]]
    settings = ((True, True), (True, False), (False, False))
    assert cases == [(v, d, n, t) for v, d in settings for n, t in ((1, 0.0), (2, 0.0), (2, 1.0))]
    for row in report["capacity"]:
        assert set(row) == CAPACITY_KEYS
        assert row["tokens"] == 8 * row["sessions"] and row["aggregate_tok_s"] > 0
    assert all(r["speedup_vs_1"] == 1.0 for r in report["capacity"] if r["sessions"] == 1)
    assert all(r["mean_batch_sessions"] == 1.0 for r in report["capacity"] if not r["batching"])
    assert len(report["step_split"]) == 2 + 9
    for row in report["step_split"]:
        assert set(row) == SPLIT_KEYS
        assert row["draft_ms"] > 0 and row["verify_ms"] > 0 and row["num_steps"] > 0
    assert "Distributed overhead" in md and "Capacity" in md and "Time per step" in md


def test_batching_settings_parse():
    from rsd_bench.services import parse_batching

    assert parse_batching("on, on/off ,off/off,off") == [(True, True), (True, False), (False, False), (False, True)]
    for bad in ("off,on", "on,maybe", "on,on/x"):
        with pytest.raises(SystemExit):
            parse_batching(bad)


def test_bench_services_capacity_only_with_placement_smoke(tmp_path):
    """--capacity-only skips the overhead part (and its in-process runs); the services start with the
    placement, quantize and predraft flags and the capacity rows are there."""
    cmd = [sys.executable, "-m", "rsd_bench.services", "--tiny", "--cache-dir", str(tmp_path / "models")]
    cmd += ["--vocab-size", "256", "--hidden-size", "64", "--num-layers", "2", "--draft-layers", "1"]
    cmd += ["--sessions", "2", "--max-new-tokens", "6", "--num-prompts", "1", "--method", "rsd_s", "--shape", "2x2"]
    cmd += ["--name", "cap", "--out-dir", str(tmp_path / "out"), "--run-dir", str(tmp_path / "logs")]
    cmd += ["--start-timeout-s", "120", "--batching", "on", "--capacity-only", "--draft-quantize", "int8"]
    cores = "0" if os.cpu_count() == 1 else "0-1"
    cmd += ["--predraft", "false", "--verifier-cores", cores, "--drafter-cores", "0", "--gateway-cores", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "cap.json").read_text())
    assert report["overhead"] == []
    assert [(r["sessions"], r["temperature"]) for r in report["capacity"]] == [(1, 0.0), (2, 0.0), (2, 1.0)]
    assert all(r["tokens"] == 6 * r["sessions"] for r in report["capacity"])
    assert "--capacity-only" in report["command"] and "--draft-quantize int8" in report["command"]
    # the result records where each service ran, how, and on what CPU
    s = report["settings"]
    assert s["placement"] == {"verifier_cores": cores, "drafter_cores": "0", "gateway_cores": "0"}
    assert (s["dtype"], s["draft_quantize"], s["predraft"]) == ("float32", "int8", "false")
    assert report["complete"] and "cpu_flags" in report["host"] and len(report["host"]["loadavg_end"]) == 3
    md = (tmp_path / "out" / "cap.md").read_text()
    assert f"cores: verifier {cores}, drafter 0, gateway 0" in md and "flags" in md

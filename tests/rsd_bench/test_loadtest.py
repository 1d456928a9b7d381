"""The load test tool, briefly: two clients for a few seconds against in-process servers on the tiny pair.
Checks the report's shape and that nothing failed; no timed assertion (the figures are the tool's output,
benchmarks/results/load.md)."""

from __future__ import annotations

import json

from rsd_bench import loadtest


def test_loadtest_reports_every_figure_and_no_error(tmp_path, capsys):
    out = tmp_path / "load"
    argv = ["--in-process", "--clients", "2", "--duration-s", "3", "--max-new-tokens", "8", "--out", str(out)]
    assert loadtest.main([*argv, "--cache-dir", str(tmp_path / "models")]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["clients"] == 2 and report["errors"] == {}
    assert report["requests_completed"] >= 2 and report["new_tokens"] >= 8 * report["requests_completed"] // 2
    assert report["throughput_tok_s"] > 0
    for latency in (report["ttft_ms"], report["per_token_ms"]):
        assert {"p50", "p99", "max"} <= set(latency) and 0 < latency["p50"] <= latency["p99"] <= latency["max"]
    (memory,) = report["memory_mib"].values()
    assert {"start", "peak", "end", "growth"} <= set(memory) and memory["peak"] >= memory["start"] > 0
    markdown = out.with_suffix(".md").read_text()
    assert "time to first token" in markdown and "requests completed" in markdown
    assert "requests completed" in capsys.readouterr().out


def test_percentiles_nearest_rank():
    assert loadtest.percentiles([]) == {"p50": 0.0, "p99": 0.0, "max": 0.0}
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert loadtest.percentiles(values) == {"p50": 50.0, "p99": 99.0, "max": 100.0}

"""The network benchmark's command runs end to end on the tiny pair: the real services, the verifier behind
the delay relay, plain and pre-drafting drafters; every row field, pre-drafting token for token the plain
drafter's (seeded, T = 0 and 1), greedy output the target's."""

import json

from rsd_bench import net


def test_tiny_run_writes_every_field(tmp_path):
    argv = ["--tiny", "--num-prompts", "1", "--max-new-tokens", "6", "--temperatures", "0,1", "--methods", "sd:2"]
    argv += ["--adaptive", "sd:3", "--delays", "5", "--cache-dir", str(tmp_path / "cache")]
    argv += ["--out-dir", str(tmp_path), "--name", "n"]
    assert net.main(argv) == 0
    result = json.loads((tmp_path / "n.json").read_text())
    assert result["complete"] is True and (tmp_path / "n.md").exists() and (tmp_path / "n-tokens-per-s.png").exists()
    assert result["benchmark"] == "net" and "relay" in result["network"]["emulation"]
    fields = {"delay_ms", "method", "shape", "adaptive", "pipelined", "tokens_per_s", "block_efficiency"}
    fields |= {"predraft_hit_rate", "speedup_vs_plain", "speedup_vs_ar", "same_tokens_as_plain", "matches_ar"}
    rows = result["rows"]
    assert len(rows) == 2 * 3 and all(fields <= set(r) for r in rows)  # T x (plain, pre-drafting, adaptive)
    assert all(r["same_tokens_as_plain"] for r in rows if not r["adaptive"])
    assert all(r["matches_ar"] for r in rows if r["temperature"] == 0)  # adaptive shapes too
    assert all(r["speedup_vs_plain"] == 1 for r in rows if not r["pipelined"])
    assert all(r["speedup_vs_best_fixed"] > 0 for r in rows if r["adaptive"])
    # the relay's scheduled one-way delay (departure - arrival of each chunk), not a clock
    assert all(min(r["measured_one_way_ms"].values()) >= 5 * (1 - result["network"]["jitter"]) for r in rows)

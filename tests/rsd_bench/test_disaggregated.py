"""The deciding benchmark's command runs end to end on the tiny pair: real services, the target alone in
child processes, the row fields the issue asks for, and greedy output equal to the target's."""

import json

import pytest

from rsd_bench import disaggregated, stats


def test_bootstrap_interval_brackets_the_mean():
    lo, hi = stats.bootstrap_interval([1, 2, 3, 4, 5] * 10, 500)
    assert lo < 3 < hi and hi - lo < 1.5
    assert stats.bootstrap_interval([2] * 7, 100) == [2, 2]


def test_tiny_run_writes_every_field(tmp_path):
    argv = ["--tiny", "--num-prompts", "1", "--max-new-tokens", "6", "--temperatures", "0", "--methods", "sd:2"]
    argv += ["--predraft", "on:2", "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path), "--name", "d"]
    argv += ["--ar-dtypes", "bfloat16"]  # the target alone in float32 (the verifier's) and bfloat16
    argv += ["--drafter-args", "--predraft-outcomes 2"]  # passed to the drafter, recorded
    argv += ["--verification", "traversal,coupled"]  # each applied by the verifier (T = 0: greedy all the same)
    assert disaggregated.main(argv) == 0
    result = json.loads((tmp_path / "d.json").read_text())
    assert result["complete"] is True and (tmp_path / "d.md").exists() and (tmp_path / "d-tokens-per-s.png").exists()
    row, coupled = result["rows"]
    assert coupled["verification"] == "coupled" and coupled["matches_ar"] is True
    fields = {"method", "shape", "temperature", "pipelined", "tokens_per_s", "block_efficiency", "predraft_hit_rate"}
    fields |= {"matches_ar", "speedup_vs_ar_same_core", "speedup_vs_ar_whole_machine", "block_efficiency_ci95"}
    assert fields <= set(row)
    assert row["matches_ar"] is True and row["pipelined"] is True  # against the float32 target alone
    assert row["verification"] == "traversal"
    assert row["predraft_width"] == 2  # two trees pre-drafted side by side
    for ar in result["ar"].values():  # each placement's baseline is its fastest dtype
        by_dtype = ar["tokens_per_s_by_dtype"]
        assert set(by_dtype) == {"float32", "bfloat16"}
        assert ar["0.0"]["tokens_per_s"] == max(v["0.0"] for v in by_dtype.values()) == by_dtype[ar["dtype"]]["0.0"]
    assert result["machine"]["cpu_flags"] is not None
    assert result["drafter_args"] == "--predraft-outcomes 2"
    placement = result["placement"]  # the gateway sits on the drafter's core unless told otherwise
    assert (placement["drafter_cores"], placement["verifier_cores"], placement["gateway_cores"]) == ("0", "1", "0")
    with pytest.raises(SystemExit, match="block verification is exact for one chain only"):  # before any start
        disaggregated.main([*argv, "--methods", "rsd_s:3x4", "--verification", "block"])
    with pytest.raises(SystemExit):  # argparse: an unknown verification, before any start
        disaggregated.main([*argv, "--verification", "token,bogus"])

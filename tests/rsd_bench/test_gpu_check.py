"""rsd_bench.gpu_check (run by scripts/gpu_check.sh on a CUDA machine) in its CPU smoke mode, so the script
that CI never runs on a GPU keeps working: every path runs, the record has its fields, and the CPU's exact
paths agree (T = 0 equals the target alone, pipelined equals plain)."""

import json

import pytest
import torch

from rsd_bench import gpu_check

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1" time="2.5">
<testcase classname="tests.rsd_runtime.test_device" name="test_a" time="1"/>
<testcase classname="tests.rsd_runtime.test_device" name="test_b" time="1"><failure message="boom"/></testcase>
<testcase classname="tests.rsd_runtime.test_device" name="test_c" time="0.5"><skipped/></testcase>
</testsuite></testsuites>
"""


def test_tiny_cpu_smoke_run_records_every_path(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    out = tmp_path / "gpu-smoke.json"
    argv = ["--device", "cpu", "--tiny", "--out", str(out), "--methods", "sd:2,rsd_s:2x2", "--new-tokens", "4"]
    argv += ["--reps", "1", "--tree-sizes", "1,4", "--context", "16", "--prompt-len", "8"]
    argv += [
        "--tests-junit",
        str(junit),
        "--tests-rc",
        "1",
        "--tests-command",
        "pytest tests/rsd_runtime/test_device.py",
    ]
    assert gpu_check.main(argv) == 0

    result = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("# GPU check")
    assert result["machine"]["torch"] == torch.__version__ and result["commit"]
    assert result["models"]["target"]["vocab_size"] == result["models"]["draft"]["vocab_size"] == gpu_check.TINY_VOCAB
    assert result["tests"] | {"failed": None} == {
        "command": "pytest tests/rsd_runtime/test_device.py",
        "rc": 1,
        "tests": 3,
        "failures": 1,
        "errors": 0,
        "skipped": 1,
        "passed": 1,
        "time_s": 2.5,
        "failed": None,
    }
    assert result["tests"]["failed"] == ["tests.rsd_runtime.test_device::test_b"]
    assert not result["complete"]  # the tests failed

    run = result["dtypes"]["float32"]
    assert run["complete"] and run["errors"] == run["skipped_cases"] == 0
    assert [r["nodes"] for r in run["forward_cost"]["target"]] == [1, 4]
    assert run["forward_cost"]["max_abs_logit_diff_root_vs_one_token"] < 1e-4
    rows = run["generation"]
    assert {(r["kind"], r["method"], r["temperature"]) for r in rows} == {
        (kind, method, t)
        for t in (0.0, 1.0)
        for kind, method in [("ar", "ar")] + [(k, m) for k in ("plain", "pipelined") for m in ("sd:2", "rsd_s:2x2")]
    }
    assert all(r["new_tokens"] == 4 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["matches_ar"] for r in rows if r["kind"] == "plain" and r["temperature"] == 0)
    assert all(r["equals_plain"] for r in rows if r["kind"] == "pipelined")
    assert {(s["method"], s["temperature"]) for s in run["summary"]} == {
        (m, t) for m in ("ar", "sd:2", "rsd_s:2x2") for t in (0.0, 1.0)
    }


def test_a_budget_skips_cases_and_says_so(tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--tiny", "--out", str(out), "--methods", "sd:2", "--new-tokens", "2", "--reps", "1"]
    assert gpu_check.main([*argv, "--tree-sizes", "1", "--context", "8", "--budget-s", "1e-9"]) == 0
    run = json.loads(out.read_text())["dtypes"]["float32"]
    assert run["skipped_cases"] == len(run["generation"]) > 0 and not run["complete"]


def test_refuses_without_cuda_or_on_cpu_without_tiny(tmp_path):
    out = str(tmp_path / "gpu.json")
    with pytest.raises(SystemExit, match="needs --tiny"):
        gpu_check.main(["--device", "cpu", "--out", out])
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the refusal is for machines without it")
    with pytest.raises(SystemExit, match="CUDA is not available"):
        gpu_check.main(["--out", out])


def test_profile_records_host_ops_and_scalar_reads(tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--tiny", "--out", str(out), "--methods", "sd:2", "--temperatures", "1"]
    assert gpu_check.main([*argv, "--new-tokens", "2", "--reps", "1", "--tree-sizes", "1", "--profile", "3"]) == 0
    run = json.loads(out.read_text())["dtypes"]["float32"]
    assert [(p["method"], p["temperature"]) for p in run["profile"]] == [("ar", 1.0), ("sd:2", 1.0)]
    for p in run["profile"]:
        assert p["tokens"] >= 3 and p["ms_per_target_call"] > 0 and p["scalar_reads_per_target_call"] > 0
        assert p["top_host_ops"][0]["op"].startswith("aten::")
    assert run["hf_generate"]["tokens"] == 3
    assert "scalar reads / call" in out.with_suffix(".md").read_text()

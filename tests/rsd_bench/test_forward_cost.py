"""`rsd bench forward_cost` on a tiny GGUF target: its own blocks (exact, and with int8 activations where that
kernel runs) and the fp32 detour side by side, with the fraction of the read bandwidth each forward reaches
(figures are not checked: a smoke of the protocol)."""

import json

from rsd_bench import forward_cost
from rsd_runtime import quant_q8
from rsd_tools.tiny import build_tiny_gguf_pair


def test_a_gguf_target_against_its_fp32_detour(tmp_path):
    _, target = build_tiny_gguf_pair(tmp_path / "models", "qwen2", num_layers=2, draft_layers=1)
    kernels = ("gguf", "small_gemm", "gguf_q8") if quant_q8.kernel_name() else ("gguf", "small_gemm")
    argv = ["--target", str(target), "--tokens", "1,4", "--reps", "1", "--context", "8", "--bandwidth-gib", "0.05"]
    argv += ["--kernels", ",".join(kernels)]
    assert forward_cost.main([*argv, "--out-dir", str(tmp_path), "--name", "fc"]) == 0
    result = json.loads((tmp_path / "fc.json").read_text())
    cases = {(k, n) for k in kernels for n in (1, 4)}
    assert {(r["kernel"], r["tokens"]) for r in result["rows"]} == cases
    assert result["weight_gb"]["gguf"] < result["weight_gb"]["small_gemm"]  # the blocks are smaller than fp32
    assert all(r["bandwidth_fraction"] > 0 for r in result["rows"]) and result["read_bandwidth_gbps"] > 0
    assert "of bandwidth" in (tmp_path / "fc.md").read_text()
    if "gguf_q8" in kernels:  # row-invariant: a chain's first row is the one-token row bit for bit
        assert result["max_abs_logit_diff_first_row_vs_one_token"]["gguf_q8"] == 0.0
        assert result["max_abs_logit_diff_gguf_q8_vs_gguf"] > 0

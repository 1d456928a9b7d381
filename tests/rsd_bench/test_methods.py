"""The benchmark on tiny models: schema of the JSON, and greedy speculative rows equal to the ar row."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from rsd_bench.methods import cli as bench
from rsd_bench.methods.planning import fixed_nodes_specs, parse_config, parse_temperatures, plan
from rsd_bench.prompts import stdlib_prompts
from rsd_tools.tiny import build_tiny_pair

ROW_KEYS = {
    "method",
    "label",
    "protocol",
    "temperature",
    "shape",
    "depth",
    "nodes",
    "block_efficiency",
    "mbsu",
    "tokens_per_s",
    "speedup_vs_ar",
    "budget",
    "best",
    "draft_s",
    "verify_s",
    "accept_s",
    "other_s",
    "step_ms",
    "acceptance_by_depth",
    "matches_ar",
    "outputs",
}


def test_bench_tiny_schema_and_greedy_equality(tmp_path, capsys):
    draft_dir, target_dir = build_tiny_pair(tmp_path / "models", "qwen2")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w4"}\n{"id": "b", "prompt": "w9 w8 w7"}\n')
    argv = ["--draft", str(draft_dir), "--target", str(target_dir), "--prompts", str(prompts)]
    argv += [
        "--config",
        "ar;rsd_c:2,2,1",
        "--method",
        "rsd_s:2x3",
        "--method",
        "hf_assisted:2",
        "--temperatures",
        "0,1",
    ]
    argv += [
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--cost-reps",
        "1",
        "--tree-costs",
        "--out-dir",
        str(tmp_path / "out"),
    ]
    assert bench.main([*argv, "--name", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "| rsd_s |" in out and "### Block efficiency with 95% intervals" in out

    result = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert (tmp_path / "out" / "tiny.md").read_text().startswith("# tiny")
    assert {"models", "machine", "prompts", "rows", "mbsu_formula", "forward_costs"} <= result.keys()
    assert result["complete"] is True and "loadavg_end" in result["machine"]
    assert result["models"]["target"]["params"] > result["models"]["draft"]["params"] > 0
    assert result["machine"]["torch_threads"] == 1 and result["machine"]["cpu_model"]
    assert result["prompts"]["count"] == 2 and result["prompts"]["source"] == str(prompts)
    assert result["forward_costs"]["c"] > 0
    assert set(result["forward_costs"]["target_ms_by_tokens"]) == {"1", "11", "7"}  # root + nodes
    rows = {(r["label"], r["temperature"]): r for r in result["rows"]}
    assert len(rows) == 8
    for temp in (0.0, 1.0):  # the outside peer: target and draft forwards counted by hooks
        hf = rows.pop(("hf_assisted:2", temp))
        assert hf["new_tokens"] == 16 and hf["tokens_per_s"] > 0 and hf["steady_tokens_per_s"] > 0
        assert hf["block_efficiency"] == pytest.approx(16 / hf["target_calls"])
        assert 1 <= hf["block_efficiency"] <= 3 and hf["draft_forwards"] > 0
        assert hf["mbsu"] is not None and hf["draft_s"] is None
    for (label, temp), row in rows.items():
        assert row.keys() >= ROW_KEYS
        assert row["new_tokens"] == 16 and len(row["outputs"]) == 2
        assert all(len(o["token_ids"]) == 8 for o in row["outputs"])
        assert row["speedup_vs_ar"] == pytest.approx(row["tokens_per_s"] / rows[("ar", temp)]["tokens_per_s"])
        assert row["block_efficiency"] == pytest.approx(16 / row["target_calls"])
        assert 0 < row["first_step_s"] < row["total_s"] and row["steady_tokens_per_s"] > 0
        assert row["protocol"] == "custom" and row["budget"] is None and row["best"] is None
        assert row["draft_s"] + row["verify_s"] + row["accept_s"] + row["other_s"] == pytest.approx(row["total_s"])
        assert sum(row["step_ms"].values()) == pytest.approx(1000 * row["total_s"] / row["target_calls"])
        # the 95% bootstrap interval over steps: one entry per target call, summing to the tokens kept
        assert row["steps"] == row["target_calls"] == sum(len(o["step_tokens"]) for o in row["outputs"])
        assert all(sum(o["step_tokens"]) == len(o["token_ids"]) for o in row["outputs"])
        lo, hi = row["block_efficiency_ci95"]
        assert lo <= row["block_efficiency"] <= hi
        if label == "ar":
            assert row["block_efficiency"] == 1 and row["mbsu"] == 1 and row["nodes"] == 0
        else:
            assert 1 <= row["block_efficiency"] <= row["depth"] + 1
            c = result["forward_costs"]["c"]
            assert row["mbsu"] == pytest.approx(row["block_efficiency"] / (1 + c * row["draft_forwards_per_step"]))
        # at T = 0 every speculative method must produce exactly the target's greedy tokens
        assert row["matches_ar"] is (True if temp == 0 else None)
    assert rows[("rsd_c:2,2,1", 0.0)]["nodes"] == 2 + 4 + 4
    assert rows[("rsd_s:2x3", 0.0)]["depth"] == 3
    greedy_ar = [o["token_ids"] for o in rows[("ar", 0.0)]["outputs"]]
    for label in ("rsd_c:2,2,1", "rsd_s:2x3"):
        assert [o["token_ids"] for o in rows[(label, 0.0)]["outputs"]] == greedy_ar


def test_parse_config_and_errors():
    specs = parse_config("ar; sd:4 ;specinfer:2,2,1;spectr:2x4;rsd_c;rsd_s:3x4;hf_assisted:3")
    assert [s.label for s in specs] == [
        "ar",
        "sd:4",
        "specinfer:2,2,1",
        "spectr:2x4",
        "rsd_c:2,2,1",
        "rsd_s:3x4",
        "hf_assisted:3",
    ]
    assert specs[5].method().max_draft_tokens == 12
    for bad in ("xx:1", "sd:2x2", "rsd_s:3", "ar:2", "hf_assisted:k", ""):
        with pytest.raises(ValueError):
            parse_config(bad)
    assert parse_temperatures("0, 0.7,1") == [0.0, 0.7, 1.0]
    with pytest.raises(ValueError):
        parse_temperatures("-1")


def test_stdlib_prompts_are_fixed_and_cut_after_docstring():
    first, again = stdlib_prompts(5, seed=0), stdlib_prompts(5, seed=0)
    assert first == again and len({p["id"] for p in first}) == 5
    for p in first:
        assert p["prompt"].lstrip().startswith(("def ", "async def ", "@"))
        assert p["prompt"].rstrip().endswith(('"""', "'''"))
    assert stdlib_prompts(5, seed=1) != first


def test_protocol_plans_match_the_paper_protocols():
    specs, where = plan("all", [2, 3, 4, 5], [6, 10, 14, 21, 30])
    labels = [s.label for s in specs]
    assert len(labels) == len(set(labels)) and labels[0] == "ar" and labels[-1] == "hf_assisted"
    for spec in specs[1:-1]:
        method = spec.method()
        for protocol, budget in where[spec.label]:
            if protocol == "fixed_nodes":
                assert method.max_draft_tokens <= budget
    for depth in (2, 3, 4, 5):  # fixed_depth: every method once per depth, all `depth` deep
        at_depth = [s for s in specs[1:-1] if ("fixed_depth", None) in where[s.label] and s.method().depth == depth]
        assert sorted(s.name for s in at_depth) == ["rsd_c", "rsd_s", "sd", "specinfer", "spectr"]
    for budget in (6, 10, 14, 21, 30):  # fixed_nodes: every method competes in every budget
        names = {s.name for s in specs[1:-1] if ("fixed_nodes", budget) in where[s.label]}
        assert names == {"sd", "specinfer", "spectr", "rsd_c", "rsd_s"}
    assert ("fixed_nodes", 10) in where["rsd_c:2,2,1"] and ("fixed_depth", None) in where["rsd_c:2,2,1"]
    with pytest.raises(ValueError):
        fixed_nodes_specs(7)


def test_bench_protocol_run_marks_best_and_plots(tmp_path):
    draft_dir, target_dir = build_tiny_pair(tmp_path / "models", "llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w4"}\n')
    argv = ["--draft", str(draft_dir), "--target", str(target_dir), "--prompts", str(prompts)]
    argv += ["--protocol", "fixed_nodes", "--budgets", "6", "--temperatures", "0", "--max-new-tokens", "6"]
    argv += ["--ignore-eos", "--cost-reps", "1", "--small-batch-linear", "64", "--out-dir", str(tmp_path / "out")]
    assert bench.main([*argv, "--name", "proto"]) == 0
    result = json.loads((tmp_path / "out" / "proto.json").read_text())
    rows = result["rows"]
    ar_rows = [r for r in rows if r["method"] == "ar"]
    assert sorted(r["label"] for r in ar_rows) == ["ar", "ar:plain"]  # the fastest of both is the reference
    fastest = max(ar_rows, key=lambda r: r["tokens_per_s"])
    for r in rows:
        assert r["ar_reference"] == fastest["label"]
        assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / fastest["tokens_per_s"])
        assert r["matches_ar"] is True  # T = 0: small-batch linear and every method keep the greedy output
    budget_rows = [r for r in rows if r["protocol"] == "fixed_nodes"]
    for method in ("sd", "specinfer", "spectr", "rsd_c", "rsd_s"):
        group = [r for r in budget_rows if r["method"] == method]
        assert group and all(r["budget"] == 6 for r in group)
        assert sum(r["best"] for r in group) == 1
        assert max(group, key=lambda r: r["block_efficiency"])["best"]
    md = (tmp_path / "out" / "proto.md").read_text()
    assert "### Block efficiency at a fixed target budget" in md and "**best**" in md
    for png in ("proto-block-efficiency.png", "proto-tokens-per-s.png"):
        assert (tmp_path / "out" / png).read_bytes().startswith(b"\x89PNG")


def test_bench_gives_each_model_its_dtype_and_runs_ar_in_another(tmp_path):
    draft_dir, target_dir = build_tiny_pair(tmp_path / "models", "llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w4"}\n')
    argv = ["--draft", str(draft_dir), "--target", str(target_dir), "--prompts", str(prompts), "--no-plots"]
    argv += ["--config", "ar;rsd_s:2x2", "--temperatures", "0,1", "--max-new-tokens", "6", "--ignore-eos"]
    argv += ["--cost-reps", "1", "--draft-dtype", "bfloat16", "--ar-dtype", "bfloat16", "--out-dir", str(tmp_path)]
    assert bench.main([*argv, "--name", "dtypes"]) == 0
    result = json.loads((tmp_path / "dtypes.json").read_text())
    assert result["models"]["target"]["dtype"] == "float32" and result["models"]["draft"]["dtype"] == "bfloat16"
    assert result["settings"]["order"].startswith("for each prompt, for each temperature")
    rows = {(r["label"], r["temperature"]): r for r in result["rows"]}
    assert set(rows) == {(label, t) for label in ("ar", "ar:bfloat16", "rsd_s:2x2") for t in (0.0, 1.0)}
    assert rows[("rsd_s:2x2", 0.0)]["matches_ar"] is True  # against the fp32 target it verifies with
    assert rows[("ar:bfloat16", 0.0)]["matches_ar"] is None  # another target: not compared
    with pytest.raises(SystemExit, match="target's own dtype"):
        bench.main([*argv[:-2], "--ar-dtype", "float32", "--out-dir", str(tmp_path)])


def test_bench_runs_and_records_the_verification(tmp_path):
    """--verification reaches every speculative run and its row (ar's says None); at T = 0 the rows still equal
    the target's greedy output. A method the rule is not exact for is refused before anything loads."""
    draft_dir, target_dir = build_tiny_pair(tmp_path / "models", "llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w4"}\n')
    argv = ["--draft", str(draft_dir), "--target", str(target_dir), "--prompts", str(prompts), "--no-plots"]
    argv += ["--temperatures", "0,1", "--max-new-tokens", "6", "--ignore-eos", "--cost-reps", "1"]
    argv += ["--out-dir", str(tmp_path), "--verification", "block"]
    assert bench.main([*argv, "--config", "ar;sd:3;rsd_s:1x3", "--name", "block"]) == 0
    rows = {(r["label"], r["temperature"]): r for r in json.loads((tmp_path / "block.json").read_text())["rows"]}
    assert {label: r["verification"] for (label, _), r in rows.items()} == {
        "ar": None,
        "sd:3": "block",
        "rsd_s:1x3": "block",
    }
    assert rows[("sd:3", 0.0)]["matches_ar"] is rows[("rsd_s:1x3", 0.0)]["matches_ar"] is True
    with pytest.raises(SystemExit, match="--verification block: rsd_c:2,1: block verification is exact for one chain"):
        bench.main([*argv, "--config", "ar;rsd_c:2,1", "--name", "refused"])

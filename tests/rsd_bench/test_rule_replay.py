"""rsd_bench.rule_replay on the tiny pair: every rule replayed on the trees the run drafted, the run's own output
unchanged by the replay, and the result's schema."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd_bench import rule_replay
from rsd_bench.index import headline
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import load_model
from rsd_runtime.runner import ModelRunner
from rsd_tools.tiny import build_tiny_pair


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("models"), "qwen2")


def test_replay_leaves_the_output_and_replays_every_tree(tiny_pair):
    draft_dir, target_dir = tiny_pair
    draft, target = load_model(draft_dir), load_model(target_dir)
    prompt, method = [3, 9, 4, 7], Method.parse("rsd_c", "2,2")
    plain = SpeculativeGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    want = plain.generate(prompt, method, SamplingParams(temperature=1.0), 12, (), seed=5)
    gen = rule_replay.ReplayGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    replays, stats = gen.replay(prompt, method, 1.0, 12, (), seed=5)
    assert gen.generate(prompt, method, SamplingParams(temperature=1.0), 12, (), seed=5).token_ids == want.token_ids
    assert len(replays) == stats.target_calls == want.stats.target_calls
    for law in replays:
        assert set(law) == {"token", "traversal"}
        assert all(len(p) == 3 and abs(sum(p) - 1) < 1e-9 for p in law.values())


def test_coupled_run_records_what_each_step_accepted(tiny_pair):
    draft_dir, target_dir = tiny_pair
    draft, target = load_model(draft_dir), load_model(target_dir)
    prompt, method = [3, 9, 4, 7], Method.parse("rsd_s", "2x2")
    plain = SpeculativeGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    want = plain.generate(prompt, method, SamplingParams(temperature=1.0), 12, (), seed=5, verification="coupled")
    gen = rule_replay.ReplayGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    realised = gen.coupled(prompt, method, 1.0, 12, (), seed=5)
    assert len(realised) == want.stats.target_calls and sum(realised) == sum(want.stats.accepted_by_depth)
    assert gen.verifier.replays == []  # nothing replayed on the coupled rule's trees
    assert rule_replay.runs_coupled(method) and not rule_replay.runs_coupled(Method.parse("spectr", "2x2"))


def test_coupled_row_is_unpaired():
    laws = [{"token": [0.5, 0.5]}, {"token": [1.0, 0.0]}]
    cell = {"method": "rsd_c", "shape": "2", "temperature": 1.0, "verifications": ["token"], "rules": {"token": "rrs"}}
    cell |= {"steps": [{"prompt": 0, "law": x} for x in laws]}
    cell["coupled"] = [{"prompt": 0, "accepted": 1}, {"prompt": 0, "accepted": 0}, {"prompt": 1, "accepted": 1}]
    _, coupled = rule_replay.cell_rows(cell)
    assert coupled["verification"] == "coupled" and coupled["realised"] and coupled["steps"] == 3
    assert abs(coupled["accepted"] - 2 / 3) < 1e-5 and abs(coupled["vs_token"] - (2 / 3 - 0.25)) < 1e-5
    assert coupled["survival"] == [round(2 / 3, 5)] and coupled["steps_above_token"] is None
    lo, hi = coupled["vs_token_ci95"]
    assert lo < coupled["vs_token"] < hi


def test_verifications_per_method():
    assert rule_replay.verifications(Method.parse("sd", "4")) == ["token", "traversal", "block"]
    assert rule_replay.verifications(Method.parse("rsd_s", "2x3")) == ["token", "traversal"]


def test_cell_rows_pair_the_rules_step_by_step():
    laws = [{"token": [0.5, 0.5], "traversal": [0.25, 0.75]}, {"token": [1.0, 0.0], "traversal": [1.0, 0.0]}]
    cell = {"method": "rsd_c", "shape": "2", "temperature": 1.0, "verifications": ["token", "traversal"]}
    cell |= {"rules": {"token": "rrs", "traversal": "traversal"}, "steps": [{"prompt": 0, "law": x} for x in laws]}
    token, traversal = rule_replay.cell_rows(cell)
    assert token["accepted"] == 0.25 and traversal["accepted"] == 0.375
    assert traversal["vs_token"] == 0.125 and traversal["vs_token_pct"] == 50.0
    assert (traversal["steps_above_token"], traversal["steps_below_token"]) == (1, 0)
    assert traversal["survival"] == [0.375] and token["vs_token_ci95"] == [0.0, 0.0]


def test_bench_tiny_writes_the_result(tiny_pair, tmp_path):
    draft_dir, target_dir = tiny_pair
    argv = ["--draft", str(draft_dir), "--target", str(target_dir), "--numeric", "exact", "--quick"]
    argv += ["--methods", "sd:3;spectr:2x2", "--temperatures", "1", "--num-prompts", "2", "--max-new-tokens", "8"]
    assert rule_replay.main([*argv, "--out-dir", str(tmp_path), "--name", "tiny"]) == 0
    result = json.loads((tmp_path / "tiny.json").read_text())
    assert result["benchmark"] == "rule_replay" and result["complete"] and result["machine"]["cpu_flags"] is not None
    by = {(r["method"], r["verification"]): r for r in result["rows"]}
    sd = (("sd", v) for v in ("token", "traversal", "block", "coupled"))  # coupled: its own run (realised)
    spectr = (("spectr", v) for v in ("token", "traversal"))
    assert set(by) == {*sd, *spectr}
    assert by[("spectr", "token")]["rule"] == "kseq"
    assert by[("spectr", "traversal")]["rule"] == "traversal_with_replacement"
    # on a chain block verification is Traversal Verification (rsd.traversal): the same law on every tree
    assert by[("sd", "block")]["accepted"] == pytest.approx(by[("sd", "traversal")]["accepted"], abs=1e-9)
    cell = result["cells"][0]
    assert len(cell["step_prompt"]) == cell["steps"] == by[("sd", "token")]["steps"]
    assert by[("sd", "coupled")]["realised"] and sum(cell["coupled_accepted"]) >= 0
    assert "best rule vs token" in headline(result)
    assert (tmp_path / "tiny.md").read_text().startswith("# tiny")


def test_bench_refuses_temperature_zero():
    with pytest.raises(SystemExit, match="greedy matching"):
        rule_replay.main(["--temperatures", "0,1"])

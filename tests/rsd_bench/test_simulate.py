"""The network simulator (rsd_bench.simulate) against its closed forms, and its command on a small result."""

import json

import pytest

from rsd_bench.simulate import Pool, Site, check_rows, main, simulate

# A horizon that is a whole number of steps in every case below, so that no step is cut off mid-way.
DURATION = 60_000.0


def test_one_session_no_delay_is_tokens_over_draft_plus_verify():
    out = simulate([Site(draft_ms=10, tokens_per_step=3)], Pool(verify_ms=20), DURATION)
    assert out.tokens_per_s == pytest.approx(1000 * 3 / (10 + 20), rel=1e-3)
    assert out.utilisation == pytest.approx(20 / 30, rel=1e-3)


def test_the_round_trip_adds_to_every_step():
    out = simulate([Site(one_way_ms=25, draft_ms=10, tokens_per_step=3)], Pool(verify_ms=20), DURATION)
    assert out.tokens_per_s == pytest.approx(1000 * 3 / (10 + 50 + 20), rel=1e-3)


def test_every_tree_pre_drafted_hides_the_draft_in_the_wait():
    site = Site(one_way_ms=25, draft_ms=10, predraft_hit_rate=1.0, tokens_per_step=3)
    out = simulate([site], Pool(verify_ms=20), DURATION)
    assert out.tokens_per_s == pytest.approx(1000 * 3 / (50 + 20), rel=2e-3)  # the first draft is paid once


def test_sessions_started_together_stay_in_one_batch():
    sites, pool = [Site(draft_ms=10, tokens_per_step=2)] * 8, Pool(verify_ms=20, verify_ms_per_session=5)
    out = simulate(sites, pool, DURATION)
    assert out.mean_batch == 8
    assert out.tokens_per_s == pytest.approx(1000 * 8 * 2 / (10 + 20 + 5 * 7), rel=2e-3)


def test_drafts_queued_for_one_shared_device_bound_by_the_busier_of_drafter_and_verifier():
    sites = [Site(draft_ms=30, tokens_per_step=2)] * 2  # the drafter busy all the time: a tree every 30 ms
    out = simulate(sites, Pool(verify_ms=10), DURATION, draft_devices=1)
    assert out.tokens_per_s == pytest.approx(1000 * 2 / 30, rel=2e-3) and out.mean_batch == 1
    sites = [Site(draft_ms=10, tokens_per_step=2)] * 2  # the verifier busy all the time, one tree at a time
    out = simulate(sites, Pool(verify_ms=20), DURATION, draft_devices=1)
    assert out.tokens_per_s == pytest.approx(1000 * 2 / 20, rel=2e-3) and out.mean_batch == 1


def test_more_replicas_serve_more_sessions_and_drawn_acceptance_averages_out():
    sites = [Site(one_way_ms=50, draft_ms=40, p=0.7, depth=4)] * 64
    one, four = (simulate(sites, Pool(r, 30, 4, max_batch=16), 20_000) for r in (1, 4))
    assert four.tokens_per_s > one.tokens_per_s and one.utilisation > four.utilisation
    single = simulate([Site(draft_ms=10, p=0.5, depth=3)], Pool(verify_ms=10), 200_000, seed=1)
    expected = 1 + 0.5 + 0.25 + 0.125  # tokens per step
    assert single.tokens / single.steps == pytest.approx(expected, rel=0.03)


def _net_row(delay, pipelined, split, hit=0.0):
    return {"delay_ms": delay, "method": "sd", "shape": "4", "temperature": 0.0, "pipelined": pipelined,
            "block_efficiency": 3.0, "predraft_hit_rate": hit, "split": split}  # fmt: skip


def test_calibrated_on_the_plain_row_predicts_the_delayed_ones(tmp_path):
    base = {"draft_ms": 10.0, "transfer_ms": 2.0, "verify_ms": 20.0, "step_ms": 32.0}
    delayed = {"draft_ms": 10.0, "transfer_ms": 52.0, "verify_ms": 20.0, "step_ms": 82.0}
    hidden = {"draft_ms": 0.0, "transfer_ms": 52.0, "verify_ms": 20.0, "step_ms": 72.0}
    result = {"rows": [_net_row(0, False, base), _net_row(25, False, delayed), _net_row(25, True, hidden, 1.0)]}
    rows = check_rows(result)
    assert [abs(r["error"]) < 0.01 for r in rows] == [True, True, True]
    (tmp_path / "net.json").write_text(json.dumps(result))
    argv = ["--calibrate", str(tmp_path / "net.json"), "--sessions", "20", "--out-dir", str(tmp_path)]
    argv += ["--shape-delays", "0,200", "--controller-steps", "300", "--max-depth", "6"]
    assert main([*argv, "--name", "sim", "--duration-ms", "5000"]) == 0
    sim = json.loads((tmp_path / "sim.json").read_text())
    assert sim["sizing"]["replicas"] >= 1 and len(sim["check"]) == 3 and (tmp_path / "sim.md").exists()
    near, far = sim["shapes"]["rows"]  # a longer round trip buys a deeper tree
    assert int(far["best_shape"].split("x")[1]) > int(near["best_shape"].split("x")[1])

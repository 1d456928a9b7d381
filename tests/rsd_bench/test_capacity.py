"""The capacity benchmark (rsd_bench.capacity): its command end to end on the tiny pair (real services, the
verifier behind the delay relay, N drafters each with its gateway), and its comparisons on synthetic
records: the verify fit, the formula, the clients at a rate and the simulator against its closed form."""

import json

import pytest

from rsd_bench import capacity


def test_tiny_run_writes_every_field(tmp_path):
    argv = ["--tiny", "--clients", "1,2", "--num-prompts", "2", "--max-new-tokens", "6", "--delay-ms", "5"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path), "--name", "c", "--sim-steps", "200"]
    assert capacity.main(argv) == 0
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["complete"] is True and result["benchmark"] == "capacity" and (tmp_path / "c.md").exists()
    assert "relay" in result["network"]["emulation"] and "compete" in result["placement"]["note"]
    rows = result["rows"]
    assert [r["clients"] for r in rows] == [1, 2]
    assert [len(r["per_client_tokens_per_s"]) for r in rows] == [1, 2]
    assert all(r["matches_ar"] for r in rows)  # T = 0: every client's every prompt is the target's
    assert rows[0]["mean_batch_sessions"] == 1 and 1 <= rows[1]["mean_batch_sessions"] <= 2
    assert all(int(b) <= r["clients"] for r in rows for b in r["verify_ms_by_batch"])
    assert rows[0]["draft_nodes_per_step"] <= 4  # sd:4, fewer where the draft would run past max_new_tokens
    assert [s["clients"] for s in result["simulator"]["rows"]] == [1, 2]
    assert result["formula"]["clients_per_verifier"] > 1
    assert result["clients_at_rate"]["target_alone"] == 2  # the default rate: half the target alone's
    # the comparisons come from the rows alone: recomputed from the record, they are the run's
    argv = ["--recompute", str(tmp_path / "c.json"), "--out-dir", str(tmp_path), "--name", "c2", "--sim-steps", "200"]
    assert capacity.main(argv) == 0
    again = json.loads((tmp_path / "c2.json").read_text())
    keys = ("clients_at_rate", "formula", "simulator", "commit")
    assert {k: again[k] for k in keys} == {k: result[k] for k in keys}


def _row(n: int, draft_ms: float, verify: dict, be: float, steady: float, tps: float, per_client: list) -> dict:
    return {
        "clients": n,
        "split": {"draft_ms": draft_ms, "transfer_ms": 20.0, "queue_ms": 0.0, "verify_ms": verify[1][0]},
        "verify_ms_by_batch": {str(b): v for b, v in verify.items()},
        "block_efficiency": be,
        "draft_nodes_per_step": 4.0,
        "steady_tokens_per_s_per_verifier": steady,
        "tokens_per_s_per_verifier": tps,
        "min_client_tokens_per_s": min(per_client),
    }


RECORD = {
    "batch_wait_ms": 2.0,
    "placement": {"drafter_cores": "0"},
    "rows": [  # verify = 200 ms + 60 ms per more session, exactly
        _row(1, 100.0, {1: [200.0, 10]}, 2.0, 6.0, 6.0, [6.0]),
        _row(2, 140.0, {1: [200.0, 5], 2: [260.0, 10]}, 2.5, 10.0, 9.0, [4.0, 5.0]),
    ],
}


def test_verify_fit_and_the_simulator_against_the_closed_form():
    assert capacity.fit_verify(RECORD["rows"]) == pytest.approx((200.0, 60.0))
    check = capacity.simulator_check(RECORD, steps=2000)
    assert check["verify_ms"] == pytest.approx(200) and check["verify_ms_per_session"] == pytest.approx(60)
    # N identical sessions started together stay in one batch: N * tokens a step / (draft + round trip +
    # batch wait + verify of N), the N = 1 run's draft (100 ms) and transfer (20 ms), each N's block efficiency
    for r, n, be, own_draft in zip(check["rows"], (1, 2), (2.0, 2.5), (100.0, 140.0), strict=True):
        closed = 1000 * n * be / (100 + 20 + 2 + 200 + 60 * (n - 1))
        own = 1000 * n * be / (own_draft + 20 + 2 + 200 + 60 * (n - 1))
        measured = RECORD["rows"][n - 1]["steady_tokens_per_s_per_verifier"]
        assert r["predicted_tokens_per_s"] == pytest.approx(closed, rel=2e-3)
        assert r["predicted_own_draft_tokens_per_s"] == pytest.approx(own, rel=2e-3)
        # drafts queued for one core: two sessions' 100 ms drafts fit in the other's 200 ms verification,
        # which then never batches two trees: the verifier bounds, one tree at a time
        shared = closed if n == 1 else 1000 * be / 200
        assert r["predicted_shared_drafter_tokens_per_s"] == pytest.approx(shared, rel=2e-3)
        assert r["error"] == pytest.approx(r["predicted_tokens_per_s"] / measured - 1, abs=1e-3)


def test_formula_and_clients_at_a_rate():
    f = capacity.formula(RECORD["rows"])
    assert f["t_d_ms"] == 25 and f["t_v_ms"] == 200  # 100 ms over gamma = 4 nodes
    assert f["clients_per_verifier"] == pytest.approx(1 + 100 / 200)
    assert f["clients_per_verifier_with_round_trip"] == pytest.approx(1 + 120 / 200)
    assert f["measured_sessions_at_single_speed"] == {"1": 1.0, "2": 1.5}  # 9 tok/s / the single client's 6
    c = capacity.clients_served(RECORD["rows"], ar_tokens_per_s=5.0, rate=4.0)
    assert c["measured"] == 2 and c["at_least"] and c["target_alone"] == 1 and c["ratio_vs_target_alone"] == 2
    assert c["throughput_bound"] == 2  # floor(9 / 4)
    assert capacity.clients_served(RECORD["rows"], 5.0, 7.0)["measured"] == 0  # no N gave every client 7

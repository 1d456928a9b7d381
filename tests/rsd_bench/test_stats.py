"""rsd_bench.stats: the bootstrap interval of block efficiency and the per-step token counts."""

import pytest

from rsd_bench.methods import compare
from rsd_bench.methods.planning import only_methods, plan
from rsd_bench.stats import bootstrap_interval, step_tokens


def test_bootstrap_interval_is_seeded_and_brackets_the_mean():
    steps = [1, 2, 3, 4, 5, 1, 1, 6] * 20
    lo, hi = bootstrap_interval(steps, 1000)
    assert lo < sum(steps) / len(steps) < hi
    assert bootstrap_interval(steps, 1000) == [lo, hi]  # fixed seed: the same interval every time
    assert bootstrap_interval([3] * 5, 100) == [3, 3]
    wide, narrow = bootstrap_interval(steps[:16], 1000), bootstrap_interval(steps * 10, 1000)
    assert wide[1] - wide[0] > narrow[1] - narrow[0]


def test_step_tokens_cut_the_last_steps_to_the_kept_tokens():
    assert step_tokens([3, 4, 5], 12) == [3, 4, 5]
    assert step_tokens([3, 4, 5], 9) == [3, 4, 2]  # max-new-tokens cut the last step
    assert step_tokens([3, 4], 3) == [3, 0]


def test_only_keeps_the_named_methods_of_a_protocol():
    specs, _ = plan("fixed_depth", [2, 5], [])
    assert [s.label for s in only_methods(specs, "spectr, rsd_s")] == [
        "spectr:3x2",
        "rsd_s:3x2",
        "spectr:3x5",
        "rsd_s:3x5",
    ]
    with pytest.raises(ValueError):
        only_methods(specs, "beam")


def _row(method: str, depth: int, steps_by_prompt: dict, accepted: list, tried: list) -> dict:
    calls = sum(len(s) for s in steps_by_prompt.values())
    tokens = sum(sum(s) for s in steps_by_prompt.values())
    return {
        "method": method,
        "shape": f"3x{depth}",
        "depth": depth,
        "temperature": 1.0,
        "protocol": "fixed_depth",
        "block_efficiency": tokens / calls,
        "target_calls": calls,
        "accepted_by_depth": accepted,
        "tried_by_depth": tried,
        "outputs": [{"prompt": p, "step_tokens": s} for p, s in steps_by_prompt.items()],
    }


def test_compare_reports_both_intervals_and_truncated_paths():
    # depth 2: a ends once at a full-depth bonus twice, a leaf at depth 1 (truncated) and a rejection at depth 0;
    # b at a full-depth bonus three times and a rejection at depth 0
    a = _row("spectr", 2, {0: [3, 2], 1: [3, 1]}, accepted=[3, 2], tried=[4, 2])
    b = _row("rsd_s", 2, {0: [3, 3], 1: [3, 1]}, accepted=[3, 3], tried=[4, 3])
    assert compare.leaf_above_depth(a) == 0.25 and compare.leaf_above_depth(b) == 0.0
    lines = compare.compare({"rows": [a, b]}, "spectr", "rsd_s", 1.0)
    assert len(lines) == 3 and lines[2].startswith("| 2 | 2.25 (3x2) | 2.50 (3x2) | -0.25 |")
    lo, hi = compare.difference_interval([3] * 4, [1, 2, 3, 3])
    assert 0 <= lo <= 0.75 <= hi <= 2
    assert compare.prompt_interval({0: [3], 1: [3]}, {0: [1], 1: [3]}) == [0.0, 2.0]

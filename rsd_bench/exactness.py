"""Exactness by enumeration: the largest gap between each method's exact one-step law and the target's law,
per corner case, float64; prints it and writes benchmarks/results/exactness.md (`rsd bench exactness`).

It replays the test suite's own cases and enumerators (tests/rsd/test_acceptance.py, tests/fixtures/toy.py),
so the report and the tests cannot drift apart; it runs from a source checkout, where tests/ is.
"""

import argparse

from rsd.acceptance import RULES
from rsd_tools.defaults import RESULTS_DIR
from tests.fixtures import toy
from tests.rsd.test_acceptance import (
    CASES,
    METHODS,
    STOP,
    WOR,
    V,
    children_sorted_by_token,
    law_gap,
    unsure_nodes_dropped,
)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m rsd_bench.exactness", description=__doc__.split("\n")[0]).parse_args(argv)
    lines = [
        "# Exactness by enumeration",
        "",
        f"max |P_spec(first L+1 tokens) - P_target| over all sequences, V={V}, float64 "
        "(`python -m rsd_bench.exactness`; test threshold 1e-9).",
        "",
        "| method | rule | " + " | ".join(CASES) + " |",
        "| --- | --- | " + " | ".join("---" for _ in CASES) + " |",
    ]
    for method, (_, rule, _) in METHODS.items():
        gaps = [law_gap(method, *CASES[case]()) for case in CASES]
        lines.append(f"| {method} | {rule} | " + " | ".join(f"{g:.1e}" for g in gaps) + " |")
    draft, target = CASES["random"]()
    wrong_rule = law_gap("rsd_c_2x2", draft, target, rule="rrs_with_replacement")
    trees = [(children_sorted_by_token(t), p) for t, p in toy.branching_tree_law(draft, V, [3, 1], WOR)]
    wrong_order = toy.max_abs_diff(toy.speculative_law(trees, target, RULES["rrs"], 3), toy.extend((), target, 3))
    dropped = unsure_nodes_dropped(toy.branching_tree_law(draft, V, [2, 2], WOR), STOP)
    wrong_stop = toy.max_abs_diff(toy.speculative_law(dropped, target, RULES["rrs"], 3), toy.extend((), target, 3))
    lines += [
        "",
        f"`*_stop`: the confidence stop of rsd.drafting at tau = {STOP} (the strategy's trees cut where the draft "
        "was unsure; RSD-S per level). RSD-S at depth 3 with the stop is checked on the random case in "
        "`test_confidence_stop_rsd_s_three_levels`.",
        "",
        "Negative controls (must be large):",
        f"- RSD-C 2x2 drafts verified with the with-replacement rule: {wrong_rule:.3f}",
        f"- RSD-C 3x1 siblings re-sorted by token id before RRS: {wrong_order:.3f}",
        f"- RSD-C 2x2 with a wrong stop that drops unsure siblings instead of not expanding them: {wrong_stop:.3f}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "exactness.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

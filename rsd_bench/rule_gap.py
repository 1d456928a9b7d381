"""Each verification rule against the optimum, on toy laws: expected accepted draft tokens per step, exactly.

    python -m rsd_bench.rule_gap            # writes benchmarks/results/rule-gap-toy.json and .md (~15 min)

For every tree shape (V <= 8, depth <= 3) and temperature, on the toy pair of rsd_bench.spectr_rsd_toy:

- each rule's E[accepted]: every tree the strategy can draft with its probability (tests.fixtures.toy, as in
  the exactness proofs) times the exact law of what the rule emits on it (rsd.acceptance.step_law);
- the optimum over every exact rule, by linear program (scipy's HiGHS; `optimal_accepted` states it): the
  emissions a rule makes on each tree, constrained so that emitted tokens followed by target sampling have the
  target's law. At depth 1 it is Hu et al.'s LP (ICLR 2025, arXiv 2502.18779) for the optimal multi-draft
  acceptance rate. It lets a rule read the target's laws anywhere (as Hu et al.'s does), so deeper it is the
  optimum of that wider class: an upper bound for rules that see only the tree's laws, reached on chains by
  Traversal Verification (tests/rsd_bench/test_rule_gap.py);
- first level: P(at least one token accepted) against Hu et al.'s optimum for the root's children alone;
- the coupled rule (rsd.coupled) for sd and rsd_c, exactly too (`coupled_accepted`): it accepts along the path of
  the target's own Gumbel-max samples while each is among its node's Gumbel-Top-K children, and the noise of
  each depth is independent, so E[accepted] sums over paths products of one-node match probabilities, each a
  closed-form integral (`coupled_match`). Not for rsd_s, whose beams share a depth's noise across parents.

Averaged over `--contexts` root contexts (each its own laws). Exact up to the LP solver's tolerance (1e-7).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from rsd.acceptance import step_law
from rsd.drafting import DraftMode
from rsd.methods import Method
from rsd_bench.machine import machine_info, run_record, write_result
from rsd_bench.spectr_rsd_toy import at_context, pair
from rsd_tools.defaults import RESULTS_DIR
from tests.fixtures import toy

# (vocab, method, shape): the trees the methods draft, small enough to enumerate
SHAPES = (
    (4, "sd", "3"),
    (4, "rsd_c", "2,2"),
    (4, "rsd_c", "3,1"),
    (4, "rsd_s", "2x2"),
    (4, "specinfer", "2,2"),
    (4, "spectr", "2x2"),
    (8, "sd", "2"),
    (8, "rsd_c", "3"),
    (8, "specinfer", "3"),
    (8, "spectr", "3x1"),
)
TEMPERATURES = (0.6, 1.0, 1.5)
SCALE, SIGMA = 2.5, 1.0  # the toy pair: target logits s N(0, 1), draft logits + sigma N(0, 1) (spectr_rsd_toy)


def tree_law(method: Method, draft, vocab: int) -> list:
    """Every tree `method` drafts at T > 0, with its probability."""
    if method.name == "rsd_s":
        return toy.sbs_tree_law(draft, vocab, method.beam_width, method.depth)
    mode = DraftMode.IID if method.name in ("specinfer", "spectr") else DraftMode.WITHOUT_REPLACEMENT
    return toy.branching_tree_law(draft, vocab, list(method.branching), mode)


def rule_figures(trees: list, target, rule) -> tuple[float, float]:
    """(E[accepted draft tokens], P(at least one accepted)) of `rule` over the tree law, exactly."""
    accepted = first = 0.0
    for tree, p_tree in trees:
        for emitted, p in step_law(tree, toy.target_probs_for(tree, target), rule).items():
            accepted += p_tree * p * (len(emitted) - 1)
            first += p_tree * p * (len(emitted) > 1)
    return accepted, first


def coupled_match(q: torch.Tensor, p: torch.Tensor, k: int, y: int) -> float:
    """P(y = argmax_v log q(v) + G(v) and y among the top k of log p(v) + G(v) over p's support), G i.i.d. Gumbel.

    Condition on G(y) = g and write u = exp(-exp(-g)) (uniform on (0, 1)). Another token v keeps y the target's
    argmax iff G(v) < g + log(q_y / q_v), probability u^(q_v / q_y), and outranks y in the draft's keys iff
    G(v) > g + log(p_y / p_v), probability 1 - u^(p_v / p_y). So v is "below y for q, above y for p" with
    probability u^a - u^b (a = q_v / q_y < b = p_v / p_y, else 0) and "below y for both" with u^max(a, b). Sum over
    the sets B of fewer than k tokens above y for p, expand the products into powers u^c, and integrate:
    the integral of u^c over (0, 1) is 1 / (c + 1). Exact, no quadrature."""
    q_y, p_y = float(q[y]), float(p[y])
    if q_y == 0 or p_y == 0:
        return 0.0
    others = []  # per v != y: (a, b) or None where v can never outrank y for p
    for v in range(q.shape[0]):
        if v == y:
            continue
        a = float(q[v]) / q_y
        others.append((a, float(p[v]) / p_y if p[v] > 0 else None))
    total = 0.0
    for size in range(k):
        for above in itertools.combinations(range(len(others)), size):
            if any(others[i][1] is None or others[i][0] >= others[i][1] for i in above):
                continue  # this v cannot be below y for q and above it for p at once
            base = sum(max(a, b) if b is not None else a for i, (a, b) in enumerate(others) if i not in above)
            terms = [(base, 1.0)]  # (exponent, coefficient) of the expanded product
            for i in above:
                a, b = others[i]
                terms = [(c + e, w * s) for c, w in terms for e, s in ((a, 1.0), (b, -1.0))]
            total += sum(w / (c + 1) for c, w in terms)
    return total


def coupled_accepted(method: Method, draft, target, vocab: int) -> tuple[float, float]:
    """(E[accepted draft tokens], P(at least one accepted)) of the coupled rule on `method`'s trees (sd, rsd_c)."""
    if method.name not in ("sd", "rsd_c"):
        raise ValueError("exact here for sd and rsd_c only: rsd_s's beams share a depth's noise across parents")

    def reach(prefix: tuple[int, ...], depth: int) -> float:  # E[accepted below `prefix`, given it is accepted]
        if depth == method.depth:
            return 0.0
        q, p = target(prefix), draft(prefix)
        k = min(method.branching[depth], int((p > 0).sum()))
        return sum(
            m * (1.0 + reach((*prefix, y), depth + 1)) for y in range(vocab) if (m := coupled_match(q, p, k, y)) > 0
        )

    q, p = target(()), draft(())
    first = sum(coupled_match(q, p, min(method.branching[0], int((p > 0).sum())), y) for y in range(vocab))
    return reach((), 0), first


def _paths(tree) -> list[tuple[int, ...]]:
    """The tree's root paths, () included: what a rule may accept."""
    return sorted({toy.path_tokens(tree.token_ids, tree.parent_idx, n) for n in range(tree.num_nodes)})


def tree_classes(trees: list) -> dict[tuple, float]:
    """The tree law by set of paths (sibling order and repeats change nothing a rule may emit)."""
    classes: dict[tuple, float] = {}
    for tree, p in trees:
        key = tuple(_paths(tree))
        classes[key] = classes.get(key, 0.0) + p
    return classes


def optimal_accepted(trees: list, target, depth: int, vocab: int) -> float:
    """The largest E[accepted] of any exact one-step rule on this tree law, by linear program.

    A rule is a law pi(T, e) of what it emits on tree T: e = a + (z,), a an accepted path of T and z the next
    token; sum_e pi(T, e) = P(T). Write F(v) for the mass of emissions that start with v and G(u) for those
    that strictly extend u. The output (emission, then target sampling) has the target's law iff at every
    prefix u of length <= L the mass passing on splits as the target does: F(u + (y,)) = q(y | u) G(u) for
    every y (the mass that stopped at or before u continues with q(. | u) by itself). Maximise
    sum pi(T, e) (|e| - 1) under those equalities. At depth 1 this is Hu et al.'s LP (the bonus token follows q).
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    classes = tree_classes(trees)
    prefixes = [u for k in range(depth + 1) for u in itertools.product(range(vocab), repeat=k)]
    row_of = {u: len(classes) + i * vocab for i, u in enumerate(prefixes)}  # rows (u, 0..V-1)
    rows, cols, vals, gain = [], [], [], []
    for i, paths in enumerate(classes):
        for a in paths:
            for z in range(vocab):
                e, var = (*a, z), len(gain)
                gain.append(len(a))
                rows.append(i), cols.append(var), vals.append(1.0)  # sum_e pi(T, e) = P(T)
                for k in range(len(e)):  # e strictly extends u = e[:k] and starts with u + (e[k],)
                    q_u = target(e[:k])
                    for y in range(vocab):
                        coef = float(y == e[k]) - float(q_u[y])
                        if coef != 0:
                            rows.append(row_of[e[:k]] + y), cols.append(var), vals.append(coef)
    num_rows = len(classes) + len(prefixes) * vocab
    a_eq = coo_matrix((vals, (rows, cols)), shape=(num_rows, len(gain))).tocsr()
    b_eq = list(classes.values()) + [0.0] * (num_rows - len(classes))
    res = linprog([-g for g in gain], A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"the LP failed: {res.message}")
    return -float(res.fun)


def optimal_first_level(trees: list, target) -> float:
    """Hu et al.'s optimal acceptance rate: max P(y in the root's children) over couplings of their set's law
    with y ~ q at the root, a transport problem."""
    classes: dict[frozenset, float] = {}
    for paths, p in tree_classes(trees).items():
        key = frozenset(path for path in paths if len(path) == 1)
        classes[key] = classes.get(key, 0.0) + p
    q = target(())
    ys = q.nonzero().flatten().tolist()
    gain = [[float((y,) in children) for y in ys] for children in classes]
    return transport_max(list(classes.values()), [float(q[y]) for y in ys], gain)


def transport_max(a: list[float], b: list[float], gain: list[list[float]]) -> float:
    """max sum gain[i][j] x_ij over x >= 0 with row sums a and column sums b (scipy's HiGHS)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    m, n = len(a), len(b)
    rows = [i for i in range(m) for _ in range(n)] + [m + j for _ in range(m) for j in range(n - 1)]
    cols = list(range(m * n)) + [i * n + j for i in range(m) for j in range(n - 1)]
    a_eq = coo_matrix(([1.0] * len(rows), (rows, cols)), shape=(m + n - 1, m * n))  # the last column sum follows
    sa, sb = sum(a), sum(b)
    b_eq = [x / sa for x in a] + [x / sb for x in b[:-1]]
    res = linprog([-g for row in gain for g in row], A_eq=a_eq.tocsr(), b_eq=b_eq, bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"the transport LP failed: {res.message}")
    return -float(res.fun)


def measure(vocab: int, name: str, shape: str, temperature: float, contexts: int) -> list[dict]:
    method = Method.parse(name, shape)
    rules = ["token", "traversal"] + (["block"] if method.max_draft_tokens == method.depth else [])
    rules += ["coupled"] if name in ("sd", "rsd_c") else []
    draft, target = pair(vocab, SCALE, SIGMA, temperature)
    sums = {r: [0.0, 0.0] for r in rules}
    bound = first_bound = 0.0
    for c in range(contexts):
        d, t = at_context(draft, c), at_context(target, c)
        trees = tree_law(method, d, vocab)
        for r in rules:
            if r == "coupled":
                acc, first = coupled_accepted(method, d, t, vocab)
            else:
                acc, first = rule_figures(trees, t, method.rule(False, r))
            sums[r][0] += acc / contexts
            sums[r][1] += first / contexts
        bound += optimal_accepted(trees, t, method.depth, vocab) / contexts
        first_bound += optimal_first_level(trees, t) / contexts
    return [
        {
            "vocab": vocab,
            "method": name,
            "shape": shape,
            "depth": method.depth,
            "draft_tokens": method.max_draft_tokens,
            "temperature": temperature,
            "verification": r,
            "rule": method.rule(False, r).name,
            "accepted": round(sums[r][0], 6),
            "bound": round(bound, 6),
            "gap": round(bound - sums[r][0], 6) + 0.0,  # + 0.0: no "-0.0" where the rule reaches the optimum
            "first_level_acceptance": round(sums[r][1], 6),
            "first_level_optimum": round(first_bound, 6),
        }
        for r in rules
    ]


def summary(rows: list[dict]) -> dict[str, float]:
    """Mean gap to the optimum (tokens per step) of each verification, over the cells where it runs."""
    out = {}
    for v in ("token", "traversal", "block", "coupled"):
        gaps = [r["gap"] for r in rows if r["verification"] == v]
        if gaps:
            out[v] = sum(gaps) / len(gaps)
    return out


def markdown(result: dict) -> str:
    cells: dict[tuple, dict] = {}
    for r in result["rows"]:
        cells.setdefault((r["vocab"], r["method"], r["shape"], r["temperature"]), {})[r["verification"]] = r
    lines = [
        "# Verification rules against the optimum, toy laws (expected accepted draft tokens per step)",
        "",
        "`python -m rsd_bench.rule_gap` (rsd_bench/rule_gap.py says how). Exact enumeration of every tree and",
        f"verdict on the toy pair of rsd_bench/spectr_rsd_toy.py (s = {SCALE}, sigma = {SIGMA}), averaged over",
        f"{result['contexts']} root contexts. `optimum`: the largest E[accepted] of any exact rule, by linear program",
        "(Hu et al.'s LP at depth 1). token: the method's rule of today (rrs; rrs_with_replacement for specinfer;",
        "kseq for spectr); traversal: Traversal Verification (its i.i.d. variant for specinfer and spectr); block:",
        "block verification, chains only; coupled: the coupled rule (sd and rsd_c; its own trees, drawn from the",
        "noise it shares, of the same law). `P(acc>=1)`: the first level's acceptance rate, token rule / traversal /",
        "coupled / Hu et al.'s optimum for the root's children.",
        "",
        "| V | method | shape | T | token | traversal | block | coupled | optimum | gap token | gap traversal | "
        "gap coupled | P(acc>=1) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (vocab, method, shape, temperature), by in cells.items():
        tok, trav, block, coupled = by["token"], by["traversal"], by.get("block"), by.get("coupled")
        block_accepted = "-" if block is None else f"{block['accepted']:.4f}"
        firsts = (tok, trav) + ((coupled,) if coupled else ())
        first = " / ".join(f"{r['first_level_acceptance']:.3f}" for r in firsts) + (" / -" if not coupled else "")
        first += f" / {tok['first_level_optimum']:.3f}"
        c_acc, c_gap = ("-", "-") if coupled is None else (f"{coupled['accepted']:.4f}", f"{coupled['gap']:.4f}")
        lines.append(
            f"| {vocab} | {method} | {shape} | {temperature:g} | {tok['accepted']:.4f} | {trav['accepted']:.4f} | "
            f"{block_accepted} | {c_acc} | {tok['bound']:.4f} | {tok['gap']:.4f} | {trav['gap']:.4f} | {c_gap} | "
            f"{first} |"
        )
    mean = summary(result["rows"])
    lines += [
        "",
        "Mean gap to the optimum, tokens per step: "
        + ", ".join(f"{v} {g:.4f}" for v, g in mean.items())
        + " (block: chains only, where it and traversal reach the optimum).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.rule_gap", description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, default=3, help="root contexts averaged per cell")
    ap.add_argument("--quick", action="store_true", help="V = 4 shapes and T = 1 only")
    ap.add_argument("--name", default="rule-gap-toy")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    shapes = [s for s in SHAPES if s[0] == 4] if args.quick else SHAPES
    temperatures = (1.0,) if args.quick else TEMPERATURES
    rows = []
    for (vocab, name, shape), temperature in itertools.product(shapes, temperatures):
        cell = measure(vocab, name, shape, temperature, args.contexts)
        rows += cell
        print(
            f"V={vocab} {name} {shape} T={temperature:g}:",
            *(f"{r['verification']} {r['accepted']:.4f}" for r in cell),
            f"optimum {cell[0]['bound']:.4f}",
            flush=True,
        )
    result = {
        **run_record("rule_gap"),
        "complete": not args.quick,
        "machine": machine_info(),
        "contexts": args.contexts,
        "pair": {"scale": SCALE, "sigma": SIGMA},
        "torch": torch.__version__,
        "rows": rows,
    }
    write_result(args.out_dir, args.name, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

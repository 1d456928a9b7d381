"""`auto`: every step drafts the chain that pays most, from measured costs and the acceptance seen so far, and
the root alone (the target's next token, as plain decoding does) where no chain pays.

Before a step drafts, the policy picks one of three plans:

    plain    the root alone: one verify row, nothing drafted                          1 token
    context  a chain looked up in the text itself (rsd.lookup), grown node by node while each node pays
    model    the draft model's chain of depth up to d in 1..L (sd; the drafter's lookups merged in, --lookup-n),
             grown node by node the same way

A step costs overhead + draft + verify(rows) ms: verify(rows) is learnt per row count (RowCosts, the verifier's
forward time), overhead is the rest of the round trip (transfer, the rule, bookkeeping), draft the drafter's own
time (a draft forward per model level, a look-up per context node). Tokens per ms decide:

    plain    1 / (overhead + verify(1))
    model    expected_tokens(p, d) / (overhead + catch_up + d * draft_level + verify(d + 1))   p: a level's acceptance
    context  1 node at least: (1 + a(t_root)) / (overhead + look_up + verify(2))

and a chain, of either kind, grows from node n (reach r_n: the chance the chain is accepted that far) while the
child's expected tokens pay for its row and its own draft cost at the step's rate so far:

    r_n * a(t_n) / (verify(n + 2) - verify(n + 1) + node_ms)  >=  E[tokens] / E[ms] so far

a(t): the chance a child is accepted when its parent's law has top probability t, learnt per bucket of t and per
kind (the draft model's confidence predicts its acceptance, most at T > 0); node_ms: a look-up (context) or the
draft forward that gives the child its law (model, but for the last level). catch_up: the draft model's extra cost
of the tokens it has not run yet (after plain or context steps), per token, charged up to CATCH_UP_TOKENS of them:
what switching to the model costs (a turn's prompt is paid once by any plan that drafts with the model).

Acceptance is learnt from the verdicts as Beta counts (a node accepted: a success; the first rejected one: a
failure); the model's depth is chosen optimistically (`explore` standard deviations) so an untried depth is tried.

Exactness: the plan is a function of the steps before (their outcomes and measured costs) and of the committed
tokens; the chain gate decides whether a node gets a child from that node's path and law, before the child is
drawn, as the confidence stop does (rsd.drafting). No drawn node is removed, so every rule stays exact for every
plan (tests/rsd/test_auto.py enumerates a gated chain and a plan chosen from a first step's outcome). Seeded
tokens at T > 0 follow the plans, and so the machine's timings, as with adaptive_shape; the coupled rule's seeded
tokens are the target alone's whatever the plan (rsd.coupled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rsd.lookup import continuation
from rsd.methods import Method
from rsd.shape_control import expected_tokens
from rsd.tree import DraftTree

PLAIN, CONTEXT, MODEL = "plain", "context", "model"
TOP_BUCKETS = (0.25, 0.5, 0.75, 1.0)  # a law's top probability t falls in the first bucket with t < edge; 1.0: a
# point mass (one earlier occurrence, or every one followed by the same token), its own bucket
CATCH_UP_TOKENS = 8  # the most tokens a switch to the model is charged for: a longer catch-up (a prompt) pays off
# over the turn, not in one step
PRIOR_WEIGHT = 2.0  # a model bucket's prior: this many pseudo-verdicts at the level acceptance pooled over buckets


def top_bucket(top: float) -> int:
    return next((i for i, edge in enumerate(TOP_BUCKETS) if top < edge), len(TOP_BUCKETS))


@dataclass
class RowCosts:
    """verify(rows) ms: an exponentially weighted mean per row count seen; between two counts seen, the line
    through them; past the largest, its slope continued (flat with one count seen); never falling in rows."""

    decay: float = 0.8
    prior_ms: float = 1.0  # before any verdict: every size costs the same (a tree is tried first)
    means: dict[int, float] = field(default_factory=dict)

    def observe(self, rows: int, ms: float) -> None:
        old = self.means.get(rows)
        self.means[rows] = ms if old is None else self.decay * old + (1 - self.decay) * ms

    def _raw(self, rows: int) -> float:
        if not self.means:
            return self.prior_ms
        if rows in self.means:
            return self.means[rows]
        seen = sorted(self.means)
        below, above = [r for r in seen if r < rows], [r for r in seen if r > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            return self.means[lo] + (self.means[hi] - self.means[lo]) * (rows - lo) / (hi - lo)
        if above:  # below the smallest seen: no cheaper than nothing, no dearer than it
            return self.means[above[0]]
        if len(below) == 1:
            return self.means[below[-1]]
        a, b = below[-2], below[-1]
        return self.means[b] + max(0.0, (self.means[b] - self.means[a]) / (b - a)) * (rows - b)

    def __call__(self, rows: int) -> float:
        return max(self._raw(r) for r in range(1, rows + 1))


def _bucket_counts(prior: float) -> list[list[float]]:
    return [[prior, prior] for _ in range(len(TOP_BUCKETS) + 1)]


def _ewma(old: float | None, new: float, decay: float) -> float:
    return new if old is None else decay * old + (1 - decay) * new


@dataclass(frozen=True)
class Plan:
    kind: str  # PLAIN, CONTEXT or MODEL
    depth: int = 0  # MODEL: the chain's depth; CONTEXT: its most nodes


@dataclass
class AutoPolicy:
    """One session's policy: plan() before a step drafts, gate() while a context chain grows, observe() after
    its verdict. max_depth: L, the deepest chain; has_model: whether a draft model can draft."""

    max_depth: int
    has_model: bool = True
    explore: float = 1.0
    decay: float = 0.8
    verify: RowCosts = field(default_factory=RowCosts)
    overhead_ms: float | None = None
    draft_level_ms: float | None = None  # a model level's draft time
    look_up_ms: float | None = None  # a context node's look-up time
    catch_up_ms: float | None = None  # the draft model's extra time per token it was behind
    model_counts: list[float] = field(default_factory=lambda: [1.0, 1.0])  # Beta(successes, failures) per level
    model_top_counts: list[list[float]] = field(default_factory=lambda: _bucket_counts(0.0))  # per top bucket, no prior
    context_counts: list[list[float]] = field(default_factory=lambda: _bucket_counts(1.0))

    def __post_init__(self):
        if self.max_depth < 1:
            raise ValueError(f"auto needs a depth of at least 1, got {self.max_depth}")

    # ---- rates ------------------------------------------------------------------------------------
    def _base_ms(self) -> float:
        return self.overhead_ms or 0.0

    def plain_rate(self) -> float:
        return 1.0 / (self._base_ms() + self.verify(1))

    def switch_ms(self, behind: int) -> float:
        """The draft model's extra time for the `behind` tokens it has not run (0 while it is caught up)."""
        return (self.catch_up_ms or 0.0) * min(behind, CATCH_UP_TOKENS)

    def model_rate(self, depth: int, optimistic: bool = False, behind: int = 0) -> float:
        s, f = self.model_counts
        p = s / (s + f)
        if optimistic:
            p = min(1.0, p + self.explore * math.sqrt(p * (1 - p) / (s + f + 1)))
        # An untried draft forward is taken as free: the first model step measures it.
        ms = self._base_ms() + self.switch_ms(behind) + depth * (self.draft_level_ms or 0.0) + self.verify(depth + 1)
        return expected_tokens(p, depth) / ms

    def context_acceptance(self, top: float) -> float:
        s, f = self.context_counts[top_bucket(top)]
        return s / (s + f)

    def model_acceptance(self, top: float) -> float:
        """A model child's chance of acceptance given its parent's law's top probability: the bucket's counts
        over a prior at the level acceptance pooled over buckets."""
        s, f = self.model_counts
        sb, fb = self.model_top_counts[top_bucket(top)]
        return (sb + PRIOR_WEIGHT * s / (s + f)) / (sb + fb + PRIOR_WEIGHT)

    def context_rate(self, root_top: float) -> float:
        """The rate of a context chain of one node (a lower bound: deeper nodes are added only where they pay)."""
        a = self.context_acceptance(root_top)
        return (1 + a) / (self._base_ms() + (self.look_up_ms or 0.0) + self.verify(2))

    # ---- decisions --------------------------------------------------------------------------------
    def plan(self, root_top: float | None, behind: int = 0) -> Plan:
        """The next step's plan; root_top: the top probability of the context's law at the root (None: the
        context does not repeat there); behind: the tokens the draft model has not run yet. Ties go to the
        cheaper plan."""
        best, rate = Plan(PLAIN), self.plain_rate()
        if root_top is not None:
            r = self.context_rate(root_top)
            if r > rate:
                best, rate = Plan(CONTEXT, self.max_depth), r
        if self.has_model:
            for d in range(1, self.max_depth + 1):
                r = self.model_rate(d, optimistic=True, behind=behind)
                if r > rate:
                    best, rate = Plan(MODEL, d), r
        return best

    def gate(self, plan: Plan, behind: int = 0) -> ChainGate:
        """A fresh gate for one chain of `plan` (CONTEXT or MODEL)."""
        return ChainGate(self, plan, behind)

    def grow(self, plan: Plan, behind: int = 0):
        """The draft_tree gate that drafts `plan`: the root refused (plain), or a fresh chain gate."""
        return refuse if plan.kind == PLAIN else self.gate(plan, behind)

    # ---- learning ---------------------------------------------------------------------------------
    def observe(
        self,
        plan: Plan,
        tree_tops: list[float],
        accepted: int,
        forward_ms: float,
        round_trip_ms: float,
        draft_ms: float | None,
        rows: int = 0,
        behind: int = 0,
    ) -> None:
        """tree_tops: the top probability of each chain node's law, root first, leaf excluded (len = the drafted
        chain's depth); accepted: the draft tokens the verdict kept; forward_ms: the verifier's forward, of
        `rows` rows (0: the tree's; more where other sessions' trees shared it); draft_ms: the drafter's time
        for the tree (None: not measured); behind: the tokens the draft model ran first (model plans)."""
        depth = len(tree_tops)
        if not 0 <= accepted <= depth:
            raise ValueError(f"accepted {accepted} outside 0..{depth}")
        self.verify.observe(max(rows, depth + 1), forward_ms)
        self.overhead_ms = _ewma(self.overhead_ms, max(0.0, round_trip_ms - forward_ms), self.decay)
        judged = list(enumerate(tree_tops[: accepted + 1]))  # the nodes whose child the verdict judged
        if plan.kind == MODEL:
            if depth:
                self.model_counts[0] += accepted
                self.model_counts[1] += accepted < depth
            for i, top in judged:
                self.model_top_counts[top_bucket(top)][i >= accepted] += 1
            if draft_ms is not None:
                forwards = min(depth + 1, plan.depth)  # the root's law, then each child's but the last level's
                if behind == 0:
                    self.draft_level_ms = _ewma(self.draft_level_ms, draft_ms / forwards, self.decay)
                elif behind <= CATCH_UP_TOKENS and self.draft_level_ms is not None:
                    extra = max(0.0, draft_ms - forwards * self.draft_level_ms) / behind
                    self.catch_up_ms = _ewma(self.catch_up_ms, extra, self.decay)
        if plan.kind == CONTEXT:
            for i, top in judged:
                self.context_counts[top_bucket(top)][i >= accepted] += 1
            if draft_ms is not None:
                self.look_up_ms = _ewma(self.look_up_ms, draft_ms / max(1, depth), self.decay)


class ChainGate:
    """rsd.drafting.draft_tree's `grow` for one chain (a context or a model plan): called with each frontier's
    laws before any child is drawn; a node keeps its child while the child's expected tokens pay for its row and
    its draft cost at the step's rate so far."""

    def __init__(self, policy: AutoPolicy, plan: Plan, behind: int = 0):
        if plan.kind not in (CONTEXT, MODEL):
            raise ValueError(f"a chain gate drafts a context or a model plan, not {plan.kind}")
        self.policy, self.plan = policy, plan
        self.model = plan.kind == MODEL
        self.nodes = 0  # draft nodes so far
        self.reach = 1.0  # chance the chain is accepted through its last node
        self.tokens = 1.0  # expected tokens of the chain so far (the step's own token included)
        # spent before the first decision: the model's catch-up and the root's law
        self.ms = policy._base_ms() + (policy.switch_ms(behind) + (policy.draft_level_ms or 0.0) if self.model else 0.0)

    def _node_ms(self) -> float:
        """The draft cost of one more node: a look-up, or the forward that gives the child its law (none for
        the last level's child, whose law is never asked)."""
        p = self.policy
        if not self.model:
            return p.look_up_ms or 0.0
        return (p.draft_level_ms or 0.0) if self.nodes + 1 < self.plan.depth else 0.0

    def __call__(self, node_idx: Tensor, probs: Tensor) -> list[bool]:
        """node_idx [F], probs [F, V]: the frontier and its laws (a chain: F = 1). -> whether each grows."""
        p = self.policy
        acceptance = p.model_acceptance if self.model else p.context_acceptance
        keep = []
        for row in probs:
            if self.nodes >= self.plan.depth:
                keep.append(False)
                continue
            value = self.reach * acceptance(float(row.max()))
            node_ms = self._node_ms()
            ms = self.ms + p.verify(self.nodes + 1)
            price = p.verify(self.nodes + 2) - p.verify(self.nodes + 1) + node_ms
            grow = value * ms >= price * self.tokens  # value / price >= tokens / ms, without dividing by 0
            if grow:
                self.nodes, self.reach, self.tokens = self.nodes + 1, value, self.tokens + value
                self.ms += node_ms
            keep.append(grow)
        return keep


def root_top(committed: list[int], vocab_size: int) -> float | None:
    """The top probability of the context's law at the next root (rsd.lookup), None where nothing repeats."""
    law, n = continuation(torch.tensor(committed, dtype=torch.long), vocab_size)
    return float(law.max()) if n else None


def plan_method(plan: Plan) -> Method:
    """The method that drafts `plan`: a context chain (lookup; plain: one whose gate refuses the root) or sd."""
    if plan.kind == MODEL:
        return Method("sd", (1,) * plan.depth)
    return Method("lookup", (1,) * max(1, plan.depth))


def refuse(node_idx: Tensor, probs: Tensor) -> list[bool]:
    """The plain plan's gate: the root gets no child."""
    return [False] * len(node_idx)


def chain_tops(tree: DraftTree) -> list[float]:
    """The top probability of each chain node's law, root first, the leaf's left out: [depth]."""
    return tree.draft_probs[: tree.num_nodes - 1].max(-1).values.tolist()

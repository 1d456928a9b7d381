"""Trees shaped by the round trip: pick the next step's tree shape to maximise expected tokens per second.

A shape is (W, L): width W and depth L within one method's family (sd: W = 1, "L"; spectr and rsd_s: "WxL";
rsd_c and specinfer: "W,1,...,1", W children at the root, then chains). Every such tree has W * L draft
nodes and takes L draft forwards (one per level, W rows each).

Step time (ms), from measured costs (Costs):

    draft(W, L)  = L * (draft_ms_per_level + W * draft_ms_per_row)
    verify(W, L) = verify_ms + verify_ms_per_node * (1 + W * L)
    wait         = 2 * one_way_ms + verify
    step         = (1 - h) * (draft + wait) + h * max(draft, wait)      h: pre-draft hit rate

(a pre-drafted tree was drafted while the previous verdict travelled: its draft hides behind the wait).

Expected tokens per step: with p_W the chance that a level of a width-W tree holds an accepted node given
the level above did, E[tokens] = sum_{d=0..L} p_W^d (the accepted drafts plus the token every step emits).
p_W is learnt per width from the accepted depth of each step (a level-by-level Beta-Bernoulli count:
a step that accepted a of L levels saw a successes and, if a < L, one failure); a width never tried
borrows the pooled one-draft rate a = 1 - (1 - p_W)^(1/W) as 1 - (1 - a)^W'. An optimistic bonus
(`explore` standard deviations of the estimate) tries under-observed widths and depths.

Exactness: the shape of step n is a function of the outcomes of steps before n and of measured costs,
never of step n's own draws, and it is fixed before step n drafts. Every method is exact for any fixed
shape given the prefix (rsd.acceptance), so each step's emitted tokens follow the target's law given
the prefix, and by the chain rule so does the whole output (tests/rsd/test_shape_control.py enumerates
two steps whose second shape depends on the first step's outcome).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from rsd.methods import Method


@dataclass(frozen=True)
class Shape:
    width: int  # W
    depth: int  # L

    @property
    def num_nodes(self) -> int:
        return self.width * self.depth

    def spec(self, method: str) -> str:
        """The shape string of rsd.methods for `method` (Method.parse(method, spec))."""
        if method == "sd":
            if self.width != 1:
                raise ValueError(f"sd drafts one chain; width {self.width} is not in its family")
            return str(self.depth)
        if method in ("spectr", "rsd_s"):
            return f"{self.width}x{self.depth}"
        if method in ("rsd_c", "specinfer"):
            return ",".join(map(str, [self.width] + [1] * (self.depth - 1)))
        raise ValueError(f"unknown method {method!r}")


def family(widths: Iterable[int], depths: Iterable[int]) -> list[Shape]:
    return [Shape(w, d) for w in widths for d in depths]


@dataclass(frozen=True)
class Costs:
    """Measured per-step costs in ms (the drafter's clock for drafts, the verifier's for verification)."""

    one_way_ms: float = 0.0
    draft_ms_per_level: float = 1.0  # a draft forward's fixed cost
    draft_ms_per_row: float = 0.0  # and per row of the level (per node drafted)
    verify_ms: float = 1.0  # a verification's fixed cost (one target forward)
    verify_ms_per_node: float = 0.0
    predraft_hit_rate: float = 0.0  # h: steps whose tree was drafted during the wait

    def draft(self, shape: Shape) -> float:
        return shape.depth * (self.draft_ms_per_level + shape.width * self.draft_ms_per_row)

    def verify(self, shape: Shape) -> float:
        return self.verify_ms + self.verify_ms_per_node * (1 + shape.num_nodes)

    def step(self, shape: Shape) -> float:
        draft, wait = self.draft(shape), 2 * self.one_way_ms + self.verify(shape)
        h = self.predraft_hit_rate
        return (1 - h) * (draft + wait) + h * max(draft, wait)


def expected_tokens(p: float, depth: int) -> float:
    """sum_{d=0..L} p^d: tokens one step emits when each level is accepted with chance p given its parent."""
    return float(depth + 1) if p >= 1 else (1 - p ** (depth + 1)) / (1 - p)


@dataclass
class ShapeController:
    """One session's controller: choose(costs) before a step drafts, observe(shape, accepted) after its verdict."""

    shapes: list[Shape]
    prior: tuple[float, float] = (1.0, 1.0)  # Beta(successes, failures) per level, before any step
    explore: float = 1.0  # optimism, in standard deviations of p_W's estimate; 0 = greedy
    counts: dict[int, list[float]] = field(default_factory=dict)  # width -> [successes, failures]

    def __post_init__(self):
        if not self.shapes:
            raise ValueError("a controller needs at least one shape")

    def observe(self, shape: Shape, accepted: int) -> None:
        """accepted: draft tokens the verdict kept (0..L: the depth reached)."""
        if not 0 <= accepted <= shape.depth:
            raise ValueError(f"accepted {accepted} outside 0..{shape.depth}")
        c = self.counts.setdefault(shape.width, [0.0, 0.0])
        c[0] += accepted
        c[1] += accepted < shape.depth

    def acceptance(self, width: int) -> tuple[float, float]:
        """(p_W, its standard deviation) from the counts of this width, or borrowed from the others'."""
        a0, b0 = self.prior
        if width in self.counts:
            s, f = self.counts[width]
        else:  # pooled one-draft rate: each observed width's p as 1 - (1 - a)^W, weighted by its levels seen
            seen = self.counts.items()
            total = sum(s + f for _, (s, f) in seen)
            s, f = 0.0, 0.0
            if total:
                one = sum((s + f) * _one_draft_rate((a0 + s) / (a0 + b0 + s + f), w) for w, (s, f) in seen)
                p = 1 - (1 - one / total) ** width
                n = total / len(self.counts)  # as sure as an average width, no surer
                s, f = p * n, (1 - p) * n
        n = a0 + b0 + s + f
        p = (a0 + s) / n
        return p, math.sqrt(p * (1 - p) / (n + 1))

    def tokens_per_s(self, shape: Shape, costs: Costs, optimistic: bool = False) -> float:
        p, sd = self.acceptance(shape.width)
        if optimistic:
            p = min(1.0, p + self.explore * sd)
        return 1000 * expected_tokens(p, shape.depth) / costs.step(shape)

    def choose(self, costs: Costs) -> Shape:
        """The shape with the largest optimistic expected tokens/s (ties: the smaller tree, the first listed)."""
        return max(self.shapes, key=lambda s: (self.tokens_per_s(s, costs, optimistic=True), -s.num_nodes))


def _one_draft_rate(p_width: float, width: int) -> float:
    """a with 1 - (1 - a)^W = p_W: the chance one draft is accepted, were a level's W drafts independent."""
    return 1 - (1 - p_width) ** (1 / width)


def best_fixed(shapes: Iterable[Shape], p: dict[int, float], costs: Costs) -> Shape:
    """The best shape when p_W is known (p: width -> p_W): what the controller should converge to."""
    return max(shapes, key=lambda s: (expected_tokens(p[s.width], s.depth) / costs.step(s), -s.num_nodes))


@dataclass
class CostMeter:
    """Costs measured step by step, as exponentially weighted means (weight `decay` on the past):
    the one-way delay (half of round trip - queue - verify), the draft cost per level (trees drafted after
    the verdict only: a pre-drafted tree's draft hid in the wait), the pre-draft hit rate, and the verify
    cost as a line in the tree's nodes (least squares on weighted sums; flat until two sizes were seen)."""

    decay: float = 0.9
    costs: Costs = field(default_factory=Costs)
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, x, y, xx, xy of (nodes, verify_ms)
    _seen: bool = False

    def _mean(self, old: float, new: float) -> float:
        return new if not self._seen else self.decay * old + (1 - self.decay) * new

    def observe(
        self, shape: Shape, draft_ms: float | None, verify_ms: float, round_trip_ms: float, queue_ms: float, hit: bool
    ) -> Costs:
        """draft_ms: None when the tree was pre-drafted. -> the updated costs."""
        c = self.costs
        one_way = max(0.0, (round_trip_ms - queue_ms - verify_ms) / 2)
        per_level = c.draft_ms_per_level if draft_ms is None else draft_ms / shape.depth
        sums, x = self._sums, 1 + shape.num_nodes
        for i, v in enumerate((1.0, x, verify_ms, x * x, x * verify_ms)):
            sums[i] = self.decay * sums[i] + v
        w, sx, sy, sxx, sxy = sums
        var = sxx / w - (sx / w) ** 2
        slope = max(0.0, (sxy / w - sx * sy / w**2) / var) if var > 1e-9 else 0.0
        self.costs = Costs(
            one_way_ms=self._mean(c.one_way_ms, one_way),
            draft_ms_per_level=per_level if not self._seen else self._mean(c.draft_ms_per_level, per_level),
            draft_ms_per_row=0.0,
            verify_ms=max(0.0, sy / w - slope * sx / w),
            verify_ms_per_node=slope,
            predraft_hit_rate=self._mean(c.predraft_hit_rate, float(hit)),
        )
        self._seen = True
        return self.costs


ADAPTIVE_METHODS = ("sd", "spectr", "rsd_s")


def adaptive_family(method: Method) -> list[Shape]:
    """The shapes a controller may pick for `method`: every (W, L) up to the method's own width and depth.
    ValueError for a method whose trees are not (W, L) or that carries a confidence stop."""
    if method.name not in ADAPTIVE_METHODS:
        raise ValueError(f"adaptive shapes are for {', '.join(ADAPTIVE_METHODS)}; got {method.name}")
    if method.stop_below:
        raise ValueError("adaptive shapes do not combine with a confidence stop (shape@tau)")
    width = method.beam_width or method.branching[0]
    return family(range(1, width + 1), range(1, method.depth + 1))


def method_for(method: Method, shape: Shape) -> Method:
    """`method` drafting `shape` instead of its own."""
    return Method.parse(method.name, shape.spec(method.name))

"""Speculative methods: which tree to draft and which rule verifies it.

    name       shape string   tree                                   rule (T > 0)
    sd         "L"            one chain of L drafts                  rrs (K = 1: Leviathan/Chen)
    specinfer  "K1,K2,..."    K_l i.i.d. children per node           rrs_with_replacement
    spectr     "KxL"          K i.i.d. chains of length L            kseq
    rsd_c      "K1,K2,..."    Gumbel-Top-K_l children per node       rrs
    rsd_s      "WxL"          Stochastic Beam Search, W beams, L     rrs
    lookup     "L", "K1,K2,"  children drawn from the context's own   rrs
                              n-gram law, no draft model (rsd.lookup): a chain of up to L, or up to
                              K_l children per node; nodes whose context does not repeat stay leaves
    auto       "L"            each step the chain that pays most: the root alone, a context chain or the
                              draft model's, up to L deep, from measured costs and acceptance (rsd.auto)

At temperature 0 every method drafts its shape greedily (top-K children; beam search for rsd_s;
top-K first drafts then greedy chains for spectr) and verifies by greedy matching.

Verification (`Method.rule(greedy, verification)`, T > 0): "token" is the rule above, node by node;
"traversal" is Traversal Verification (rsd.traversal), in the variant that is exact for the method's
siblings (without replacement: sd, rsd_c, rsd_s; i.i.d.: specinfer, spectr); "block" is block
verification, for shapes that are one chain; "coupled" samples the target with the drafter's own Gumbel
noise (rsd.coupled), for the methods that draw children by Gumbel-Top-K (sd, rsd_c, rsd_s), which then
draft from the rule's stream (Rule.draft_stream). A pairing that is not exact raises ValueError. At T = 0
every choice is greedy matching: the target's greedy output is the only exact one.

Any shape may end in "@tau" (e.g. "rsd_s:3x8@0.3", "sd:10@0.4"): the confidence stop of
rsd.drafting, which makes the shape an upper bound and drafts deep only where the draft is sure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rsd.acceptance import RULES, Rule
from rsd.drafting import DraftMode, Proposal, draft_sbs, draft_tree
from rsd.random import StepRandom
from rsd.tree import DraftTree

METHOD_NAMES = ("sd", "specinfer", "spectr", "rsd_c", "rsd_s", "lookup", "auto")
DRAFT_FREE = ("lookup",)  # methods that draft from the context alone: no draft model runs
# The shape each method runs with when none is given (gateway, CLI): chains of 4, trees of 5-12 nodes.
DEFAULT_SHAPES = {
    "sd": "4",
    "specinfer": "2,2,1",
    "spectr": "3x4",
    "rsd_c": "2,2,1",
    "rsd_s": "3x4",
    "lookup": "6",
    "auto": "4",
}
_RULE = {
    "sd": "rrs",
    "specinfer": "rrs_with_replacement",
    "spectr": "kseq",
    "rsd_c": "rrs",
    "rsd_s": "rrs",
    "lookup": "rrs",
    "auto": "rrs",  # its plans (sd, lookup) share this rule, so the verifier's rule holds whatever the plan
}
VERIFICATIONS = ("token", "traversal", "block", "coupled")
# children from Gumbel keys the verifier can recompute (rsd.coupled)
_GUMBEL_TOP_K = ("sd", "rsd_c", "rsd_s", "lookup", "auto")
_TRAVERSAL = {  # the variant exact for the method's siblings (tests/rsd/test_traversal.py)
    "sd": "traversal",
    "specinfer": "traversal_with_replacement",
    "spectr": "traversal_with_replacement",
    "rsd_c": "traversal",
    "rsd_s": "traversal",
    "lookup": "traversal",
    "auto": "traversal",
}
_DRAFT_MODE = {  # at T > 0; rsd_s drafts by Stochastic Beam Search instead
    "sd": DraftMode.WITHOUT_REPLACEMENT,
    "specinfer": DraftMode.IID,
    "spectr": DraftMode.IID,
    "rsd_c": DraftMode.WITHOUT_REPLACEMENT,
    "lookup": DraftMode.WITHOUT_REPLACEMENT,
    "auto": DraftMode.WITHOUT_REPLACEMENT,
}


@dataclass(frozen=True)
class Method:
    name: str
    branching: tuple[int, ...] = ()  # sd, specinfer, spectr (K, 1, ..., 1), rsd_c
    beam_width: int = 0  # rsd_s
    stop_below: float = 0.0  # confidence stop (rsd.drafting); 0 = off

    @staticmethod
    def parse(name: str, shape: str) -> Method:
        """Method.parse("rsd_c", "2,2,1"), ("sd", "4"), ("spectr", "3x4"), ("rsd_s", "4x5"), ("sd", "8@0.4"),
        ("lookup", "6"), ("lookup", "2,1,1")."""
        if name not in METHOD_NAMES:
            raise ValueError(f"unknown method {name!r}; expected one of {', '.join(METHOD_NAMES)}")
        shape, at, tau = shape.partition("@")
        try:
            stop_below = float(tau) if at else 0.0
        except ValueError:
            stop_below = float("nan")
        if not 0 <= stop_below < 1:
            raise ValueError(f"confidence stop '@{tau}' must be a probability in [0, 1)")
        if name == "auto" and at:
            raise ValueError("auto takes a depth like '4' and no confidence stop: it decides each node's worth itself")
        method = Method._parse_shape(name, shape)
        return dataclasses.replace(method, stop_below=stop_below)

    @staticmethod
    def _parse_shape(name: str, shape: str) -> Method:
        try:
            if name in ("spectr", "rsd_s"):
                width, depth = (int(v) for v in shape.lower().split("x"))
                parts = (width, depth)
            elif name == "lookup" and "," not in shape:
                parts = (1,) * int(shape)  # "L": a chain of up to L
            elif name == "lookup":
                parts = tuple(int(v) for v in shape.split(",") if v.strip())  # "3," is one level of 3
                if not parts:
                    raise ValueError
            else:
                parts = tuple(int(v) for v in shape.split(","))
        except ValueError:
            raise ValueError(f"bad shape {shape!r} for {name}: see rsd.methods for the forms") from None
        if any(v < 1 for v in parts):
            raise ValueError(f"shape {shape!r} for {name} must have positive sizes")
        if name in ("sd", "auto"):
            if len(parts) != 1:
                raise ValueError(f"{name} takes a depth like '4', got {shape!r}")
            return Method(name, (1,) * parts[0])
        if name == "spectr":
            return Method(name, (parts[0],) + (1,) * (parts[1] - 1))
        if name == "rsd_s":
            return Method(name, (1,) * parts[1], beam_width=parts[0])
        return Method(name, parts)

    @property
    def draft_free(self) -> bool:
        """Drafted from the context alone (rsd.lookup): the Proposal is not a model's."""
        return self.name in DRAFT_FREE

    @property
    def planned(self) -> bool:
        """Each step drafts as the plan rsd.auto makes for it (auto), not as this method: nothing to draft ahead."""
        return self.name == "auto"

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def max_draft_tokens(self) -> int:
        """Upper bound on draft nodes (the target verifies this many plus the root)."""
        if self.name == "rsd_s":
            return self.beam_width * self.depth
        total, width = 0, 1
        for k in self.branching:
            width *= k
            total += width
        return total

    def rule(self, greedy: bool, verification: str = "token") -> Rule:
        """The acceptance rule: greedy matching at T = 0, else the chosen verification (module docstring)."""
        if verification not in VERIFICATIONS:
            raise ValueError(f"unknown verification {verification!r}; expected one of {', '.join(VERIFICATIONS)}")
        if verification == "block" and self.max_draft_tokens != self.depth:
            raise ValueError(
                f"block verification is exact for one chain only; {self.name} with this shape drafts trees "
                "(use a chain shape, or verification 'traversal')"
            )
        if verification == "coupled" and self.name not in _GUMBEL_TOP_K:
            raise ValueError(
                f"the coupled rule needs children drawn by Gumbel-Top-K ({', '.join(_GUMBEL_TOP_K)}); "
                f"{self.name} draws i.i.d. children"
            )
        if greedy:
            return RULES["greedy"]
        names = {"token": _RULE[self.name], "traversal": _TRAVERSAL[self.name], "block": "block", "coupled": "coupled"}
        name = names[verification]
        return RULES[name]

    def draft(
        self, proposal: Proposal, root_token: int, rng: StepRandom, greedy: bool, device="cpu", grow=None
    ) -> DraftTree:
        """The method's tree; rng: the step's draws from the rule's Rule.draft_stream (unused when greedy);
        grow: rsd.drafting.draft_tree's gate (rsd.auto's context chains)."""
        if self.name == "auto":
            raise ValueError("auto drafts each step as its plan's method (rsd.auto.plan_method), not as itself")
        stop = self.stop_below
        if self.name == "rsd_s":
            if grow is not None:
                raise ValueError("rsd_s trees take no grow gate")
            return draft_sbs(proposal, root_token, self.beam_width, self.depth, rng, device, greedy, stop)
        mode = DraftMode.GREEDY if greedy else _DRAFT_MODE[self.name]
        return draft_tree(proposal, root_token, self.branching, mode, rng, device, stop, grow)

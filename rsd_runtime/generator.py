"""Speculative generation in one process: a loop over a Drafter and a Verifier (rsd_runtime.engines).

One step (a "block"):
    1. Drafter.draft   the draft model builds a tree from the committed tokens (one forward per level)
    2. Verifier.verify the target runs once over the whole tree and the method's rule walks it
    3. both engines keep the K/V of the accepted path; the step's tokens are committed, cut at the
       generation's budget and its first EOS (cut_step, which the drafter service's loop shares)

Randomness is counter-based: a step's draws are StepRandom(seed, stream, root position) (rsd.random),
one stream for drafting and one for acceptance, so they depend on where the step starts and not on
what ran before (the drafter service drafts ahead on that: rsd_runtime.predraft).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum
from functools import partial

from rsd.acceptance import Rule, Verdict
from rsd.auto import AutoPolicy
from rsd.constraint import Guide, TokenAutomaton
from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd.tree import DraftTree
from rsd_runtime.engines import AutoDrafter, Drafter, Verifier
from rsd_runtime.runner import ModelRunner


@dataclass
class GenerationStats:
    method: str
    rule: str = ""  # the acceptance rule that ran (rsd.acceptance.RULES; the `verification` chosen); "" alone
    new_tokens: int = 0
    target_calls: int = 0
    draft_forwards: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)  # steps that accepted a draft at depth d+1
    tried_by_depth: list[int] = field(default_factory=list)  # steps that reached a node at depth d with children
    draft_s: float = 0.0  # drafting trees (draft forwards + sampling) and the draft cache's commits
    verify_s: float = 0.0  # target forwards
    accept_s: float = 0.0  # target laws, the acceptance rule and the target cache's commit
    total_s: float = 0.0
    # Pre-drafting (rsd_runtime.predraft): verdicts whose next tree was drafted ahead (hits) or not
    # (misses), trees drafted ahead, and draft forwards spent on trees that were never sent.
    predraft_hits: int = 0
    predraft_misses: int = 0
    predraft_trees: int = 0
    wasted_draft_forwards: int = 0

    @property
    def block_efficiency(self) -> float:
        """Tokens emitted per target forward."""
        return self.new_tokens / max(self.target_calls, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted_by_depth, self.tried_by_depth, strict=True)]

    def record(self, verdict: Verdict, depth: int) -> None:
        if not self.tried_by_depth:
            self.accepted_by_depth, self.tried_by_depth = [0] * depth, [0] * depth
        n = len(verdict.accepted_idx)
        for d in range(n):
            self.accepted_by_depth[d] += 1
            self.tried_by_depth[d] += 1
        if not verdict.is_bonus and n < depth:
            self.tried_by_depth[n] += 1


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    stats: GenerationStats


@dataclass(frozen=True)
class Step:
    """One speculative step of SpeculativeGenerator, as its hooks see it."""

    committed: list[int]
    tree: DraftTree  # drafted from committed, not verified yet
    method: Method
    params: SamplingParams
    seed: int
    finishes: Callable[[list[int]], bool]  # whether committing these tokens ends the generation
    draft_stream: Stream = Stream.DRAFT  # what the drafter draws from (Rule.draft_stream)


class Finish(Enum):
    """Why a generation ended."""

    EOS = "eos"  # an end-of-sequence token was committed
    LENGTH = "length"  # the new-token budget is spent


def cut_step(token_ids: list[int], budget: int, eos_token_ids: Collection[int]) -> tuple[list[int], Finish | None]:
    """Cut a step's tokens at a generation's `budget` (new tokens left) and after its first EOS id.
    Returns (the tokens to commit, why the generation ends with them, or None when it goes on)."""
    new = list(token_ids[:budget])
    for i, tok in enumerate(new):
        if tok in eos_token_ids:
            return new[: i + 1], Finish.EOS
    return new, Finish.LENGTH if len(new) == budget else None


def finishes(tokens: list[int], budget: int, eos_token_ids: Collection[int]) -> bool:
    """Whether committing `tokens` ends a generation with `budget` tokens left."""
    return cut_step(tokens, budget, eos_token_ids)[1] is not None


class SpeculativeGenerator:
    """Drives a draft model and a target model in one process.

    method None means plain autoregressive decoding with the target alone.
    """

    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner | None = None,
        draft_top_k: int = 0,
        draft_top_p=1.0,
        lookup_n: int = 0,
    ):
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocabulary {draft.vocab_size} != target vocabulary {target.vocab_size}")
        self.verifier = Verifier(target)
        # Without a draft model the drafter still drafts from the context (Method.draft_free: rsd.lookup).
        # lookup_n: context lookups merged into the model's trees (Drafter.lookup_n; 0 = off).
        self.drafter = Drafter(draft, draft_top_k, draft_top_p, vocab_size=target.vocab_size, lookup_n=lookup_n)
        self._next_tree: DraftTree | None = None
        self.guide: Guide | None = None  # the constraint of the generation running

    def generate(
        self,
        prompt_ids: list[int],
        method: Method | None = None,
        params: SamplingParams | None = None,
        max_new_tokens: int = 64,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 0,
        verification: str = "token",
        constraint: TokenAutomaton | None = None,
    ) -> GenerationResult:
        """verification: which exact rule judges the trees ("token", "traversal", "block", "coupled"; rsd.methods).
        Without a method (the target alone), "coupled" samples with that rule's noise: the tokens speculation under
        the coupled rule emits with the same seed.
        constraint: structured output (rsd.constraint); the new tokens follow it, every law masked per node."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ValueError("the prompt needs at least one token")
        if method is not None and not (method.draft_free or method.planned) and self.drafter.runner is None:
            raise ValueError(f"method {method.name} needs a draft model")
        rule = method.rule(params.greedy, verification) if method is not None else None  # ValueError if not exact
        runners = [self.verifier.runner] + ([self.drafter.runner] if self.drafter.runner else [])
        for runner in runners:
            runner.reset()
        for engine in (self.verifier, self.drafter):  # the penalties count output from here (rsd.penalties)
            if engine is not None:
                engine.output_start = len(prompt_ids)
        self._next_tree = None
        # auto (rsd.auto): each step's plan from the costs this process measures and the acceptance seen so far
        self.auto = None
        if method is not None and method.planned:
            self.auto = AutoDrafter(self.drafter, AutoPolicy(method.depth, self.drafter.runner is not None))
        self.guide = None if constraint is None else Guide(constraint, len(prompt_ids))
        self.drafter.guide = self.guide
        stats = GenerationStats(method.name if method else "ar", rule.name if rule else "")
        committed, start, t0 = list(prompt_ids), len(prompt_ids), time.perf_counter()
        while len(committed) - start < max_new_tokens:
            if method is None:
                t = time.perf_counter()
                stream = Stream.COUPLED if verification == "coupled" else Stream.VERIFY  # coupled: the same tokens
                rng = StepRandom(seed, stream, len(committed) - 1)
                new = [self.verifier.step_autoregressive(committed, params, rng, self.guide)]
                stats.verify_s += time.perf_counter() - t
            else:
                budget = max_new_tokens - (len(committed) - start)
                ends = partial(finishes, budget=budget, eos_token_ids=eos_token_ids)
                new = self._speculative_step(committed, method, rule, params, seed, stats, ends)
            stats.target_calls += 1
            new, finish = cut_step(new, max_new_tokens - (len(committed) - start), eos_token_ids)
            committed += new
            if finish is Finish.EOS:
                break
        stats.new_tokens = len(committed) - start
        stats.total_s = time.perf_counter() - t0
        return GenerationResult(committed[start:], stats)

    def _speculative_step(
        self,
        committed: list[int],
        method: Method,
        rule: Rule,
        params: SamplingParams,
        seed: int,
        stats: GenerationStats,
        finishes: Callable[[list[int]], bool],
    ) -> list[int]:
        """One step: draft (or take the tree drafted ahead), verify, follow the verdict.
        finishes(tokens): whether committing these tokens ends the generation (no next tree)."""
        root_position = len(committed) - 1
        t = time.perf_counter()
        tree, self._next_tree = self._next_tree, None
        if tree is None:
            rng = StepRandom(seed, rule.draft_stream, root_position)
            if self.auto is not None:
                tree = self.auto.draft(committed, params, rng)
            else:
                tree = self.drafter.draft(committed, method, params, rng)
        stats.draft_forwards += self.drafter.num_forwards
        self.before_verify(Step(committed, tree, method, params, seed, finishes, rule.draft_stream))
        t_verify = time.perf_counter()
        rng = StepRandom(seed, Stream.VERIFY, root_position)
        verdict = self.verifier.verify(committed, tree, rule, params, rng, self.guide)
        t_accept = time.perf_counter()
        self._next_tree = self.after_verdict(committed, verdict, stats)
        if self._next_tree is None:
            self.drafter.accept(committed, verdict)
        stats.draft_s += (t_verify - t) + (time.perf_counter() - t_accept)
        stats.verify_s += self.verifier.last_forward_s
        stats.accept_s += t_accept - t_verify - self.verifier.last_forward_s
        if self.auto is not None:  # auto drafts nothing ahead: this step's tree was drafted above
            forward_ms, verify_ms = self.verifier.last_forward_s * 1000, (t_accept - t_verify) * 1000
            self.auto.observe(tree, len(verdict.accepted_ids), forward_ms, verify_ms, (t_verify - t) * 1000)
        stats.record(verdict, method.depth)
        return verdict.token_ids

    def before_verify(self, step: Step) -> None:
        """Hook: the tree is drafted, the target has not seen it (rsd_runtime.predraft drafts ahead here)."""

    def after_verdict(self, committed: list[int], verdict: Verdict, stats: GenerationStats) -> DraftTree | None:
        """Hook: the next tree if it is drafted already (the drafter then holds its state), else None."""
        return None

"""Pre-drafting: while the target verifies tree t, draft tree t+1 for the verdicts the drafter expects.

Words used below:
    outcome    what a verdict does to the committed sequence, as a key: (accepted node indices after
               the root, the token the verifier appends). Outcome o turns the committed tokens C into
               C + [tokens of o's path] + [o's appended token].
    pre-draft  the tree drafted for outcome o before the verdict is known, with the draft runner's
               state it leaves (its K/V and tentative tokens)
    hit / miss the verdict's outcome has a pre-draft (it is sent at once) / has none (draft as usual)

    pre = PreDrafter(drafter, method, params, seed, max_outcomes=4)
    pre.begin(committed, tree, finishes)   # tree t was sent; the drafter's runner holds its forwards
    while pre.draft_next(stop): ...        # one more outcome per call (a worker thread, while waiting);
                                           # stop(outcome) is asked before each forward of that outcome
    next_tree = pre.take(verdict)          # hit: tree t+1, the drafter holds its state; miss: None, the
                                           # drafter holds tree t's state (accept + draft as usual)
    while pre.draft_wave(3, stop, side_by_side): ...   # or: 3 outcomes at once, on shadow runners

Side by side. draft_next drafts one outcome after the other on the drafter's own runner (saved and
restored around each). draft_wave drafts several at once, each on a shadow runner (a copy of the
drafter's runner as it was when tree t was sent, kept in sync by copying only what changed); the
caller's side_by_side runs them in threads whose forwards pack into one per level
(rsd_runtime.packed), so k trees cost little more than one. A hit on a shadow swaps it in as the
drafter's runner. Exact the same way: the same prefix, path commit and step draws, on a copy
of the same state; packing changes only the rounding of the draft logits, so (as in any batched
forward) a seeded run may draft another tree at a near-tie, drawn from the law it carries.

Exactness. The tree drafted after a verdict is a function of three things: the draft runner's state,
the committed prefix, and the step's draws, StepRandom(seed, DRAFT, root position). A
pre-draft for o starts from the runner state saved when tree t was sent, commits o's path exactly
as Drafter.accept would, and drafts with o's prefix and o's step draws: the same forwards on
the same inputs as the loop without pre-drafting, so the same tree bit for bit, and the same
runner state after it (saved, restored on a hit). On a miss, and between pre-drafts, the state
saved at the send is restored. The verifier only ever sees the tree it would have seen. take()
checks that a pre-draft it hands out was drafted for exactly the verdict's prefix and raises
PreDraftMismatchError otherwise (a wrong key would silently change the output law).

Prediction (only speed depends on it). The emitted tokens follow the target law q; the drafter
knows its own law p and bets q ≈ p: outcome (path to node v, token x not among v's children) has
probability ≈ P_p(path) · p(x | v). Laws of nodes that were run come with the tree; the leaves were
never run, so one extra forward runs the likeliest leaves (then dropped) for their laws. (At T = 0
a rank model learned from the session's verdicts did no better on the test pair, nor did putting
the draft's own greedy walk first.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from rsd.acceptance import Verdict
from rsd.constraint import mask_logits
from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd.tree import DraftTree, path_to
from rsd_runtime.engines import Drafter, DraftStopped, ModelProposal, commit_path
from rsd_runtime.generator import GenerationResult, GenerationStats, SpeculativeGenerator, Step
from rsd_runtime.runner import ModelRunner, RunnerState

Outcome = tuple[tuple[int, ...], int]  # (accepted node indices, root excluded; the appended token)


def outcome_of(verdict: Verdict) -> Outcome:
    return tuple(verdict.accepted_idx), verdict.next_token


class PreDraftMismatchError(RuntimeError):
    """A pre-drafted tree was about to answer a verdict whose prefix it was not drafted for."""


@dataclass(frozen=True)
class PreDraft:
    outcome: Outcome
    committed: list[int]  # the prefix the tree was drafted for: committed + the outcome's tokens
    tree: DraftTree
    proposal: ModelProposal  # the drafter's proposal of that tree (which nodes it ran)
    state: RunnerState | None  # the draft runner right after drafting it (None: `runner` holds it)
    num_forwards: int
    runner: ModelRunner | None = None  # the shadow runner it was drafted on (draft_wave)


class PreDrafter:
    """Pre-drafts for one sent tree at a time (see the module docstring). Not thread-safe: one
    thread at a time, and nothing else may use the drafter between begin() and take()."""

    def __init__(
        self,
        drafter: Drafter,
        method: Method,
        params: SamplingParams,
        seed: int,
        max_outcomes: int,
        stream: Stream = Stream.DRAFT,  # the drafter's stream, Rule.draft_stream
    ):
        if max_outcomes < 1:
            raise ValueError(f"max_outcomes must be >= 1, got {max_outcomes}")
        self.drafter, self.method, self.params, self.seed, self.stream = drafter, method, params, seed, stream
        self.max_outcomes = max_outcomes
        self.drafts: dict[Outcome, PreDraft] = {}
        self.num_forwards = 0  # draft forwards spent pre-drafting for the current tree
        self._ranked: list[Outcome] | None = None
        self.shadows: list[ModelRunner] = []  # draft_wave's runners, one per tree of a step
        self._synced: dict[ModelRunner, int] = {}  # shadow -> K/V positions known equal to the runner's
        self._shadows_used = 0

    @property
    def runner(self) -> ModelRunner:
        return self.drafter.runner

    def begin(self, committed: list[int], tree: DraftTree, finishes: Callable[[list[int]], bool]) -> None:
        """Tree was drafted from `committed` and sent; finishes(tokens) says whether committing these
        tokens ends the run (no tree follows, nothing to pre-draft)."""
        self.committed, self.tree, self.finishes = list(committed), tree, finishes
        self.sent = self.drafter.proposal
        self.base = self.runner.save(self.runner.cache_len)
        self.drafts, self.num_forwards, self._ranked, self._shadows_used = {}, 0, None, 0

    def draft_next(self, stop: Callable[[Outcome | None], bool] | None = None) -> bool:
        """Pre-draft one more outcome (the first call also ranks them); False when there is none left
        or stop said True. stop(outcome) is asked before each forward of that outcome's tree (None while
        ranking): the caller can let the one tree the verdict wants run to its end and drop the others.
        A stopped draft is dropped."""
        try:
            if self._ranked is None:
                self._ranked = self.rank(None if stop is None else partial(stop, None))
            todo = self._next_outcomes(1)
            if todo:
                self.drafts[todo[0]] = self._draft(todo[0], None if stop is None else partial(stop, todo[0]))
            return bool(todo)
        except DraftStopped:
            self._ranked = []
            return False
        finally:
            self.runner.restore(self.base)
            self.drafter.proposal = self.sent

    def draft_wave(
        self,
        width: int,
        stop: Callable[[Outcome | None], bool] | None = None,
        side_by_side: Callable[[list[Callable[[], object]]], list] | None = None,
    ) -> bool:
        """Pre-draft the next `width` outcomes at once, each on a shadow runner (the drafter's runner
        stays as tree t left it). side_by_side(fns) calls the functions concurrently and returns their
        results in order (threads whose forwards pack); None calls them in turn. False when no outcome
        is left or stop said True (stop as in draft_next; a stopped tree is dropped)."""
        try:
            if self._ranked is None:
                self._ranked = self.rank(None if stop is None else partial(stop, None))
        except DraftStopped:
            self._ranked = []
            return False
        finally:
            self.runner.restore(self.base)
            self.drafter.proposal = self.sent
        todo = self._next_outcomes(width)
        if not todo:
            return False
        while len(self.shadows) < self._shadows_used + len(todo):
            self.shadows.append(ModelRunner(self.runner.model, self.runner.max_len, self.runner.plan))
        shadows = self.shadows[self._shadows_used : self._shadows_used + len(todo)]
        self._shadows_used += len(todo)
        fns = [
            partial(self._draft_on, shadow, o, None if stop is None else partial(stop, o))
            for shadow, o in zip(shadows, todo, strict=True)
        ]
        results = side_by_side(fns) if side_by_side is not None else [fn() for fn in fns]
        for draft, forwards in results:
            self.num_forwards += forwards
            if draft is not None:
                self.drafts[draft.outcome] = draft
        if any(draft is None for draft, _ in results):
            self._ranked = []
            return False
        return True

    def _next_outcomes(self, n: int) -> list[Outcome]:
        todo = []
        while self._ranked and len(todo) < n:
            outcome = self._ranked.pop(0)
            if outcome not in self.drafts and outcome not in todo:
                todo.append(outcome)
        return todo

    def take(self, verdict: Verdict) -> DraftTree | None:
        """The pre-drafted next tree for this verdict (the drafter then holds that tree's state), or
        None (the drafter holds the sent tree's state, as if nothing had been pre-drafted)."""
        entry = self.drafts.get(outcome_of(verdict))
        self.runner.restore(self.base)
        self.drafter.proposal = self.sent
        if entry is None:
            return None
        prefix = self.committed + verdict.token_ids
        if entry.committed != prefix or int(entry.tree.token_ids[0]) != prefix[-1]:
            raise PreDraftMismatchError(
                f"pre-draft for outcome {entry.outcome} was drafted after {entry.committed[len(self.committed) :]}, "
                f"the verdict committed {verdict.token_ids}"
            )
        if entry.runner is not None:  # drafted on a shadow: it becomes the drafter's runner
            i = self.shadows.index(entry.runner)
            self.shadows[i], self.drafter.runner = self.drafter.runner, entry.runner
            self._synced[self.shadows[i]] = self.base.cache_len  # its committed prefix is the new runner's
        else:
            self.runner.restore(entry.state)
        self.drafter.proposal = entry.proposal
        return entry.tree

    def wasted_forwards(self, hit: DraftTree | None) -> int:
        """Pre-drafting forwards that did not make the tree sent next."""
        used = next((d.num_forwards for d in self.drafts.values() if d.tree is hit), 0)
        return self.num_forwards - used

    def _draft_for(
        self, drafter: Drafter, outcome: Outcome, stop: Callable[[], bool] | None
    ) -> tuple[list[int], DraftTree]:
        """What the loop without pre-drafting does after o's verdict, on `drafter` (whose runner holds
        tree t's state): commit o's path, draft o's prefix with o's step draws. -> (prefix, tree)."""
        path, token = outcome
        prefix = self.committed + self.tree.token_ids[list(path)].tolist() + [token]
        commit_path(drafter.runner, self.committed, self.sent.tentative_of, list(path))
        rng = StepRandom(self.seed, self.stream, len(prefix) - 1)
        return prefix, drafter.draft(prefix, self.method, self.params, rng, stop)

    def _draft(self, outcome: Outcome, stop: Callable[[], bool] | None) -> PreDraft:
        try:
            prefix, tree = self._draft_for(self.drafter, outcome, stop)
        finally:
            self.num_forwards += self.drafter.num_forwards
        state = self.runner.save(self.base.start)
        return PreDraft(outcome, prefix, tree, self.drafter.proposal, state, self.drafter.num_forwards)

    def _draft_on(
        self, shadow: ModelRunner, outcome: Outcome, stop: Callable[[], bool] | None
    ) -> tuple[PreDraft | None, int]:
        """_draft on a shadow runner: a copy of the drafter's runner as tree t left it (only the K/V
        past what the shadow is known to share are copied). -> (the pre-draft or None if stopped,
        forwards run). Safe in a thread of its own: it reads the drafter's runner, writes the shadow."""
        shadow.copy_from(self.runner, self._synced.get(shadow, 0))
        self._synced[shadow] = self.runner.cache_len  # committed: neither changes it before the verdict
        top_k, top_p = self.drafter.top_k, self.drafter.top_p
        drafter = Drafter(
            shadow,
            top_k,
            top_p,
            self.drafter.forward,
            self.drafter.output_start,
            self.drafter.guide,
            lookup_n=self.drafter.lookup_n,  # the same laws as the drafter's own
        )
        try:
            prefix, tree = self._draft_for(drafter, outcome, stop)
        except DraftStopped:
            return None, drafter.num_forwards
        n = drafter.num_forwards
        return PreDraft(outcome, prefix, tree, drafter.proposal, None, n, shadow), n

    def rank(self, stop: Callable[[], bool] | None) -> list[Outcome]:
        """The max_outcomes likeliest outcomes under the draft's own laws, likeliest first, without
        those that end the run."""
        tree, ran = self.tree, self.sent.tentative_of
        tokens, parents = tree.token_ids.tolist(), tree.parent_idx.tolist()
        path_prob = [1.0] * tree.num_nodes
        for n in range(1, tree.num_nodes):
            path_prob[n] = path_prob[parents[n]] * float(tree.draft_probs[parents[n], tokens[n]])
        # Every node with a law: those the model ran, and those whose law was looked up in the context
        # (rsd.lookup.HybridProposal; never run). The leaves under a node the model ran get theirs below.
        expanded = tree.draft_probs.any(-1).tolist()
        laws = {n: tree.draft_probs[n] for n in range(tree.num_nodes) if n in ran or expanded[n]}
        leaves = sorted(
            (n for n in range(tree.num_nodes) if n not in laws and parents[n] in ran), key=lambda n: -path_prob[n]
        )
        laws.update(self._leaf_laws(leaves[: self.max_outcomes], stop))
        scored = []
        for v, law in laws.items():
            children = {tokens[c] for c in tree.children(v)}
            top = torch.topk(law, min(self.max_outcomes + len(children), law.shape[-1]))
            for p, x in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if p > 0 and x not in children:
                    scored.append((path_prob[v] * p, tuple(path_to(tree.parent_idx, v)), x))
        scored.sort(key=lambda s: -s[0])
        ranked = []
        for _, path, x in scored:
            if (path, x) not in ranked and not self.finishes([tokens[n] for n in path] + [x]):
                ranked.append((path, x))
        return ranked[: self.max_outcomes]

    def _leaf_laws(self, leaves: list[int], stop: Callable[[], bool] | None) -> dict[int, Tensor]:
        """Draft laws at leaves the drafter never ran: one forward on top of the sent tree, dropped after."""
        runner = self.runner
        room = runner.cache_len + runner.num_tentative + len(leaves) <= runner.max_len
        if not leaves or not room or (stop is not None and stop()):
            return {}
        ran = self.sent.tentative_of
        parents = torch.tensor([ran[int(self.tree.parent_idx[n])] for n in leaves])
        logits = self.drafter.forward(runner, self.tree.token_ids[leaves], parents)  # [F, V]
        guide = self.drafter.guide
        if guide is not None:  # structured output: only outcomes the constraint allows are worth drafting
            tree = self.tree
            logits = mask_logits(
                logits, guide.tree_masks(self.committed, tree.token_ids, tree.parent_idx, logits.shape[-1], leaves)
            )
        self.num_forwards += 1
        self.runner.restore(self.base)
        laws = self.sent.law(logits, self.tree.token_ids, self.tree.parent_idx, torch.tensor(leaves))  # [F, V]
        return dict(zip(leaves, laws, strict=True))


class PipelinedGenerator(SpeculativeGenerator):
    """SpeculativeGenerator that pre-drafts up to max_outcomes outcomes per step before verifying
    (in one process nothing overlaps: this is the drafter service's pipelined loop made sequential,
    to test that it changes no token). width > 1 drafts that many outcomes per wave on shadow runners
    (draft_wave), here one after another."""

    def __init__(self, target: ModelRunner, draft: ModelRunner, max_outcomes: int = 4, width: int = 1, **kwargs):
        super().__init__(target, draft, **kwargs)
        self.max_outcomes, self.width = max_outcomes, width
        self._pre: PreDrafter | None = None

    def generate(self, *args, **kwargs) -> GenerationResult:
        self._pre = None  # one PreDrafter per generation, as one per drafter-service run
        return super().generate(*args, **kwargs)

    def before_verify(self, step: Step) -> None:
        if step.method.draft_free:  # a tree from the context alone costs nothing to draft when it is due
            return
        if step.method.planned:  # each step's plan waits for the verdict before it (rsd.auto)
            return
        if self._pre is None:
            self._pre = PreDrafter(
                self.drafter, step.method, step.params, step.seed, self.max_outcomes, step.draft_stream
            )
        self._pre.begin(step.committed, step.tree, step.finishes)
        while self._pre.draft_next() if self.width == 1 else self._pre.draft_wave(self.width):
            pass

    def after_verdict(self, committed: list[int], verdict: Verdict, stats: GenerationStats) -> DraftTree | None:
        pre = self._pre
        if pre is None:
            return None
        tree = pre.take(verdict)
        stats.predraft_trees += len(pre.drafts)
        stats.wasted_draft_forwards += pre.wasted_forwards(tree)
        if tree is not None:
            stats.predraft_hits += 1
        elif pre.drafts:
            stats.predraft_misses += 1
        return tree

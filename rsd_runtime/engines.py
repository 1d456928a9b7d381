"""The engines of ONE session: a Drafter that drafts trees on the draft model and a Verifier that runs the
target once over a tree and applies the method's acceptance rule.

Engine names (one vocabulary, rsd_runtime and the services):
    Drafter        the draft model of ONE session (here); drafts trees, follows verdicts
    Verifier       the target model of ONE session (here); one forward per tree, then the rule
    DrafterPool    drafter_service.engine: the draft model of MANY sessions, a runner per session kept
                   between turns (LRU); each run drives a Drafter on its session's runner
    VerifierPool   verifier_service.engine: the target model of MANY sessions, a KV slot per session;
                   verifies their trees in one packed forward (it cannot reuse Verifier: one forward
                   serves every session)
    ReplicaPool    deploy.ray_pool: verifier service replicas on Ray (processes, not an engine)
rsd_runtime.generator drives a Drafter and a Verifier in one process; the services put them in two.

Committed tokens are the session's truth. Each runner caches all but the last committed token (the
last one is the next tree's root); a runner that is behind (the drafter never ran an accepted leaf)
runs the missing tokens as a chain in front of the next tree, in the same forward (forward_with_catch_up).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import Tensor

from rsd.acceptance import Rule, Verdict, verify
from rsd.auto import MODEL, AutoPolicy, Plan, chain_tops, plan_method, root_top
from rsd.constraint import Guide, mask_logits
from rsd.coupled import coupled_token
from rsd.lookup import HybridProposal, LookupProposal
from rsd.methods import Method
from rsd.penalties import TokenCounts, counts_at
from rsd.random import Draw, StepRandom, Stream
from rsd.sampling import SamplingParams, logits_to_probs, proposal_probs, sample
from rsd.tree import DraftTree, path_to
from rsd_runtime.runner import Forward, ModelRunner


def forward_with_catch_up(
    runner: ModelRunner,
    committed: list[int],
    token_ids: Tensor,
    parent_idx: Tensor,
    forward: Forward = ModelRunner.forward,
    logits_rows: int | None = None,
) -> Tensor:
    """Run the committed tokens the runner has not cached yet (all but the last committed token) as a
    chain, then a tree whose node 0 is the last committed token. Returns the tree's logits [N, V] (or its
    last logits_rows rows). parent_idx [N] is the tree's (root -1)."""
    behind = committed[runner.cache_len : len(committed) - 1]
    if runner.num_tentative or runner.cache_len > len(committed) - 1:
        raise RuntimeError("runner out of sync with the committed tokens")  # a bug, not bad input
    m = len(behind)
    ids = torch.tensor(behind + token_ids.tolist(), dtype=torch.long)
    chain = list(range(-1, m - 1))
    parents = torch.tensor(chain + [p + m if p >= 0 else m - 1 for p in parent_idx.tolist()], dtype=torch.long)
    rows = len(token_ids) if logits_rows is None else logits_rows
    return forward(runner, ids, parents, logits_rows=rows)  # the chain needs no logits


def commit_path(
    runner: ModelRunner, committed: list[int], tentative_of: dict[int, int], accepted_idx: list[int]
) -> None:
    """Keep the catch-up chain, the root and the accepted nodes the runner has run. A tree drafted without
    the model (rsd.lookup) ran nothing: the runner stays behind, and its next forward catches up."""
    if not tentative_of:
        return
    m = len(committed) - 1 - runner.cache_len  # catch-up chain length; the root follows it
    keep = list(range(m + 1)) + [tentative_of[n] for n in accepted_idx if n in tentative_of]
    runner.commit(keep)


class DraftStopped(Exception):
    """A draft was stopped between two forwards (ModelProposal's `stop` said so)."""


class ModelProposal:
    """rsd.drafting.Proposal backed by the draft model: each call runs the requested frontier nodes
    (new ones) through the draft runner, tree-masked, in one forward."""

    def __init__(
        self,
        runner: ModelRunner,
        committed: list[int],
        params: SamplingParams,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: Callable[[], bool] | None = None,
        forward: Forward = ModelRunner.forward,
        output_start: int | None = None,
        guide: Guide | None = None,
    ):
        self.runner, self.committed, self.stop, self.forward = runner, committed, stop, forward
        # Greedy drafting ranks children by the plain softmax of the biased, penalised logits (the target's
        # argmax is of those); its laws are never used for acceptance.
        self.params = dataclasses.replace(params, temperature=1.0, top_k=0, top_p=1.0) if params.greedy else params
        self.output_start = output_start  # committed[output_start:] is output, for the penalties (rsd.penalties)
        self.guide = guide  # structured output: each node's law is masked by its own automaton state
        self.top_k, self.top_p = top_k, top_p  # drafter-side truncation of the proposal
        self.tentative_of: dict[int, int] = {}  # tree node -> tentative index in the runner
        self.num_forwards = 0

    def __call__(self, token_ids: Tensor, parent_idx: Tensor, node_idx: Tensor) -> Tensor:
        nodes = node_idx.tolist()
        if self.stop is not None and self.stop():
            raise DraftStopped
        # The nodes, after any ancestor the runner has not run (a node whose law was looked up in the context,
        # rsd.lookup.HybridProposal): parents always come before children in a tree's numbering.
        ancestors = {a for n in nodes for a in [0, *path_to(parent_idx, n)] if a not in self.tentative_of}
        rows = sorted(ancestors - set(nodes)) + nodes
        if not self.tentative_of:  # the first forward: the root (plus any catch-up chain) heads the rows
            assert rows[0] == 0, "the first forward starts at the root"
            local = {n: i for i, n in enumerate(rows)}
            parents = torch.tensor([local[int(parent_idx[n])] if n else -1 for n in rows])
            m = len(self.committed) - 1 - self.runner.cache_len
            logits = forward_with_catch_up(
                self.runner, self.committed, token_ids[rows], parents, self.forward, logits_rows=len(nodes)
            )
            self.tentative_of.update({n: m + i for i, n in enumerate(rows)})
        else:
            base = self.runner.num_tentative
            index = {n: base + i for i, n in enumerate(rows)}
            parents = torch.tensor(
                [self.tentative_of.get(int(parent_idx[n]), index.get(int(parent_idx[n]))) for n in rows]
            )
            logits = self.forward(self.runner, token_ids[rows], parents, logits_rows=len(nodes))  # [F, V]
            self.tentative_of.update(index)
        self.num_forwards += 1
        if self.guide is not None:
            masks = self.guide.tree_masks(self.committed, token_ids, parent_idx, logits.shape[-1], nodes)  # [F, V]
            logits = mask_logits(logits, masks)
        return _same_prefix_same_law(self.law(logits, token_ids, parent_idx, node_idx), token_ids, parent_idx, nodes)

    def law(self, logits: Tensor, token_ids: Tensor, parent_idx: Tensor, node_idx: Tensor) -> Tensor:
        """The proposal law at nodes node_idx [F] of the tree (token_ids, parent_idx), from their draft logits
        [F, V] -> [F, V]: the sampling transform (penalties counted along each node's path), then truncation."""
        penalties, committed = self.params.penalties, self.committed
        counts = counts_at(penalties, committed, self.output_start, token_ids, parent_idx, node_idx, logits.device)
        return proposal_probs(logits, self.params, self.top_k, self.top_p, counts)


def _same_prefix_same_law(probs: Tensor, token_ids: Tensor, parent_idx: Tensor, nodes: list[int]) -> Tensor:
    """Nodes with equal paths (duplicate i.i.d. drafts) get bit-identical laws: K-SEQ treats them as
    one law, and float noise between two tree slots must not make them differ."""
    first: dict[tuple[int, ...], int] = {}
    for row, n in enumerate(nodes):
        key = tuple(token_ids[path_to(parent_idx, n)].tolist())
        if key in first:
            probs[row] = probs[first[key]]
        else:
            first[key] = row
    return probs


class Drafter:
    """The draft model of one session: drafts trees and follows the verdicts."""

    def __init__(
        self,
        runner: ModelRunner | None,
        top_k: int = 0,
        top_p: float = 1.0,
        forward: Forward = ModelRunner.forward,
        output_start: int | None = None,
        guide: Guide | None = None,
        vocab_size: int | None = None,
        lookup_n: int = 0,
    ):
        # forward: how the runner's forwards run (rsd_runtime.packed.PackedForwards.forward packs them
        # with other sessions' in the drafter service); guide: the generation's structured-output constraint.
        # runner None: a drafter for the methods that draft from the context alone (Method.draft_free).
        self.runner, self.top_k, self.top_p, self.forward, self.guide = runner, top_k, top_p, forward, guide
        # lookup_n > 0: a model's tree takes the context's law at nodes ending in a repeated n-gram of at least
        # lookup_n tokens (rsd.lookup.HybridProposal), skipping their draft forwards; 0: the model's law everywhere.
        self.lookup_n = lookup_n
        self.vocab_size = runner.vocab_size if runner is not None else vocab_size
        # Where the generation's output starts in the committed tokens (the penalties count from there;
        # rsd.penalties). Set by whoever starts a generation.
        self.output_start = output_start
        # The proposal of the last tree drafted (which tree nodes the runner ran): accept() commits
        # along it. rsd_runtime.predraft swaps it together with the runner's state.
        self.proposal: ModelProposal | LookupProposal | HybridProposal | None = None

    def draft(
        self,
        committed: list[int],
        method: Method,
        params: SamplingParams,
        rng: StepRandom,
        stop: Callable[[], bool] | None = None,
        grow: Callable | None = None,
    ) -> DraftTree:
        """The next tree; rng: StepRandom(seed, rule.draft_stream, len(committed) - 1). stop is asked before
        each forward; when it says True the draft raises DraftStopped. grow: the tree's gate (rsd.auto). The
        tree is on the CPU (what the wire sends); the laws are drawn from on the draft model's device."""
        if method.draft_free:
            self.proposal = LookupProposal(committed, self.vocab_size)
            return method.draft(self.proposal, committed[-1], rng, params.greedy, "cpu", grow)
        if self.runner is None:
            raise ValueError(f"method {method.name} needs a draft model")
        self.proposal = ModelProposal(
            self.runner, committed, params, self.top_k, self.top_p, stop, self.forward, self.output_start, self.guide
        )
        if self.lookup_n:
            dtype = torch.float64 if self.runner.dtype == torch.float64 else torch.float32  # proposal_probs'
            self.proposal = HybridProposal(
                self.proposal, committed, self.vocab_size, self.lookup_n, dtype, self.runner.device
            )
        return method.draft(self.proposal, committed[-1], rng, params.greedy, "cpu", grow)

    def accept(self, committed_before: list[int], verdict: Verdict) -> None:
        commit_path(self.runner, committed_before, self.proposal.tentative_of, verdict.accepted_idx)
        self.proposal = None

    @property
    def num_forwards(self) -> int:
        """Draft-model forwards of the tree being verified."""
        return self.proposal.num_forwards if self.proposal else 0


class AutoDrafter:
    """The auto method over a Drafter (rsd.auto): draft() plans one step and drafts it, observe() teaches the
    policy that step's verdict and costs. The drafter service and the in-process generator both drive it."""

    def __init__(self, drafter: Drafter, policy: AutoPolicy):
        self.drafter, self.policy = drafter, policy
        self.plan: Plan | None = None
        self.behind = 0  # the tokens the draft model ran first in the last step (model plans)

    def draft(self, committed: list[int], params: SamplingParams, rng: StepRandom) -> DraftTree:
        runner = self.drafter.runner  # behind the committed tokens, a model step's forward runs them too
        behind = 0 if runner is None else max(0, len(committed) - 1 - runner.cache_len)
        self.plan = plan = self.policy.plan(root_top(committed, self.drafter.vocab_size), behind)
        self.behind = behind if plan.kind == MODEL else 0
        return self.drafter.draft(committed, plan_method(plan), params, rng, None, self.policy.grow(plan, behind))

    def observe(
        self, tree: DraftTree, accepted: int, forward_ms: float, round_trip_ms: float, draft_ms: float, rows: int = 0
    ) -> None:
        """A model step whose forward also ran the tokens the runner was behind (steps drafted from the context
        or plain) teaches the catch-up cost, not a level's; one further behind (a prompt) teaches neither
        (rsd.auto.AutoPolicy.observe)."""
        tops = chain_tops(tree)
        self.policy.observe(self.plan, tops, accepted, forward_ms, round_trip_ms, draft_ms, rows, self.behind)


class Verifier:
    """The target model of one session: one forward over a tree, then the rule."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.last_forward_s = 0.0  # of the last verify(): the target forward; the rest is acceptance
        self.output_start: int | None = None  # as Drafter.output_start

    def verify(
        self,
        committed: list[int],
        tree: DraftTree,
        rule: Rule,
        params: SamplingParams,
        rng: StepRandom,
        guide: Guide | None = None,
    ) -> Verdict:
        """guide: structured output; each node's target law is masked by the state after its path."""
        target_probs = self.target_probs(committed, tree, params, guide)  # [N, V]
        verdict = verify(tree.to(target_probs.device), target_probs, rule, rng)
        offset = self._offset(committed)
        commit_path(self.runner, committed, {n: n + offset for n in range(tree.num_nodes)}, verdict.accepted_idx)
        return verdict

    def target_probs(
        self, committed: list[int], tree: DraftTree, params: SamplingParams, guide: Guide | None = None
    ) -> Tensor:
        """The target's law at every tree node [N, V] (float32 at least, on the target's device): one forward
        over the tree, then the same transforms as the draft's (masks, penalties along each node's path)."""
        t = time.perf_counter()
        logits = forward_with_catch_up(self.runner, committed, tree.token_ids, tree.parent_idx)  # [N, V]
        self.last_forward_s = time.perf_counter() - t
        if guide is not None:
            logits = mask_logits(logits, guide.tree_masks(committed, tree.token_ids, tree.parent_idx, logits.shape[-1]))
        nodes = torch.arange(tree.num_nodes)
        counts = self._counts(params, committed, tree.token_ids, tree.parent_idx, nodes, logits)  # per node's path
        return logits_to_probs(logits, params, counts)

    def _counts(self, params, committed, token_ids, parent_idx, node_idx, logits) -> TokenCounts | None:
        return counts_at(params.penalties, committed, self.output_start, token_ids, parent_idx, node_idx, logits.device)

    def _offset(self, committed: list[int]) -> int:
        return len(committed) - 1 - self.runner.cache_len

    def step_autoregressive(
        self, committed: list[int], params: SamplingParams, rng: StepRandom, guide: Guide | None = None
    ) -> int:
        """The target alone: one token from its law at the root (the draw (Draw.TOKEN, node 0)); with rng of
        Stream.COUPLED, argmax log q + G with the coupled rule's noise (rsd.coupled: what speculation under that rule
        emits, token for token)."""
        token_ids, parents = torch.tensor(committed[-1:]), torch.tensor([-1])
        logits = forward_with_catch_up(self.runner, committed, token_ids, parents)  # [1, V]
        if guide is not None:
            logits = mask_logits(logits, guide.tree_masks(committed, token_ids, parents, logits.shape[-1]))
        counts = self._counts(params, committed, token_ids, parents, torch.zeros(1, dtype=torch.long), logits)
        zero = torch.zeros((), dtype=torch.long, device=logits.device)
        probs = logits_to_probs(logits, params, counts)[0]  # [V]
        if rng.stream is Stream.COUPLED:
            token = coupled_token(probs.double(), rng, 0)
        else:
            token = int(sample(probs, rng.uniform(Draw.TOKEN, zero, zero)))
        self.runner.commit(list(range(self._offset(committed) + 1)))
        return token

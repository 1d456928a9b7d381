"""VerifierPool, the verifier service's engine: many sessions' draft trees scored by ONE target forward.
(rsd_runtime.engines.Verifier is the single-session counterpart; names: rsd_runtime.engines' docstring.)

Each session owns a slot of a preallocated KV pool (rsd_runtime.kvcache.SlotKVCache: per layer, keys/values
[num_slots, H_kv, max_len, D]).
Slot s holds the K/V of the session's committed tokens but the last one (the next tree's root), at
positions [0, cached_len). One verify_batch call:
    1. flattens, per request, the catch-up chain (committed tokens not cached yet) and the tree into one
       sequence (batch 1, length T = Σ (m_i + N_i)), with per-node position ids cached_len_i + depth
    2. runs the target once; every layer writes each segment's new K/V into its own slot right after
       cached_len_i, and attends with a block-diagonal float mask: a node of session i sees session i's
       cached prefix, its catch-up chain and its own tree ancestors only
    3. walks each tree with its own rule and draws (rsd.acceptance.verify), on the target's device, and reads
       the emitted tokens' log-probabilities off the same logits, or off the same laws (processed modes),
       when the request asks (rsd.logprobs)
    4. moves the accepted nodes' K/V (inside the slot) right after the chain and root; the rest is
       overwritten later. No whole-cache copy ever happens.
Shared prefixes (n sequences of one prompt, OpenAI's n): a request whose committed tokens begin with more tokens
than its slot holds, which another slot holds (or which an earlier request of the same call writes into its slot
in this very forward), attends to that slot's K/V for them instead of computing them again (Segment.prefix_slot),
and they are copied into its own slot when its verdict is committed (the source's commit keeps them: it only
moves nodes past its own committed tokens). The K/V of a token are a function of the tokens up to it
and their positions alone, so this changes no logit (bit for bit where the forward is batch-invariant:
rsd_runtime.models.batch_variance); each session keeps its own draws, so its tokens are those it gets alone.

Why not transformers' continuous batching (PagedAttentionCache + `paged|sdpa`): its input builder makes
a causal mask per request from its own scheduler state, with no way to hand it a tree mask, and its
cache is driven by its request manager. A slot pool with our own 4-D mask is a few dozen lines.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rsd.acceptance import Rule, Verdict, verify
from rsd.constraint import Guide, mask_logits
from rsd.logprobs import RAW_LOGPROBS, TokenLogprobs, emitted_rows, law_scores, token_scores
from rsd.penalties import TokenCounts, counts_at
from rsd.random import StepRandom
from rsd.sampling import SamplingParams, biased_logits, law_of
from rsd.tree import DraftTree, node_depths, tree_attention_mask, validate_tree
from rsd_runtime.attention import check_model
from rsd_runtime.kvcache import Segment, SlotKVCache, common_prefix_length
from rsd_runtime.runner import model_logits
from rsd_service.status import Exhausted, NotFound


class PoolFullError(Exhausted):
    """Every slot of the KV pool is taken."""


class UnknownSessionError(NotFound):
    """The session is not attached to the engine."""


class BatchVerifyError(RuntimeError):
    """Some requests of a packed step failed after the forward (e.g. their rule refused the tree).
    The others were committed: `verdicts` holds their Verdict (None for a failed one), `errors`
    maps each failed session id to its exception; failed sessions keep their cache unchanged."""

    def __init__(self, verdicts: list[Verdict | None], errors: dict[str, Exception]):
        super().__init__("; ".join(f"session {s!r}: {e}" for s, e in errors.items()))
        self.verdicts, self.errors = verdicts, errors


@dataclass(frozen=True)
class VerifyRequest:
    session_id: str
    committed_ids: list[int]  # the session's truth; committed_ids[-1] is the tree's root
    tree: DraftTree
    rule: Rule
    params: SamplingParams
    # The step's acceptance draws: StepRandom(seed, Stream.VERIFY, root position). Required when
    # sampling (T > 0); None is greedy's (T = 0: every law is one-hot, so no draw decides anything).
    rng: StepRandom | None = None
    # Return the emitted tokens' log-probabilities with this many top tokens each (0..20); None: none.
    num_top_logprobs: int | None = None
    # Structured output: each node's target law is masked by the automaton's state after its path.
    guide: Guide | None = None
    # committed_ids[output_start:] is the turn's output, which the penalties count (rsd.penalties); None:
    # unknown (refused when the params have penalties).
    output_start: int | None = None
    # Which figures the logprobs are (rsd.logprobs.LOGPROBS_MODES): raw or processed, log-probabilities or logits.
    logprobs_mode: str = RAW_LOGPROBS

    def check_rng(self) -> None:
        """ValueError when a sampling request comes without its draws."""
        if self.rng is None and not self.params.greedy:
            raise ValueError(
                f"session {self.session_id!r}: sampling at temperature {self.params.temperature} needs its draws"
            )


@dataclass(frozen=True)
class ScoredVerdict(Verdict):
    """A verdict with its tokens' log-probabilities (VerifyRequest.num_top_logprobs set; else None). Two compare
    equal when their verdicts do (the logprobs are a read-out of the same logits)."""

    logprobs: TokenLogprobs | None = field(default=None, compare=False)

    @property
    def verdict(self) -> Verdict:
        """The plain Verdict (to compare with rsd_runtime.engines.Verifier's)."""
        return Verdict(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Verdict)})


class VerifierPool:
    """The target model of many sessions, a KV slot each; see the module docstring."""

    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be >= 1, got {num_slots} and {max_len}")
        # A packed forward holds up to every slot's keys: what a window by cache index must cover.
        self.plan = check_model(model, num_slots * max_len)
        config = model.config.get_text_config()
        self.model, self.num_slots, self.max_len = model, num_slots, max_len
        self.vocab_size: int = config.vocab_size
        self.cache = SlotKVCache(config.num_hidden_layers, num_slots, max_len)
        self._slot_of: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest free slot
        self._cached: list[list[int]] = [[] for _ in range(num_slots)]  # tokens whose K/V sit in each slot
        self.num_shared_tokens = 0  # prefix tokens read off another session's slot instead of computed

    # ---- sessions -------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def attach(self, session_id: str, committed_ids: list[int]) -> int:
        """Give the session a slot (keeping its old one if attached) and crop its cache to the longest
        prefix of committed_ids[:-1] it holds. Returns the cached length (0 for a new session)."""
        if session_id not in self._slot_of:
            if not self._free:
                raise PoolFullError(f"all {self.num_slots} KV slots are taken; cannot attach {session_id!r}")
            slot = self._free.pop()
            self._slot_of[session_id], self._cached[slot] = slot, []
        return self._sync(self._slot_of[session_id], committed_ids)

    def release(self, session_id: str) -> None:
        slot = self._slot(session_id)
        del self._slot_of[session_id]
        self._cached[slot] = []
        self._free.append(slot)

    def cached_length(self, session_id: str) -> int:
        return len(self._cached[self._slot(session_id)])

    def _slot(self, session_id: str) -> int:
        if session_id not in self._slot_of:
            raise UnknownSessionError(f"session {session_id!r} is not attached")
        return self._slot_of[session_id]

    def _sync(self, slot: int, committed_ids: list[int]) -> int:
        """Crop the slot to its longest prefix equal to committed_ids[:-1] (a restarted run may differ)."""
        n = common_prefix_length(self._cached[slot], committed_ids[:-1])
        del self._cached[slot][n:]
        return n

    # ---- the packed step ------------------------------------------------------------------------
    def verify_batch(self, requests: list[VerifyRequest]) -> list[ScoredVerdict]:
        """One target forward over every request's tree, then each rule; keeps each accepted path."""
        segments, logits = self._forward(requests)
        verdicts: list[ScoredVerdict | None] = []
        errors: dict[str, Exception] = {}
        for req, seg, lg in zip(requests, segments, logits, strict=True):
            try:
                masked = lg
                if req.guide is not None:
                    tree = req.tree
                    masks = req.guide.tree_masks(req.committed_ids, tree.token_ids, tree.parent_idx, lg.shape[-1])
                    masked = mask_logits(lg, masks)  # [N, V]
                processed = biased_logits(masked, req.params, _node_counts(req, lg))  # [N, V] float32 at least
                probs = law_of(processed, req.params)  # [N, V]: the target laws the rule samples from
                verdict = verify(req.tree.to(probs.device), probs, req.rule, req.rng)
                verdict = _scored(verdict, req, lg, processed, probs)
            except Exception as e:  # one bad tree must not cost the others their step
                verdicts.append(None)
                errors[req.session_id] = e
                continue
            self._commit(seg, req, verdict)
            verdicts.append(verdict)
        if errors:
            raise BatchVerifyError(verdicts, errors)
        return verdicts

    def score_batch(self, requests: list[VerifyRequest]) -> list[Tensor]:
        """The packed forward alone: each tree's logits [N_i, V] float32. Nothing is committed (the new
        K/V written after each cached prefix are tentative and overwritten by the next call)."""
        return self._forward(requests)[1]

    @torch.inference_mode()
    def _forward(self, requests: list[VerifyRequest]) -> tuple[list[Segment], list[Tensor]]:
        self._validate(requests)
        ids, pos, rows, segments, start, cache_off = [], [], [], [], 0, 0
        own_cached = [self._sync(self._slot_of[req.session_id], req.committed_ids) for req in requests]
        for i, req in enumerate(requests):
            slot = self._slot_of[req.session_id]
            source, cached = self._prefix_source(requests[:i], segments, slot, req.committed_ids[:-1], own_cached[i])
            self.num_shared_tokens += cached - own_cached[i]
            behind = req.committed_ids[cached:-1]  # catch-up chain
            m, n = len(behind), req.tree.num_nodes
            # The segment's own columns: the chain is causal, the tree sees the whole chain and its ancestors.
            own = torch.zeros(m + n, m + n, dtype=torch.bool)  # [m + N, m + N]
            own[:m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
            own[m:, :m] = True
            own[m:, m:] = tree_attention_mask(req.tree.parent_idx.cpu())
            rows.append((cache_off, cached, own))
            ids += behind + req.tree.token_ids.tolist()
            pos.append(cached + torch.cat([torch.arange(m), m + node_depths(req.tree.parent_idx.cpu())]))  # [m + N]
            segments.append(Segment(slot, cached, start, m + n, None if source == slot else source))
            start, cache_off = start + m + n, cache_off + cached
        total, device = start, self.model.device
        # Block-diagonal: a node of session i sees session i's cached prefix, chain and own ancestors only.
        allowed = torch.zeros(total, cache_off + total, dtype=torch.bool)  # [T, Σcached + T]
        for seg, (off, cached, own) in zip(segments, rows, strict=True):
            r = slice(seg.start, seg.start + seg.length)
            allowed[r, off : off + cached] = True
            allowed[r, cache_off + seg.start : cache_off + seg.start + seg.length] = own
        q_pos = torch.cat(pos)  # [T]
        k_pos = torch.cat([torch.arange(seg.cached) for seg in segments] + [q_pos])  # [Σcached + T]
        # Float additive masks (eager adds a bool mask as +1/+0), sliding windows by position.
        mask = self.plan.masks(allowed.to(device), q_pos.to(device), k_pos.to(device), self.model.dtype)
        # Logits for the tree nodes only: a catch-up chain (a new session's prompt) needs none.
        nodes = [req.tree.num_nodes for req in requests]
        tree_rows = torch.cat(
            [torch.arange(s.start + s.length - n, s.start + s.length) for s, n in zip(segments, nodes, strict=True)]
        )
        self.cache.segments = segments
        try:
            logits = model_logits(
                self.model,
                tree_rows,
                total,
                input_ids=torch.tensor([ids], dtype=torch.long, device=device),  # [1, T]
                attention_mask=mask,
                position_ids=q_pos[None].to(device),  # [1, T]
                cache=self.cache,
                use_cache=True,
            )  # [Σ N_i, V]
        finally:
            self.cache.segments = []
        return segments, list(logits.split(nodes))

    def _prefix_source(
        self, earlier: list[VerifyRequest], segments: list[Segment], slot: int, prefix: list[int], own: int
    ) -> tuple[int, int]:
        """(the slot whose K/V the request attends to for its first tokens, how many): its own slot and the `own`
        tokens it holds, unless another slot holds more of `prefix` at the same positions. An earlier request of
        the call that reads its own slot holds its whole committed prefix there once its segment is written (the
        layers write every segment before reading any cached prefix); any other slot holds what `_cached` says
        (synced already: a later request of the call writes past it)."""
        if own >= len(prefix):  # a running session's step: its slot holds all of it (the search is for prefills)
            return slot, own
        holds = {s: self._cached[s] for s in self._slot_of.values()}
        for req, seg in zip(earlier, segments, strict=True):
            if seg.prefix_slot is None:
                holds[seg.slot] = req.committed_ids[:-1]
        best, source = own, slot
        for other, tokens in holds.items():
            n = common_prefix_length(tokens, prefix) if other != slot else 0
            if n > best:
                best, source = n, other
        return source, best

    def _validate(self, requests: list[VerifyRequest]) -> None:
        if not requests:
            raise ValueError("verify_batch needs at least one request")
        seen = set()
        for req in requests:
            self._slot(req.session_id)  # raises for an unknown session
            if req.session_id in seen:
                raise ValueError(f"session {req.session_id!r} appears twice in one batch")
            seen.add(req.session_id)
            if not req.committed_ids:
                raise ValueError(f"session {req.session_id!r}: committed_ids is empty")
            req.check_rng()  # refuse a sampling request without its draws before the forward
            req.params.check_vocab(self.vocab_size)  # logit_bias ids
            tree = req.tree
            validate_tree(tree.token_ids, tree.parent_idx, self.vocab_size)
            if int(tree.token_ids[0]) != req.committed_ids[-1]:
                raise ValueError(
                    f"session {req.session_id!r}: the tree's root {int(tree.token_ids[0])} is not the last "
                    f"committed token {req.committed_ids[-1]}"
                )
            bad = [t for t in req.committed_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"session {req.session_id!r}: committed token {bad[0]} outside the vocabulary")
            if len(req.committed_ids) - 1 + tree.num_nodes > self.max_len:  # cached + chain + tree
                raise ValueError(
                    f"session {req.session_id!r}: {len(req.committed_ids) - 1} committed + {tree.num_nodes} "
                    f"tree tokens exceed max_len={self.max_len}"
                )

    @torch.inference_mode()  # the pool buffers are inference tensors
    def _commit(self, seg: Segment, req: VerifyRequest, verdict: Verdict) -> None:
        """Keep chain + root + accepted nodes, contiguous after the old cached prefix."""
        m = seg.length - req.tree.num_nodes
        if seg.prefix_slot is not None:  # the shared prefix, into the session's own slot for its next steps
            self.cache.copy_prefix(seg.prefix_slot, seg.slot, len(self._cached[seg.slot]), seg.cached)
        keep = list(range(m + 1)) + [m + n for n in verdict.accepted_idx]  # offsets inside the segment
        self.cache.commit(seg.slot, seg.cached, keep)
        self._cached[seg.slot] = req.committed_ids + verdict.accepted_ids


def _node_counts(req: VerifyRequest, logits: Tensor) -> TokenCounts | None:
    """The penalties' counts at every node of req's tree, each along its own path (rsd.penalties)."""
    tree, penalties, nodes = req.tree, req.params.penalties, torch.arange(req.tree.num_nodes)
    return counts_at(
        penalties, req.committed_ids, req.output_start, tree.token_ids, tree.parent_idx, nodes, logits.device
    )


def _scored(verdict: Verdict, req: VerifyRequest, logits: Tensor, processed: Tensor, probs: Tensor) -> ScoredVerdict:
    """The verdict with its tokens' log-probabilities when req asks (req.logprobs_mode's figures): the tree's
    logits, processed logits (masked, biased, penalised) and laws, each [N, V]."""
    logprobs = None
    if req.num_top_logprobs is not None:
        rows = emitted_rows(verdict.accepted_idx)  # [M] nodes
        scores = law_scores(req.logprobs_mode, logits[rows], processed[rows], probs[rows], req.params.temperature)
        logprobs = token_scores(scores, torch.tensor(verdict.token_ids), req.num_top_logprobs)
    return ScoredVerdict(**{f.name: getattr(verdict, f.name) for f in dataclasses.fields(verdict)}, logprobs=logprobs)

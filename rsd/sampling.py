"""Sampling transforms and samplers.

The same transform (logit bias, then the penalties, then temperature, then top-k, then top-p) must be applied to the
target's logits and to the draft's logits: exactness holds for the laws actually used, and a mismatch
between the law a token was sampled from and the law used to verify it silently changes the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rsd.penalties import Penalties, TokenCounts, penalised
from rsd.random import Draw, StepRandom, Stream

MIN_TEMPERATURE = 1e-2  # below it (but 0) logits / temperature can overflow float32: refused, not clamped
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: a bias of -100 bans a token in practice, +100 all but forces it
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty: [-2, 2]


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean 'off'.

    logit_bias: ((token id, bias), ...) in increasing id, each bias in [-100, 100], added to the logits
    before everything else (OpenAI's logit_bias). A transform of the law like the others, applied to the
    target's and the draft's logits alike, so speculative decoding stays exact for the biased law.

    presence_penalty, frequency_penalty (in [-2, 2], 0 = off) and repetition_penalty (> 0, 1 = off):
    rsd.penalties, applied after logit_bias and before temperature (as vLLM); the law then depends on the
    tokens before it, so callers pass each row's TokenCounts (rsd.penalties.node_counts).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}: below that "
                "logits / temperature can overflow and the law is greedy up to float rounding anyway"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        ids = [token_id for token_id, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(t < 0 for t in ids):
            raise ValueError(f"logit_bias token ids must be distinct, increasing and >= 0, got {ids[:8]}")
        bad = next((b for _, b in self.logit_bias if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS), None)
        if bad is not None:
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bad}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:  # NaN fails too
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be finite and > 0 (1 = off), got {self.repetition_penalty}")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError unless every token id of logit_bias is in [0, vocab_size)."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            token_id = self.logit_bias[-1][0]
            raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)


def truncate(probs: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Keep the top_k most likely tokens, then the smallest head whose mass reaches top_p; renormalise.

    probs [..., V] -> [..., V]. Ties at the cut are broken by torch.topk / sort order, the same
    way on both sides because both call this function.
    """
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1)
        probs = torch.zeros_like(probs).scatter_(-1, kth.indices, kth.values)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., V] mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the first token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_BLOCK = 64  # entries per block of the block-maximum searches below


def _block_maxima(x: Tensor) -> Tensor:
    """x [F, V] -> the maximum of each block of _BLOCK entries [F, V // _BLOCK] (the tail is left out)."""
    num_blocks = x.shape[-1] // _BLOCK
    return x[:, : num_blocks * _BLOCK].reshape(x.shape[0], num_blocks, _BLOCK).amax(-1)


def _in_blocks(x: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor]:
    """The entries of x [F, V] in the given blocks [F, b] and in the tail: (values, indices) [F, b * _BLOCK + tail]."""
    start = x.shape[-1] // _BLOCK * _BLOCK
    idx = (blocks.unsqueeze(-1) * _BLOCK + torch.arange(_BLOCK, device=x.device)).flatten(1)  # [F, b * _BLOCK]
    idx = torch.cat([idx, torch.arange(start, x.shape[-1], device=x.device).expand(x.shape[0], -1)], -1)
    return x.gather(-1, idx), idx


def nonzero_ids(probs: Tensor) -> list[Tensor]:
    """The ids of each row's nonzero entries, increasing: probs [F, V] -> F tensors [S_f] int64.

    For sparse laws (a top-k law: 256 of 151,936 ids) a third of the time of Tensor.nonzero: one reduction
    finds the blocks holding positive entries and only those are searched. Rows with a negative, NaN or
    infinite entry are searched entry by entry (they are nonzero too, and the caller refuses them).
    """
    if probs.dim() != 2:
        raise ValueError(f"nonzero_ids takes [F, V], got {list(probs.shape)}")
    if not probs.numel() or not (float(probs.min()) >= 0 and math.isfinite(float(probs.sum()))):
        return [row.nonzero().flatten() for row in probs]
    maxima = _block_maxima(probs) > 0  # [F, B]
    tail = torch.arange(maxima.shape[-1] * _BLOCK, probs.shape[-1], device=probs.device)
    block = torch.arange(_BLOCK, device=probs.device)
    out = []
    for row, positive in zip(probs, maxima, strict=True):
        idx = torch.cat([(positive.nonzero() * _BLOCK + block).flatten(), tail])  # increasing
        out.append(idx[row[idx] > 0])
    return out


def top_k_indices(x: Tensor, k: int) -> Tensor:
    """Indices [F, k] of the k largest entries of each row of x [F, V], largest first (ties: any order).

    The same set as torch.topk, in a fraction of its time when k << V: a top-k entry lies in a block whose
    maximum is among the k largest block maxima (else k blocks, each holding a larger entry, would outrank
    it), so only those blocks are searched.
    """
    if x.dim() != 2 or k * _BLOCK * 4 > x.shape[-1]:  # too few blocks to gain anything
        return torch.topk(x, k, dim=-1).indices
    values, idx = _in_blocks(x, torch.topk(_block_maxima(x), k, dim=-1).indices)
    return idx.gather(-1, torch.topk(values, k, dim=-1).indices)


def biased_logits(logits: Tensor, params: SamplingParams, counts: TokenCounts | None = None) -> Tensor:
    """logits [..., V] plus params.logit_bias, then the penalties (logits [F, V] then) with each row's counts
    (rsd.penalties.TokenCounts [F, U]; required when params has penalties), in float32 (float64 stays
    float64); a new tensor when changed."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if params.logit_bias:
        params.check_vocab(logits.shape[-1])
        ids = torch.tensor([t for t, _ in params.logit_bias], device=logits.device)  # [E]
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=dtype, device=logits.device)  # [E]
        logits = logits.clone()
        logits[..., ids] += bias
    if params.penalties.on:
        if counts is None:  # a law without its history would be the unpenalised one: refused, never guessed
            raise ValueError("penalties need the token counts of every row (rsd.penalties.node_counts)")
        logits = penalised(logits, params.penalties, counts)
    return logits


def proposal_probs(
    logits: Tensor, params: SamplingParams, top_k: int = 0, top_p: float = 1.0, counts: TokenCounts | None = None
) -> Tensor:
    """truncate(logits_to_probs(logits, params), top_k, top_p), [F, V] -> [F, V]: a drafter's proposal law.

    Where the only truncation is a top-k (the smaller of params.top_k and top_k; top-p off) the law is a
    softmax over the k largest logits, computed from them alone (top_k_indices): one pass over V
    instead of a softmax, a top-k and a normalisation over all of it. The same law up to float rounding
    and the order of ties at the cut (it is the law the drafter samples from and sends, so exactness
    holds either way: the verifier judges each proposal with the law it was drawn from).
    """
    ks = [k for k in (params.top_k, top_k) if k > 0]
    k = min(ks) if ks else 0
    if params.greedy or params.top_p < 1.0 or top_p < 1.0 or not 0 < k < logits.shape[-1] or logits.dim() != 2:
        return truncate(logits_to_probs(logits, params, counts), top_k, top_p)
    if params.logit_bias or params.penalties.on:
        logits = biased_logits(logits, params, counts)  # [F, V]; plain logits stay as they are (no pass over V)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    idx = top_k_indices(logits, k)  # [F, k]
    kept = torch.softmax(logits.gather(-1, idx).to(dtype) / params.temperature, dim=-1)  # [F, k]
    return torch.zeros(logits.shape, dtype=dtype, device=logits.device).scatter_(-1, idx, kept)


def logits_to_probs(logits: Tensor, params: SamplingParams, counts: TokenCounts | None = None) -> Tensor:
    """logits [..., V] -> probs [..., V] in float32 (float64 stays float64); counts: each row's, for the
    penalties (biased_logits).

    Temperature 0 gives the one-hot argmax (of the biased, penalised logits), so every acceptance rule
    degenerates to greedy matching.
    """
    return law_of(biased_logits(logits, params, counts), params)


def law_of(biased: Tensor, params: SamplingParams) -> Tensor:
    """The law sampled from, given logits already biased and penalised (biased_logits): [..., V] -> [..., V].
    The one-hot argmax at temperature 0, else the softmax at the temperature cut by top-k and top-p."""
    if params.greedy:
        return torch.zeros_like(biased).scatter_(-1, biased.argmax(-1, keepdim=True), 1.0)
    probs = torch.softmax(biased / params.temperature, dim=-1)
    return truncate(probs, params.top_k, params.top_p)


def check_probs(probs: Tensor, name: str = "probs") -> None:
    """Raise ValueError unless every row of probs [..., V] is a law one can sample from: finite,
    non-negative, with positive mass. (Rows need not sum to 1: samplers normalise implicitly.)"""
    mass = probs.sum(-1)  # [...]: NaN or inf when an entry is
    if mass.numel() == 0 or (
        probs.shape[-1] > 0 and float(probs.min()) >= 0 and float(mass.min()) > 0 and float(mass.max()) < math.inf
    ):
        return
    rows = probs.reshape(mass.numel(), probs.shape[-1])  # [R, V]
    bad = ~(torch.isfinite(rows).all(-1) & (rows >= 0).all(-1) & (rows.sum(-1) > 0))  # [R]
    r = int(bad.nonzero()[0])
    where = f" (row {r} of {tuple(probs.shape[:-1])})" if probs.dim() > 1 else ""
    raise ValueError(
        f"{name}{where} is not a law to sample from: it needs finite, non-negative entries with positive "
        f"mass, got {rows[r, :8].tolist()}{' ...' if rows.shape[-1] > 8 else ''}"
    )


def sample(probs: Tensor, u: Tensor) -> Tensor:
    """One draw per row from probs [..., V] by inversion, given one uniform per row u [...] in (0, 1):
    the first id whose cumulative mass exceeds u times the row's mass -> ids [...].

    One uniform a draw (rsd.random keys it), on the law's own device. Zero-probability tokens add
    no mass, so they are never the first to exceed it; a row with no mass, or a NaN, would give
    token 0 silently, so check_probs refuses it first.
    """
    check_probs(probs)
    if u.shape != probs.shape[:-1]:
        raise ValueError(f"sample needs one uniform per row: probs {list(probs.shape)}, u {list(u.shape)}")
    cdf = probs.to(torch.float64).cumsum(-1)  # [..., V] non-decreasing
    ids = torch.searchsorted(cdf, (u.to(torch.float64) * cdf[..., -1]).unsqueeze(-1), right=True).squeeze(-1)
    return torch.minimum(ids, cdf.argmax(-1))  # u * mass can round up to the mass: the last id with mass


def support(probs: Tensor) -> tuple[Tensor, Tensor | None]:
    """The rows of probs [..., V] cut to their support, for samplers: (values [..., S], ids [..., S]) with
    S the largest support, each row's nonzero entries first, most likely first, then zeros; ids None when
    every entry is positive (values is probs then). A truncated draft law (top-k 256 of 151,936 tokens)
    is drawn from in [F, 256] instead of [F, V]: the same law and, since draws are keyed by token id
    (rsd.random), the same draws, with far fewer float64 ops."""
    values, ids = probs, None
    if probs.dim() == 2 and probs.numel():
        # Sparse rows (a top-k law): only blocks with a positive entry can hold the support.
        maxima = _block_maxima(probs)  # [F, B]
        num_blocks = int((maxima > 0).sum(-1).max())
        if num_blocks > 0 and num_blocks * _BLOCK * 4 <= probs.shape[-1]:
            values, ids = _in_blocks(probs, torch.topk(maxima, num_blocks, dim=-1).indices)  # [F, C] each
    s = int((values > 0).sum(-1).max()) if values.numel() else 0
    if s == probs.shape[-1]:
        return probs, None
    top = torch.topk(values, max(s, 1), dim=-1)
    return top.values, top.indices if ids is None else ids.gather(-1, top.indices)


def support_by_id(probs: Tensor) -> tuple[Tensor, Tensor | None]:
    """support(probs) with each row's entries in increasing id order, for inversion: a uniform then picks the
    token it picks over all of V."""
    values, ids = support(probs)  # [..., S] each
    if ids is not None:
        ids, order = ids.sort(-1)
        values = values.gather(-1, order)
    return values, ids


def without_replacement(
    probs: Tensor, k: int, rng: StepRandom, node_idx: Tensor, depth: int = 0
) -> tuple[Tensor, Tensor]:
    """Ordered sample of k tokens without replacement from each row of probs [F, V] at tree nodes node_idx [F]:
    x_1 ~ p, x_2 ~ p without x_1 renormalised, ... (the Plackett-Luce law Gumbel-top-k samples), each by
    inversion with one uniform, rng's (Draw.ORDERED, node, rank). -> ids [F, k] in sampling order, valid [F, k]
    (False past a row's support size).

    A Gumbel-top-k needs a Philox counter per token (151,936 of them: ~15 ms a node on two cores); this needs k
    cumulative sums over the support. Stream.COUPLED keeps gumbel_top_k: rsd.coupled needs the noise itself.
    """
    if rng.stream is Stream.COUPLED:
        return gumbel_top_k(probs, k, rng, node_idx, depth)
    check_probs(probs)
    values, ids = support_by_id(probs)  # [F, S] each
    values = values.to(torch.float64)
    size = (values > 0).sum(-1)  # [F]
    u = rng.uniform(Draw.ORDERED, node_idx[:, None], torch.arange(k, device=probs.device))  # [F, k]
    rows = torch.arange(values.shape[0], device=probs.device)  # [F]
    picked = []
    for i in range(k):
        left = size > i  # [F]: rows with a token left to draw
        if i and not bool(left.any()):
            picked += [picked[-1]] * (k - i)
            break
        col = sample(torch.where(left[:, None], values, 1.0), u[:, i])  # [F]; an exhausted row draws a dummy
        values = values.index_put((rows, col), torch.zeros((), dtype=values.dtype, device=values.device))
        picked.append(col)
    cols = torch.stack(picked, -1)  # [F, k]
    valid = torch.arange(k, device=probs.device) < size[:, None]  # [F, k]
    top_ids = cols if ids is None else ids.gather(-1, cols)
    return top_ids.masked_fill(~valid, 0), valid


def gumbel_top_k(probs: Tensor, k: int, rng: StepRandom, node_idx: Tensor, depth: int = 0) -> tuple[Tensor, Tensor]:
    """Ordered sample of k tokens without replacement from each row of probs [F, V], the law at tree
    node node_idx [F] (at `depth`, which keys the noise under Stream.COUPLED: StepRandom.gumbel).

    Perturb log p with Gumbel noise and take the top k keys, largest first: that is a Plackett-Luce
    sample, i.e. x_1 ~ p, x_2 ~ p restricted to V minus {x_1} renormalised, ... The noise of token t at
    node n is rng's (Draw.GUMBEL, n, t), whatever the support cut or the order of the rows.
    Returns ids [F, k] in sampling order and valid_mask [F, k] (False past a row's support size,
    where no further distinct token exists). Drawn over the rows' support (see support()).
    """
    check_probs(probs)
    values, ids = support(probs)  # [F, S] each
    noise = rng.gumbel(node_idx, ids, probs.shape[-1], depth)  # [F, S]
    keys = torch.log(values.to(torch.float64)) + noise  # [F, S]
    top = torch.topk(keys, min(k, keys.shape[-1]), dim=-1)  # [F, <= k]
    top_ids = top.indices if ids is None else ids.gather(-1, top.indices)
    valid = torch.isfinite(top.values)
    short = k - top_ids.shape[-1]  # a support smaller than k: no further distinct token
    if short > 0:
        top_ids = torch.cat([top_ids, top_ids.new_zeros(top_ids.shape[0], short)], -1)
        valid = torch.cat([valid, valid.new_zeros(valid.shape[0], short)], -1)
    return top_ids, valid

"""Counter-based randomness: every uniform a step uses is a pure function of its key.

A speculative step draws in two streams, the drafter's (Stream.DRAFT: the tree's children) and the
verifier's (Stream.VERIFY: acceptance tests, the correction or bonus token); under the coupled rule
(rsd.coupled) both read a third, Stream.COUPLED, whose Gumbel noise is keyed by the absolute position of
the token it picks instead of by node. A draw is addressed by

    key      seed                                     all 64 bits
    counter  (column, node, draw << 8 | stream, root position)   four 32-bit words

and its value is Philox4x32-10 (Salmon et al., SC 2011; the generator behind torch's and JAX's GPU
sampling) of that counter under that key. `column` is a token id (a node's Gumbel noise, one per
token), a child's rank (its acceptance test) or a draw's rank (i.i.d. children); `draw` says which
of those it is (Draw). Philox is a bijection of the counter for a fixed key, so no two keys share a
draw: nothing depends on what ran before (a tree drafted ahead for a predicted verdict, a re-run
after a failover and a resumed session draw what an uninterrupted run draws at that position), on
which other sessions share a forward, on the law's dtype or on the device. The arithmetic is 32-bit
words held in int64 tensors, products split so that none passes 2^49: exact on every device, so a
draw has the same bits on CPU and CUDA. Nothing here holds state; there is no generator to carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_ROUNDS = 10


class Stream(IntEnum):
    """The random streams of a session."""

    DRAFT = 0  # the drafter's: which children a tree gets
    VERIFY = 1  # the verifier's: acceptance tests and the emitted token
    COUPLED = 2  # shared by drafter and verifier under the coupled rule: Gumbel noise per position (gumbel())


class Draw(IntEnum):
    """What a uniform is for; the counter's third word keeps each use apart."""

    GUMBEL = 0  # a node's Gumbel noise (RSD-S; every method's children under Stream.COUPLED): column = token id
    IID = 1  # a node's i.i.d. children (SpecInfer, SpecTr): column = the draw's rank
    ACCEPT = 2  # the acceptance test of a node's k-th child: column = k
    TOKEN = 3  # the correction or bonus token emitted at a node (or an autoregressive token): column 0
    BLOCK = 4  # Stream.COUPLED: a block of token ids' first arrival (StepRandom.first_arrivals): column = block
    ORDERED = 5  # a node's children without replacement by inversion (SD, RSD-C): column = the child's rank


def philox4x32(counter: Tensor, key: tuple[int, int]) -> Tensor:
    """Philox4x32-10: counter [4, ...] (four 32-bit words in int64) and two 32-bit key words -> the four
    32-bit output words [4, ...]. Matches Random123's known-answer vectors (tests/rsd/test_random.py).

    Each round multiplies words 0 and 2 by constants and keeps both halves of the 64-bit products; a
    word is split into 16-bit halves first, so no partial product passes 2^49 and int64 never overflows.
    """
    shape = counter.shape
    c = counter.reshape(4, -1)  # [4, n]
    m = torch.tensor([[_M0], [_M1]], dtype=torch.int64, device=c.device)  # [2, 1]
    k = torch.tensor([[key[0]], [key[1]]], dtype=torch.int64, device=c.device)  # [2, 1]
    w = torch.tensor([[_W0], [_W1]], dtype=torch.int64, device=c.device)  # [2, 1]
    for _ in range(_ROUNDS):
        x = c[0::2]  # [2, n]: words 0 and 2
        lo_part = (x & 0xFFFF) * m  # < 2^48
        hi_part = (x >> 16) * m  # < 2^48
        low = lo_part.add_((hi_part & 0xFFFF) << 16)  # < 2^49: the product is hi_part >> 16 << 32 plus this
        hi = hi_part.bitwise_right_shift_(16).add_(low >> 32)  # [2, n] high words
        low.bitwise_and_(_MASK32)  # [2, n] low words
        mixed = hi.flip(0).bitwise_xor_(c[1::2]).bitwise_xor_(k)  # hi1 ^ c1 ^ k0, hi0 ^ c3 ^ k1
        c = torch.stack([mixed[0], low[1], mixed[1], low[0]])  # [4, n]
        k = (k + w) & _MASK32
    return c.reshape(shape)


def _philox_ints(c0: int, c1: int, c2: int, c3: int, k0: int, k1: int) -> tuple[int, int, int, int]:
    """philox4x32 of one counter in Python ints: for a few counters, cheaper than ~150 tensor ops."""
    for _ in range(_ROUNDS):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK32
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


_BLOCK_BITS = 7
COUPLED_BLOCK = 1 << _BLOCK_BITS  # Stream.COUPLED draws its noise in blocks of this many token ids (arrivals)
_FEW = 64  # up to this many counters _philox_ints is the faster (same bits: tests/rsd/test_random.py)


def _to_uniform(hi: Tensor, lo: Tensor) -> Tensor:
    """Two 32-bit words -> a float64 uniform in (0, 1): (k + 1/2) / 2^52 for the 52-bit k they start
    with. Every step is exact in float64 (k < 2^52), so the value is the same on every device."""
    k = (hi << 20) | (lo >> 12)  # [...] < 2^52
    return (k.to(torch.float64) + 0.5) * 2.0**-52


@dataclass(frozen=True)
class StepRandom:
    """The draws of one step of one stream: StepRandom(seed, stream, root_position).uniform(draw, node_idx,
    column_idx). root_position is the absolute position of the step's root, len(committed) - 1.

    Column c is half of counter (c >> 1, node, draw << 8 | stream, root position): words 0-1 give even
    columns, words 2-3 odd ones, so a node's draws over a whole vocabulary cost one counter per two.
    """

    seed: int
    stream: Stream
    root_position: int

    def __post_init__(self) -> None:
        if not 0 <= self.root_position <= _MASK32:
            raise ValueError(f"root_position must be in [0, 2^32), got {self.root_position}")
        object.__setattr__(self, "stream", Stream(self.stream))

    def _words(self, draw: Draw, nodes: Tensor, halves: Tensor) -> Tensor:
        """Philox words [4, ...] of the counters (halves, nodes, draw << 8 | stream, root position)."""
        for name, ids in (("node", nodes), ("column", halves)):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > _MASK32):
                raise ValueError(f"{name} ids must be in [0, 2^32), got {int(ids.min())}..{int(ids.max())}")
        halves, nodes = torch.broadcast_tensors(halves, nodes)
        tag, seed = (int(Draw(draw)) << 8) | int(self.stream), self.seed & ((1 << 64) - 1)
        key = (seed & _MASK32, seed >> 32)
        if halves.numel() <= _FEW:
            counters = zip(halves.flatten().tolist(), nodes.flatten().tolist(), strict=True)
            words = [_philox_ints(h, n, tag, self.root_position, *key) for h, n in counters]  # [n][4]
            return torch.tensor(words, dtype=torch.int64, device=halves.device).T.reshape(4, *halves.shape)
        counter = torch.stack(
            [halves, nodes, torch.full_like(halves, tag), torch.full_like(halves, self.root_position)]
        )
        return philox4x32(counter, key)

    def uniform(self, draw: Draw, node_idx: Tensor | int, column_idx: Tensor) -> Tensor:
        """Uniforms in (0, 1), float64, on column_idx's device: one for each (node, column) of node_idx and
        column_idx broadcast together (node_idx [F, 1], column_idx [F, C] -> [F, C])."""
        columns = column_idx.to(torch.int64)
        nodes = torch.as_tensor(node_idx, dtype=torch.int64, device=columns.device)
        words = self._words(draw, nodes, columns >> 1)  # [4, ...]
        odd = (columns & 1).bool()
        return _to_uniform(torch.where(odd, words[2], words[0]), torch.where(odd, words[3], words[1]))

    def uniform_rows(self, draw: Draw, node_idx: Tensor, num_columns: int) -> Tensor:
        """uniform(draw, node_idx[:, None], arange(num_columns)) [F, num_columns], each counter computed once."""
        halves = torch.arange((num_columns + 1) // 2, dtype=torch.int64, device=node_idx.device)  # [H]
        words = self._words(draw, node_idx.to(torch.int64)[:, None], halves[None])  # [4, F, H]
        u = torch.stack([_to_uniform(words[0], words[1]), _to_uniform(words[2], words[3])], -1)  # [F, H, 2]
        return u.flatten(-2)[:, :num_columns]

    def gumbel(self, node_idx: Tensor, token_ids: Tensor | None, vocab_size: int = 0, depth: int = 0) -> Tensor:
        """Standard Gumbel noise -log(-log(u)) [F, S], float64, keyed by (node, token id) (Draw.GUMBEL):
        token_ids [F, S] for each row of node_idx [F], or None for every id of a vocabulary [F, vocab_size].

        Stream.COUPLED keys it by (position, token id) instead: the nodes node_idx, all at `depth`, pick
        the token at absolute position root_position + depth + 1, and every node there shares that noise,
        in whichever step and tree it is drawn (rsd.coupled). It is -log T for that position's arrivals T.
        """
        if self.stream is Stream.COUPLED:  # token_ids None: every row is the position's one vector
            return -torch.log(self.arrivals(token_ids, depth, vocab_size, node_idx.device)).expand(len(node_idx), -1)
        if token_ids is None:
            u = self.uniform_rows(Draw.GUMBEL, node_idx, vocab_size)
        else:
            u = self.uniform(Draw.GUMBEL, node_idx[:, None], token_ids)
        return -torch.log(-torch.log(u))

    def arrivals(self, token_ids: Tensor | None, depth: int, vocab_size: int = 0, device=None) -> Tensor:
        """Stream.COUPLED's noise as arrival times T(v), i.i.d. Exp(1) over token ids v, for the token at position
        root_position + depth + 1: [...] float64 like token_ids, or [vocab_size] for every id (token_ids None; on
        `device`, each counter drawn once). Gumbel noise is -log T, and argmax log q + G is argmin T / q (an
        exponential race).

        They are drawn in blocks of COUPLED_BLOCK ids so that a sampler can bound a token's T without drawing
        it (rsd.coupled.coupled_token): block b's first arrival m_b ~ Exp(1) / COUPLED_BLOCK falls on the
        id b * COUPLED_BLOCK + a_b, a_b uniform; every other id of the block arrives at m_b + Exp(1), each
        independently (the exponential law forgets). So the T are i.i.d. Exp(1), and T(v) >= m_b.
        """
        position = self._position(depth)
        if token_ids is None:
            ids = torch.arange(vocab_size, device=device)
            blocks = torch.arange(-(-vocab_size // COUPLED_BLOCK), device=device)  # [B]
            index = ids // COUPLED_BLOCK  # [V]
            u = position.uniform_rows(Draw.GUMBEL, torch.zeros(1, dtype=torch.int64, device=device), vocab_size)[0]
        else:
            ids = token_ids.to(torch.int64)
            blocks, index = torch.unique(ids // COUPLED_BLOCK, return_inverse=True)  # [B], [...]
            u = position.uniform(Draw.GUMBEL, 0, ids)
        first, where = self.first_arrivals(blocks, depth)  # [B] each
        own = -torch.log(u)  # [...] Exp(1)
        return torch.where(ids % COUPLED_BLOCK == where[index], first[index], first[index] + own)

    def _position(self, depth: int) -> StepRandom:
        """Stream.COUPLED's draws for the token at absolute position root_position + depth + 1, in any step."""
        return StepRandom(self.seed, self.stream, self.root_position + depth + 1)

    def first_arrivals(self, blocks: Tensor, depth: int) -> tuple[Tensor, Tensor]:
        """Stream.COUPLED: each block's first arrival m_b [...] float64 and the offset a_b [...] int64 in the block
        of the id it falls on (arrivals), for the token at position root_position + depth + 1."""
        if self.stream is not Stream.COUPLED:
            raise ValueError(f"arrivals are Stream.COUPLED's noise, not {self.stream.name}'s")
        words = self._position(depth)._words(Draw.BLOCK, torch.zeros_like(blocks), blocks.to(torch.int64))  # [4, ...]
        first = -torch.log(_to_uniform(words[0], words[1])) / COUPLED_BLOCK  # Exp(1) / 128: exact division
        return first, words[2] >> (32 - _BLOCK_BITS)  # the word's top bits: uniform in [0, COUPLED_BLOCK)

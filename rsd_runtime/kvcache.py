"""The KV cache of tree-attention forwards: preallocated buffers written in place, as transformers Caches.

Shape contract, every layer of both kinds:
    keys, values  [S, H_kv, max_len, D]   S slots, H_kv key/value heads, D head dim (from the first keys seen)
    slot s holds one sequence's K/V in position order at [0, length_s); entries past length_s are stale and
    are overwritten before they are read, so dropping tokens (crop) never touches the buffers.
Two kinds share that core (KVLayer / KVCache: allocation, move, commit):
    SequenceKVCache  S = 1, one sequence (rsd_runtime.runner.ModelRunner). update() appends after the
                     filled part and returns views [1, H_kv, filled, D]: no step copies the whole cache.
    SlotKVCache      S sessions (verifier_service.engine.VerifierPool). One packed call (`segments`) writes
                     each segment's new K/V into its slot after its cached prefix and returns
                     cat(cached prefixes of every segment, then all new tokens) [1, H_kv, Σcached + T, D];
                     a segment may read its prefix from another slot holding the same tokens (`prefix_slot`:
                     n sequences of one prompt share its prefill), copied over afterwards (copy_prefix).
Public operations: commit(slot, start, keep) keeps the tokens at start + keep[i] at start + i (the accepted
chain of a tree, in place), crop(length) (SequenceKVCache) drops every token from `length` on;
common_prefix_length() says how much of a cached sequence still matches the committed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share: what a cache holding `a` keeps when the truth is `b`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class KVLayer(CacheLayerMixin):
    """One decoder layer's keys and values [S, H_kv, max_len, D], allocated at the first update."""

    is_compileable = False
    is_croppable = False

    def __init__(self, num_slots: int, max_len: int):
        super().__init__()
        self.num_slots, self.max_len = num_slots, max_len

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        # Sizes, dtype and device come from the first keys the layer sees: no config guessing.
        _, num_heads, _, k_dim = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros(self.num_slots, num_heads, self.max_len, k_dim)  # [S, H_kv, max_len, D]
        self.values = value_states.new_zeros(self.num_slots, num_heads, self.max_len, value_states.shape[-1])
        self.is_initialized = True

    def write(self, slot: int, start: int, key_states: Tensor, value_states: Tensor) -> None:
        """Store key/value states [H_kv, n, D] at slot positions [start, start + n)."""
        end = start + key_states.shape[-2]
        self.keys[slot, :, start:end] = key_states
        self.values[slot, :, start:end] = value_states

    def move(self, slot: int, src_pos: Tensor, dst_start: int) -> None:
        """Copy slot positions `src_pos` to [dst_start, dst_start + len(src_pos)) of the same slot."""
        if self.is_initialized:
            dst = slice(dst_start, dst_start + src_pos.shape[0])
            # index_select gathers into a new tensor first: sources and targets may overlap.
            self.keys[slot, :, dst] = self.keys[slot].index_select(1, src_pos)
            self.values[slot, :, dst] = self.values[slot].index_select(1, src_pos)

    def get_max_length(self) -> int:
        return self.max_len


class KVCache(Cache):
    """A transformers Cache made of KVLayers, one per decoder layer."""

    def __init__(self, layers: list[KVLayer]):
        super().__init__(layers=layers)

    def move(self, slot: int, src_pos: Tensor, dst_start: int) -> None:
        for layer in self.layers:
            layer.move(slot, src_pos, dst_start)

    def commit(self, slot: int, start: int, keep: Sequence[int]) -> None:
        """Keep the K/V at slot positions start + keep[i] at start + i (keep: increasing offsets)."""
        if list(keep) != list(range(len(keep))):  # otherwise they already sit where they belong
            device = self.layers[0].keys.device if self.layers[0].is_initialized else None
            self.move(slot, torch.tensor(keep, device=device) + start, start)


# ---- one sequence ---------------------------------------------------------------------------------


class SequenceKVLayer(KVLayer):
    """The layer of one sequence (S = 1). `num_filled` counts committed plus tentative tokens."""

    def __init__(self, max_len: int):
        super().__init__(1, max_len)
        self.num_filled = 0

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.num_filled, self.num_filled + key_states.shape[-2]
        self.write(0, start, key_states[0], value_states[0])  # [H_kv, n, D]
        self.num_filled = end
        return self.keys[:, :, :end], self.values[:, :, :end]  # [1, H_kv, end, D] views

    def crop(self, length: int) -> None:
        self.num_filled = length

    def save(self, start: int) -> tuple[Tensor, Tensor] | None:
        """Copies of the K/V at [start, num_filled)."""
        if not self.is_initialized:
            return None
        return self.keys[:, :, start : self.num_filled].clone(), self.values[:, :, start : self.num_filled].clone()

    def restore(self, start: int, saved: tuple[Tensor, Tensor] | None) -> None:
        """Write back what save(start) copied; the layer then holds exactly what it held then."""
        if saved is not None:
            keys, values = saved
            self.write(0, start, keys[0], values[0])
            self.num_filled = start + keys.shape[2]
        else:
            self.num_filled = start

    def copy_from(self, other: SequenceKVLayer, start: int) -> None:
        """Hold what `other` holds: its K/V at [start, other.num_filled) are copied, those below `start`
        are taken to be equal already."""
        if other.is_initialized and other.num_filled > start:
            if not self.is_initialized:
                self.lazy_initialization(other.keys[:, :, :1], other.values[:, :, :1])
            new = slice(start, other.num_filled)
            self.write(0, start, other.keys[0, :, new], other.values[0, :, new])
        self.num_filled = other.num_filled

    def reset(self) -> None:
        self.num_filled = 0  # stale entries are overwritten before they are read

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_filled + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_filled


class SequenceKVCache(KVCache):
    """The cache of one sequence: SequenceKVLayers."""

    def __init__(self, num_layers: int, max_len: int):
        super().__init__([SequenceKVLayer(max_len) for _ in range(num_layers)])

    def crop(self, length: int) -> None:
        """Drop every token from position `length` on. (transformers' own Cache.crop, replaced here, takes a
        count of tokens to remove; nothing in a tree forward calls it.)"""
        for layer in self.layers:
            layer.crop(length)


# ---- a pool of slots, packed calls ----------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One request's part of a packed forward over a SlotKVCache."""

    slot: int
    cached: int  # K/V already in the slot: positions [0, cached)
    start: int  # offset of its new tokens in the packed sequence
    length: int  # new tokens (the verifier: catch-up chain m + tree N)
    # The slot whose [0, cached) the segment attends to: its own, or one holding the same tokens at those
    # positions (written by an earlier segment of this call, or before it), copied into `slot` after the call.
    prefix_slot: int | None = None

    @property
    def source(self) -> int:
        return self.slot if self.prefix_slot is None else self.prefix_slot


class SlotKVLayer(KVLayer):
    """One layer of the slot pool; the packed call in flight is the cache's `segments`.

    update() copies the cached prefixes once per layer and step (the concatenation); a custom attention
    function registered through transformers' AttentionInterface that reads the slot ids and lengths from
    the forward's kwargs (and attends to the slots directly) would avoid it.
    """

    def __init__(self, cache: SlotKVCache):
        super().__init__(cache.num_slots, cache.max_len)
        self.cache = cache

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = [], []
        for s in self.cache.segments:
            new = slice(s.start, s.start + s.length)
            self.write(s.slot, s.cached, key_states[0, :, new], value_states[0, :, new])  # [H_kv, len, D]
            keys.append(self.keys[s.source, :, : s.cached])  # [H_kv, cached, D] view (read at the cat below,
            values.append(self.values[s.source, :, : s.cached])  # after every segment's write)
        keys.append(key_states[0])  # [H_kv, T, D]
        values.append(value_states[0])
        return torch.cat(keys, 1)[None], torch.cat(values, 1)[None]  # [1, H_kv, Σcached + T, D]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return sum(s.cached for s in self.cache.segments)


class SlotKVCache(KVCache):
    """The slot pool: SlotKVLayers; `segments` describes the packed call in flight."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int):
        self.num_slots, self.max_len = num_slots, max_len
        self.segments: list[Segment] = []
        super().__init__([SlotKVLayer(self) for _ in range(num_layers)])

    def copy_prefix(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy slot src's K/V at positions [start, end) to the same positions of slot dst (every layer)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[dst, :, start:end] = layer.keys[src, :, start:end]
                layer.values[dst, :, start:end] = layer.values[src, :, start:end]

"""Tree-attention forward passes over one sequence of any HF causal LM, on a preallocated KV cache.

Words used below:
    committed   tokens whose K/V sit in the cache at positions [0, cache_len)
    tentative   tokens run by forward() since the last commit(); their K/V sit right after the
                committed ones, at [cache_len, cache_len + num_tentative), in the order they ran
A tentative token attends to the whole committed prefix, its tentative ancestors and itself; its
position is cache_len + its depth (a token whose parent is -1 has depth 0). commit() keeps one
chain of tentative tokens and drops the others; crop(length) drops committed tokens from `length` on.
The K/V live in an rsd_runtime.kvcache.SequenceKVCache (one slot, written in place).

Example: a prompt [a, b, c] then a draft tree with two candidates for the next token:
    runner.forward([a, b, c], [-1, 0, 1]); runner.commit([0, 1, 2])   # prefill, cache_len = 3
    runner.forward([x, y], [-1, -1])        # siblings x and y, both at position 3
    runner.forward([z], [1])                # z after y, position 4; attends to a b c y z
    runner.commit([1, 2])                   # keep y z: cache_len = 5, x is dropped
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rsd.tree import node_depths, tree_attention_mask
from rsd_runtime.attention import AttentionPlan, check_model
from rsd_runtime.kvcache import SequenceKVCache
from rsd_runtime.lean import lean_decoder


@dataclass(frozen=True)
class RunnerState:
    """ModelRunner.save(start): the runner's committed length, tentative tokens and the K/V from
    `start` on. Positions below `start` must not change until it is restored."""

    start: int
    cache_len: int
    parents: tuple[int, ...]
    layers: tuple[tuple[Tensor, Tensor] | None, ...]


@dataclass(frozen=True)
class PreparedForward:
    """ModelRunner.prepare: one forward's n new tokens with their mask and positions, not run yet."""

    token_ids: Tensor  # [n]
    parents: list[int]  # [n] each token's tentative parent index, or -1
    allowed: Tensor  # [n, cache_len + T] bool: what each new token may attend to (T tentative after it ran)
    q_pos: Tensor  # [n] the new tokens' positions
    k_pos: Tensor  # [cache_len + T] the keys' positions
    logits_rows: int  # the last logits_rows of the n new tokens get logits (a catch-up chain needs none)


def model_logits(model: PreTrainedModel, rows: Tensor, total: int, **inputs) -> Tensor:
    """model(**inputs) over `total` positions -> float32 logits [R, V] at positions rows [R] (long).
    Only those rows go through the output layer where the model's forward takes logits_to_keep (a
    prefill's catch-up chain needs no logits: the output layer is a large share of a token's multiply-adds in
    a model with a large vocabulary, and [T, V] float32 logits a large copy); else sliced after."""
    rows = rows.to(model.device)
    lean = lean_decoder(model)  # a drafter's lean forward (rsd_runtime.lean)
    if lean is not None and isinstance(inputs["attention_mask"], Tensor):
        return lean(inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"], inputs["cache"], rows)
    if len(rows) == total:
        return model(**inputs).logits[0].float()
    if _takes_logits_to_keep(type(model)):
        return model(**inputs, logits_to_keep=rows).logits[0].float()
    return model(**inputs).logits[0][rows].float()


@functools.cache
def _takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


class ModelRunner:
    """Tree-attention runner for one sequence (batch 1); see the module docstring."""

    def __init__(self, model: PreTrainedModel, max_len: int = 4096, plan: AttentionPlan | None = None):
        # Refuses, with the reason, what a tree mask cannot express (plan: another runner's of this model
        # and max_len, checked already).
        self.plan = plan if plan is not None else check_model(model, max_len)
        config = model.config.get_text_config()
        self.model = model
        self.max_len = max_len
        self.vocab_size: int = config.vocab_size
        self.device = model.device
        self.dtype = model.dtype
        self.cache = SequenceKVCache(config.num_hidden_layers, max_len)
        self.cache_len = 0
        self._parents: list[int] = []  # per tentative token: index of its tentative parent, or -1

    @property
    def num_tentative(self) -> int:
        return len(self._parents)

    def reset(self) -> None:
        """Drop every committed and tentative token."""
        self.cache.reset()
        self.cache_len = 0
        self._parents = []

    @torch.inference_mode()
    def save(self, start: int) -> RunnerState:
        """The state to come back to (restore) after trying tokens that may be thrown away: the K/V at
        [start, cache_len + num_tentative) are copied; start <= cache_len."""
        if not 0 <= start <= self.cache_len:
            raise ValueError(f"save start {start} must be in [0, cache_len={self.cache_len}]")
        layers = tuple(layer.save(start) for layer in self.cache.layers)
        return RunnerState(start, self.cache_len, tuple(self._parents), layers)

    @torch.inference_mode()
    def restore(self, state: RunnerState) -> None:
        """Back to the saved state, bit for bit (positions below state.start were not touched since)."""
        for layer, saved in zip(self.cache.layers, state.layers, strict=True):
            layer.restore(state.start, saved)
        self.cache_len, self._parents = state.cache_len, list(state.parents)

    @torch.inference_mode()
    def copy_from(self, other: ModelRunner, start: int = 0) -> None:
        """Become a copy of `other` (a runner of the same model): its committed and tentative tokens.
        Only the K/V from position `start` on are copied: below it both must hold the same already
        (copied before, and neither cropped below it since)."""
        if other.model is not self.model or not 0 <= start <= min(self.cache_len, other.cache_len):
            raise ValueError(f"copy_from needs a runner of the same model and start <= both cache lengths, got {start}")
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.copy_from(theirs, start)
        self.cache_len, self._parents = other.cache_len, list(other._parents)

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, parent_idx: Tensor, logits_rows: int | None = None) -> Tensor:
        """Run n new tentative tokens; parent_idx indexes all tentative tokens since the last commit
        (earlier calls first) or is -1 for a child of the last committed token. Returns the logits of
        the last logits_rows tokens (default all n): [logits_rows, V] float32."""
        return self.run(self.prepare(token_ids, parent_idx, logits_rows))

    @torch.inference_mode()
    def run(self, step: PreparedForward) -> Tensor:
        """Run a forward prepared by prepare() (nothing ran on this runner since); -> logits
        [step.logits_rows, V] float32."""
        dev, n = self.device, len(step.parents)
        # Float additive masks (eager adds a bool mask as +1/+0, silently wrong), windows by position.
        mask = self.plan.masks(step.allowed.to(dev), step.q_pos.to(dev), step.k_pos.to(dev), self.dtype)
        try:
            logits = model_logits(
                self.model,
                torch.arange(n - step.logits_rows, n),
                n,
                input_ids=step.token_ids.to(dev, torch.long)[None],  # [1, n]
                attention_mask=mask,
                position_ids=step.q_pos[None].to(dev),  # [1, n]
                cache=self.cache,
                use_cache=True,
            )
        except BaseException:
            self.undo()
            raise
        self.ran(step)
        return logits

    def prepare(self, token_ids: Tensor, parent_idx: Tensor, logits_rows: int | None = None) -> PreparedForward:
        """Validate a forward's tokens and work out its mask and positions; nothing runs yet. The forward
        itself (this runner's, or a packed one over many runners: rsd_runtime.packed) then writes the
        new K/V through self.cache and calls ran(); on failure, undo(). logits_rows: see forward()."""
        parents = self._validate_forward(token_ids, parent_idx)
        n = len(parents)
        logits_rows = n if logits_rows is None else logits_rows
        if not 1 <= logits_rows <= n:
            raise ValueError(f"logits_rows must be in [1, {n}] (the new tokens), got {logits_rows}")
        num_old = self.num_tentative
        all_parents = self._parents + parents
        # rsd.tree wants one root: prepend a virtual root standing for the last committed token.
        tree_parents = torch.tensor([-1] + [p + 1 for p in all_parents])  # [1 + T]
        new_rows = tree_attention_mask(tree_parents)[1 + num_old :, 1:]  # [n, T] bool
        tentative_pos = self.cache_len + node_depths(tree_parents)[1:] - 1  # [T]
        # Every new token sees the whole committed prefix; only the tentative part varies.
        allowed = torch.ones(len(parents), self.cache_len + len(all_parents), dtype=torch.bool)  # [n, cache_len + T]
        allowed[:, self.cache_len :] = new_rows
        key_pos = torch.cat([torch.arange(self.cache_len), tentative_pos])  # [cache_len + T]
        return PreparedForward(token_ids, parents, allowed, tentative_pos[num_old:], key_pos, logits_rows)

    def ran(self, step: PreparedForward) -> None:
        """The prepared forward ran: its tokens are tentative now."""
        self._parents = self._parents + step.parents

    def undo(self) -> None:
        """A forward failed part way: drop the K/V its layers wrote already."""
        self.cache.crop(self.cache_len + self.num_tentative)

    @torch.inference_mode()
    def commit(self, keep_idx: Tensor | Sequence[int]) -> None:
        """Keep the K/V of a chain of tentative tokens (a -1-parent token first, then each one's
        child) right after the cache, and drop every other tentative token. [] drops them all."""
        keep = keep_idx.tolist() if isinstance(keep_idx, Tensor) else [int(i) for i in keep_idx]
        self._validate_chain(keep)
        self.cache.commit(0, self.cache_len, keep)
        self.cache_len += len(keep)
        self.cache.crop(self.cache_len)  # the dropped tokens' K/V get overwritten later
        self._parents = []

    def crop(self, length: int) -> None:
        """Keep the first `length` committed tokens; drop the later ones and every tentative token."""
        if not 0 <= length <= self.cache_len:
            raise ValueError(f"crop length {length} must be in [0, cache_len={self.cache_len}]")
        self.cache.crop(length)
        self.cache_len = length
        self._parents = []

    def _validate_forward(self, token_ids: Tensor, parent_idx: Tensor) -> list[int]:
        if token_ids.dim() != 1 or parent_idx.dim() != 1 or token_ids.shape != parent_idx.shape:
            raise ValueError(
                f"token_ids and parent_idx must be 1-D of one length, got {tuple(token_ids.shape)} "
                f"and {tuple(parent_idx.shape)}"
            )
        if token_ids.dtype.is_floating_point or parent_idx.dtype.is_floating_point:
            raise ValueError("token_ids and parent_idx must be integer tensors")
        n = token_ids.shape[0]
        if n == 0:
            raise ValueError("forward needs at least one token")
        if self.cache_len + self.num_tentative + n > self.max_len:
            raise ValueError(
                f"{self.cache_len} committed + {self.num_tentative} tentative + {n} new tokens "
                f"exceed max_len={self.max_len}"
            )
        bad = ((token_ids < 0) | (token_ids >= self.vocab_size)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"token {i} has id {int(token_ids[i])} outside the vocabulary [0, {self.vocab_size})")
        parents = parent_idx.tolist()
        for i, p in enumerate(parents):
            if not -1 <= p < self.num_tentative + i:
                raise ValueError(
                    f"token {i} has parent {p}: a parent must be -1 or an earlier tentative token "
                    f"(< {self.num_tentative + i})"
                )
        return parents

    def _validate_chain(self, keep: list[int]) -> None:
        expected_parent = -1
        for i in keep:
            if not 0 <= i < self.num_tentative:
                raise ValueError(f"commit index {i} is not a tentative token (there are {self.num_tentative})")
            if self._parents[i] != expected_parent:
                raise ValueError(
                    f"commit indices {keep} are not a chain: token {i} has parent {self._parents[i]}, "
                    f"expected {expected_parent}"
                )
            expected_parent = i


# How a drafter runs a runner's forward: ModelRunner.forward itself, or packed with other sessions'
# (rsd_runtime.packed.PackedForwards.forward). (runner, token_ids [n], parent_idx [n], logits_rows=None)
# -> logits [logits_rows or n, V].
Forward = Callable[..., Tensor]

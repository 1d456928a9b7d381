"""Many sessions' draft forwards as ONE model forward: batched drafting across sessions.

The drafter service drafts each session's tree in its own worker thread, level by level (one
ModelRunner.forward per level). A level of one session is a handful of tokens, and a forward of a few
tokens costs about what one token costs (the weights are read once either way: rsd_runtime.small_gemm
on the CPU, tensor cores on a GPU), so forwards of many sessions are gathered and run together:

    packer = PackedForwards(model, max_kv_len=max_sessions * max_len)
    drafter = Drafter(runner, forward=packer.forward)   # each session's thread, its own runner
    with packer.drafting():                              # around each thread's draft
        tree = drafter.draft(...)                        # its forwards join the others'

forward() blocks its thread until its tokens ran. The first thread to find every drafting thread
waiting (or max_rows reached, or the wait used up) runs one packed forward (forward_packed) for all
of them while the others sleep; sessions that are not drafting (a tree out for verification) are not
waited for. The wait for a drafting thread that has not asked yet (it is still sampling its last
level) lasts up to max(wait_s, the last packed forward's duration): leaving it out costs it a forward
of its own later, about that long.
Each runner keeps its own KV cache: a packed layer writes each segment's new K/V into its runner's cache
and hands the model the concatenation of the segments' keys, with a block-diagonal mask (a token sees
its own runner's keys only, by that runner's tree mask).

Exactness does not depend on it: each tree carries the law its children were drawn from. What packing
changes is rounding: a row's logits in a packed forward equal its lone forward's to float rounding,
not bit for bit, so with other sessions drafting at the same time a seeded run may (rarely, at a
near-tie) draft a different tree than the same run alone. A lone session runs exactly its own forward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from rsd_runtime.attention import AttentionPlan, check_model
from rsd_runtime.runner import ModelRunner, PreparedForward, model_logits


class _PackedLayer(CacheLayerMixin):
    """One decoder layer of a packed forward: segment i's new K/V go to runner i's own layer."""

    is_compileable = False
    is_croppable = False

    def __init__(self, layers: list, sizes: list[int]):
        super().__init__()
        self.layers, self.sizes = layers, sizes  # sizes: new tokens per segment, in packing order
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # each runner's layer allocates its own buffers

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        keys, values = [], []
        parts = zip(self.layers, key_states.split(self.sizes, 2), value_states.split(self.sizes, 2), strict=True)
        for layer, k, v in parts:
            seg_keys, seg_values = layer.update(k, v)  # [1, H_kv, cached + tentative + new, D] views
            keys.append(seg_keys)
            values.append(seg_values)
        return torch.cat(keys, 2), torch.cat(values, 2)  # [1, H_kv, Σ kv_len_i, D]

    def get_seq_length(self) -> int:
        return sum(layer.get_seq_length() for layer in self.layers)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return sum(layer.get_max_length() for layer in self.layers)


@torch.inference_mode()
def forward_packed(
    model: PreTrainedModel, plan: AttentionPlan, steps: list[tuple[ModelRunner, PreparedForward]]
) -> list[Tensor]:
    """Run every runner's prepared forward (ModelRunner.prepare) in one model call; -> each one's
    logits [logits_rows_i, V] float32 (the last logits_rows_i of its n_i tokens). The runners must be
    distinct and hold `model`; plan must cover Σ kv_len_i keys (check_model(model, that many)). One
    step alone is that runner's own forward."""
    if len({id(r) for r, _ in steps}) != len(steps):
        raise ValueError("a runner appears twice in one packed forward")
    if any(r.model is not model for r, _ in steps):
        raise ValueError("every runner of a packed forward must hold the packed model")
    if len(steps) == 1:
        runner, step = steps[0]
        return [runner.run(step)]
    sizes = [len(step.parents) for _, step in steps]
    kv_sizes = [step.allowed.shape[1] for _, step in steps]
    # Block-diagonal: segment i's rows see segment i's keys (its runner's cache, then its new tokens).
    allowed = torch.zeros(sum(sizes), sum(kv_sizes), dtype=torch.bool)  # [T, Σ kv_len_i]
    row = col = 0
    for (_, step), n, kv in zip(steps, sizes, kv_sizes, strict=True):
        allowed[row : row + n, col : col + kv] = step.allowed
        row, col = row + n, col + kv
    q_pos = torch.cat([step.q_pos for _, step in steps])  # [T]
    k_pos = torch.cat([step.k_pos for _, step in steps])  # [Σ kv_len_i]
    dev = model.device
    mask = plan.masks(allowed.to(dev), q_pos.to(dev), k_pos.to(dev), model.dtype)
    num_layers = len(steps[0][0].cache.layers)
    cache = Cache(layers=[_PackedLayer([r.cache.layers[i] for r, _ in steps], sizes) for i in range(num_layers)])
    ends = torch.tensor(sizes).cumsum(0).tolist()
    keep = [step.logits_rows for _, step in steps]
    rows = torch.cat([torch.arange(end - k, end) for end, k in zip(ends, keep, strict=True)])  # [Σ logits_rows_i]
    try:
        logits = model_logits(
            model,
            rows,
            ends[-1],
            input_ids=torch.cat([step.token_ids for _, step in steps]).to(dev, torch.long)[None],  # [1, T]
            attention_mask=mask,
            position_ids=q_pos[None].to(dev),  # [1, T]
            cache=cache,
            use_cache=True,
        )
    except BaseException:
        for runner, _ in steps:
            runner.undo()
        raise
    for runner, step in steps:
        runner.ran(step)
    return list(logits.split(keep))  # [logits_rows_i, V] each


@dataclass
class PackedStats:
    forwards: int = 0  # packed forwards run
    calls: int = 0  # runner forwards they served
    rows: int = 0  # tokens they ran
    max_calls: int = 0  # most runner forwards in one packed forward


@dataclass(eq=False)
class _Call:
    runner: ModelRunner
    step: PreparedForward
    arrived: float
    logits: Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class PackedForwards:
    """Gathers the concurrent draft forwards of many threads into packed forwards; see the module docstring.

    max_rows: at most this many new tokens per packed forward (more wait for the next one; a single
    larger call runs alone). wait_s: the least a forward waits for drafting threads that are not waiting
    yet (the wait stretches to the last packed forward's duration).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_kv_len: int,
        max_rows: int = 256,
        wait_s: float = 0.02,
        run: Callable[..., list[Tensor]] | None = None,
    ):
        if max_rows < 1 or wait_s < 0:
            raise ValueError(f"max_rows must be >= 1 and wait_s >= 0, got {max_rows} and {wait_s}")
        self.model, self.max_rows, self.wait_s = model, max_rows, wait_s
        # run(fn, *args): where the packed forward runs (rsd_runtime.compute.ComputeThread.run); None: here
        self.run = run if run is not None else (lambda fn, *args: fn(*args))
        self.plan = check_model(model, max_kv_len)  # a packed forward's keys: up to every session's cache
        self.stats = PackedStats()
        self._cond = threading.Condition()
        self._drafting = 0  # threads inside drafting()
        self._pending: list[_Call] = []
        self._busy = False  # a packed forward is running
        self._last_forward_s = 0.0  # how long the last packed forward took

    @contextmanager
    def drafting(self) -> Iterator[None]:
        """Marks a thread that will call forward() soon: packed forwards wait (up to wait_s) for it."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self, n: int = 1) -> None:
        """drafting() by hand, for n threads at once: counted from now (a forward asked before they
        start waits for them); each calls leave() when it is done."""
        with self._cond:
            self._drafting += n

    def leave(self) -> None:
        with self._cond:
            self._drafting -= 1
            self._cond.notify_all()  # one fewer to wait for

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Inside drafting(): this thread now waits for other threads (not for a forward of its own), so
        packed forwards do not wait for it meanwhile."""
        self.leave()
        try:
            yield
        finally:
            self.enter()

    def forward(
        self, runner: ModelRunner, token_ids: Tensor, parent_idx: Tensor, logits_rows: int | None = None
    ) -> Tensor:
        """ModelRunner.forward(token_ids, parent_idx, logits_rows), packed with other threads' forwards.
        Bad input raises here, in the caller's thread, before anything is queued."""
        call = _Call(runner, runner.prepare(token_ids, parent_idx, logits_rows), time.perf_counter())
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()
            while not call.done:
                wait = self._wait_left()
                if wait is not None and wait <= 0:
                    self._run_batch()
                else:
                    self._cond.wait(wait)
        if call.error is not None:
            raise call.error
        return call.logits

    def _wait_left(self) -> float | None:
        """Seconds until the pending forwards should run (<= 0: now); None while one is running."""
        if self._busy or not self._pending:
            return None
        rows = sum(len(c.step.parents) for c in self._pending)
        if len(self._pending) >= self._drafting or rows >= self.max_rows:
            return 0.0
        return self._pending[0].arrived + max(self.wait_s, self._last_forward_s) - time.perf_counter()

    def _run_batch(self) -> None:
        """Run the oldest pending forwards as one (the caller holds the lock; it is let go meanwhile)."""
        batch, rows = [], 0
        while self._pending and (not batch or rows + len(self._pending[0].step.parents) <= self.max_rows):
            batch.append(self._pending.pop(0))
            rows += len(batch[-1].step.parents)
        self._busy = True
        self._cond.release()
        t0 = time.perf_counter()
        try:
            try:
                results = self.run(forward_packed, self.model, self.plan, [(c.runner, c.step) for c in batch])
                for c, logits in zip(batch, results, strict=True):
                    c.logits = logits
            except BaseException as e:  # every call of the batch learns it (each runner was undone)
                for c in batch:
                    c.error = e
        finally:
            self._cond.acquire()
            self._busy, self._last_forward_s = False, time.perf_counter() - t0
            for c in batch:
                c.done = True
            s = self.stats
            s.forwards, s.calls, s.rows = s.forwards + 1, s.calls + len(batch), s.rows + rows
            s.max_calls = max(s.max_calls, len(batch))
            self._cond.notify_all()

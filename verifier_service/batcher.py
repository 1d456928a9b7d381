"""Gathers the trees of many sessions into one VerifierPool.verify_batch call.

Each Verify stream submits its session's VerifyRequest and awaits the verdict. One worker task
takes the waiting requests in arrival order (at most max_batch_nodes new tokens, at least one
request, one request per session), waiting at most batch_wait_ms after the first arrival for
others, and runs verify_batch in a worker thread. The engine is not thread-safe: only that worker
calls it, and anything else that touches it (attach, release) holds `engine_lock`, which the
worker holds for the whole forward. Trees that arrive while a forward runs wait for the next one,
so under load batches fill without waiting.

A request the engine refuses must not cost the others their step: when a packed call fails
before committing anything (ValueError from validation), its requests are retried one by one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from rsd.acceptance import Verdict
from rsd_runtime.compute import ComputeThread
from verifier_service.engine import BatchVerifyError, VerifierPool, VerifyRequest

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class BatchInfo:
    """What one verdict's forward looked like (VerifierStats on the wire)."""

    queue_ms: float
    forward_ms: float
    num_sessions: int
    num_nodes: int


@dataclass
class BatcherStats:
    num_forwards: int = 0
    num_trees: int = 0
    max_sessions: int = 0  # most sessions packed into one forward so far
    num_multi_session_forwards: int = 0


@dataclass
class _Pending:
    request: VerifyRequest
    num_nodes: int  # tree nodes + prefill chain: the rows it adds to the packed forward
    on_verdict: Callable[[Verdict, BatchInfo], object]
    future: asyncio.Future
    submitted: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(
        self,
        engine: VerifierPool,
        max_batch_nodes: int,
        batch_wait_ms: float,
        batching: bool = True,
        compute: ComputeThread | None = None,
    ):
        self.engine = engine
        self.compute = compute  # where the packed forwards run (rsd_runtime.compute); None: any worker thread
        self.max_batch_nodes = max_batch_nodes
        self.batch_wait_s = batch_wait_ms / 1000
        self.batching = batching
        self.engine_lock = asyncio.Lock()
        self.stats = BatcherStats()
        self._pending: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None
        # Sessions that may still submit a tree (the servicer counts open Verify streams): when all
        # of them are queued already, waiting for more only adds latency (a lone session paid
        # ~batch_wait_ms per step before this).
        self.open_sessions: Callable[[], int] | None = None
        # Metrics (rsd_service.metrics.VerifierMetrics): called after each forward with the rows each
        # request added and the forward's seconds.
        self.on_forward: Callable[[list[int], float], None] | None = None

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name="verifier-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        for item in self._pending:
            if not item.future.done():
                item.future.set_exception(RuntimeError("the verifier is stopping"))
        self._pending.clear()

    @property
    def num_queued(self) -> int:
        """Trees waiting for a forward."""
        return len(self._pending)

    async def submit(self, request: VerifyRequest, num_nodes: int, on_verdict: Callable[[Verdict, BatchInfo], T]) -> T:
        """Queue one session's tree; returns on_verdict(verdict, info), or raises what the engine raised.

        on_verdict runs in the worker as soon as the engine has committed the verdict, even when the
        submitter was cancelled meanwhile, so the caller's session state never misses a committed step.
        """
        if self._worker is None:
            raise RuntimeError("the batcher is not running")
        item = _Pending(request, num_nodes, on_verdict, asyncio.get_running_loop().create_future())
        self._pending.append(item)
        self._wake.set()
        return await item.future

    async def _run(self) -> None:
        while True:
            while not self._pending:
                self._wake.clear()
                await self._wake.wait()
            if self.batching and self.batch_wait_s > 0:
                await self._gather_more()
            batch = self._take()
            async with self.engine_lock:
                try:
                    await self._verify(batch)
                except Exception as e:  # never let the worker die: every later tree would wait forever
                    log.exception("batcher step failed")
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(e)

    async def _gather_more(self) -> None:
        """Wait until batch_wait_s after the oldest arrival or until the node budget is full."""
        deadline = self._pending[0].submitted + self.batch_wait_s
        while sum(p.num_nodes for p in self._pending) < self.max_batch_nodes:
            queued = {p.request.session_id for p in self._pending}
            if self.open_sessions is not None and len(queued) >= self.open_sessions():
                return
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _take(self) -> list[_Pending]:
        """Oldest first, within the node budget, one request per session; the rest stay queued."""
        batch, nodes, sessions, rest = [], 0, set(), deque()
        limit = self.max_batch_nodes if self.batching else 0
        while self._pending:
            item = self._pending.popleft()
            if item.future.done():  # its stream went away
                continue
            fits = not batch or (nodes + item.num_nodes <= limit and item.request.session_id not in sessions)
            if fits:
                batch.append(item)
                nodes += item.num_nodes
                sessions.add(item.request.session_id)
            else:
                rest.append(item)
        self._pending = rest
        return batch

    async def _verify(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        start = time.perf_counter()
        requests = [p.request for p in batch]
        try:
            offload = self.compute.call if self.compute is not None else asyncio.to_thread
            outcomes: list[Verdict | Exception] = await offload(self.engine.verify_batch, requests)
        except BatchVerifyError as e:  # committed for the others
            outcomes = [e.errors.get(r.session_id) or v for v, r in zip(e.verdicts, requests, strict=True)]
        except (ValueError, LookupError) as e:  # refused before the forward, nothing committed: find the culprit alone
            if len(batch) > 1:
                for item in batch:
                    await self._verify([item])
                return
            outcomes = [e]
        except Exception as e:  # a bug or a device error: every request fails (the servicer logs each)
            outcomes = [e] * len(batch)
        forward_ms = (time.perf_counter() - start) * 1000
        num_nodes = sum(p.num_nodes for p in batch)
        self.stats.num_forwards += 1
        self.stats.num_trees += len(batch)
        self.stats.max_sessions = max(self.stats.max_sessions, len(batch))
        self.stats.num_multi_session_forwards += len(batch) > 1
        if self.on_forward is not None:
            self.on_forward([p.num_nodes for p in batch], forward_ms / 1000)
        for item, outcome in zip(batch, outcomes, strict=True):
            if not isinstance(outcome, Exception):
                info = BatchInfo((start - item.submitted) * 1000, forward_ms, len(batch), num_nodes)
                try:
                    outcome = item.on_verdict(outcome, info)
                except Exception as e:
                    outcome = e
            if item.future.done():  # the submitter went away (its stream was cancelled)
                continue
            if isinstance(outcome, Exception):
                item.future.set_exception(outcome)
            else:
                item.future.set_result(outcome)

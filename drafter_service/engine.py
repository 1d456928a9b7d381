"""The drafter's session loop: draft a tree, send it to the verifier, apply the verdict, repeat.

    engine = DrafterPool(draft_model, config)   # the draft model of many sessions
    async for step in engine.run(job):          # job: a validated RunRequest (RunJob)
        ...                                      # step.token_ids committed at step.start_position

One run of a session at one epoch:
    1. take the session's ModelRunner from the pool (its draft cache is kept between runs of the
       session and cropped to the longest prefix of the committed tokens it still matches)
    2. Attach the session to the verifier (which crops or prefills its own cache), open the Verify stream
    3. loop: Drafter.draft (a worker thread), send the DraftTree, read the Verdict, Drafter.accept,
       emit the committed tokens (cut at max_new_tokens and after an EOS id), until the budget is
       spent, an EOS is committed, or the run is cancelled
    With batched drafting (config.batching, on by default), the forwards of every session drafting at
    the same moment run as one packed forward (rsd_runtime.packed.PackedForwards).
    With pre-drafting (config.predraft, on by default): while the verdict is awaited, a worker
    thread drafts the next tree for the likeliest verdicts (rsd_runtime.predraft.PreDrafter); a
    verdict that matches one sends its tree at once. It pre-drafts until the verdict is in, until
    the session's measured verify round trip is used up, or predraft_outcomes trees are drafted; the
    tree in progress when the verdict arrives is finished if it is the verdict's own, else dropped.
    With config.predraft_width > 1 it drafts that many outcomes at once, on shadow runners, their
    levels packed into one forward (PreDrafter.draft_wave, _side_by_side).
Each step's draws come from StepRandom(seed, the rule's draft_stream, root position) (rsd.random; Stream.DRAFT
but for the coupled rule) here and (seed, Stream.VERIFY, root position) in the verifier, so a run equals the in-process
SpeculativeGenerator.generate with the same seed, token for token, pre-drafting or not.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial

import grpc
import torch

from drafter_service.config import DrafterConfig
from drafter_service.verifier_client import VerifyStream, check_verdict, verifier_error
from rsd.acceptance import Verdict
from rsd.auto import AutoPolicy
from rsd.constraint import Constraint
from rsd.logprobs import TokenLogprobs
from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd.shape_control import CostMeter, Shape, ShapeController, method_for
from rsd.tree import DraftTree
from rsd_runtime.attention import check_model
from rsd_runtime.compute import ComputeThread
from rsd_runtime.constraint import folder_automata
from rsd_runtime.engines import AutoDrafter, Drafter
from rsd_runtime.generator import Finish, cut_step, finishes
from rsd_runtime.kvcache import common_prefix_length
from rsd_runtime.packed import PackedForwards
from rsd_runtime.predraft import Outcome, PreDrafter, outcome_of
from rsd_runtime.runner import ModelRunner
from rsd_service.security import channel, peer_security
from rsd_service.status import Conflict, Exhausted
from rsd_wire import common_pb2, verifier_pb2, verifier_pb2_grpc
from rsd_wire.convert import draft_tree_to_proto, token_logprobs_from_proto

log = logging.getLogger(__name__)


class DraftPoolFullError(Exhausted):
    """Every draft runner is busy with a running session."""


class RunConflictError(Conflict):
    """A run of the session at the same or a newer epoch is in progress."""


@dataclass(frozen=True)
class RunJob:
    """A validated RunRequest."""

    session_id: str
    epoch: int
    committed_ids: list[int]
    params: common_pb2.GenerationParams  # forwarded to the verifier's Attach as is
    sampling: SamplingParams
    method: Method
    seed: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    verifier_address: str
    verifier_id: str = ""
    num_top_logprobs: int | None = None  # the verdicts carry the tokens' logprobs (params.logprobs); None: not
    shapes: tuple[Shape, ...] = ()  # params.adaptive_shape: the family a ShapeController picks from; () = method's
    constraint: tuple[Constraint, int] | None = None  # structured output and where its text begins; None: free text
    output_start: int | None = None  # where the turn's output starts in committed_ids (the penalties'); None: after
    draft_stream: Stream = Stream.DRAFT  # the rule's (Rule.draft_stream): COUPLED for the coupled rule

    @property
    def output_position(self) -> int:
        return len(self.committed_ids) if self.output_start is None else self.output_start


@dataclass(frozen=True)
class StepResult:
    """One step's committed tokens (or a final empty one) and its statistics."""

    start_position: int
    token_ids: list[int]
    stats: common_pb2.StepStats | None
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    logprobs: TokenLogprobs | None = None  # of token_ids, when the job asks


@dataclass
class _Slot:
    runner: ModelRunner
    cached_ids: list[int] = field(default_factory=list)  # tokens whose K/V the runner holds
    busy: bool = False
    drafting: asyncio.Future | None = None  # the worker thread drafting on the runner, if any
    auto: AutoPolicy | None = None  # the auto method's costs and acceptance, kept for the session's next turns


# A session whose last PREDRAFT_PROBATION_STEPS pre-drafting steps all missed pre-drafts one outcome
# per step (not predraft_outcomes) until one hits: its draft does not predict its target well enough
# to pay for the forwards (on shared cores they slow the verifier down).
PREDRAFT_PROBATION_STEPS = 8


@dataclass
class PreDraftTotals:
    """Pre-drafting since the engine started (StepStats carry the same per step)."""

    hits: int = 0  # verdicts whose next tree was drafted ahead
    misses: int = 0  # verdicts with trees drafted ahead, none of them for that verdict
    trees: int = 0  # trees drafted ahead
    wasted_draft_forwards: int = 0  # draft forwards of trees never sent


@dataclass
class _Running:
    epoch: int
    cancel: asyncio.Event
    done: asyncio.Event


class DrafterPool:
    """The draft model of many sessions: one ModelRunner per session (kept for its next turn, evicted
    least recently used), each run driving a rsd_runtime.engines.Drafter against a remote verifier.
    (Names: rsd_runtime.engines' docstring.)"""

    def __init__(self, model: torch.nn.Module, config: DrafterConfig, compute: ComputeThread | None = None):
        # Refuse at start, not at the first session, what trees cannot run exactly; each runner then takes this
        # plan (the probe is a forward: an int8-activation model unpacks its weights for it)
        self.plan = check_model(model, config.max_len)
        self.model, self.config = model, config
        self.vocab_size: int = model.config.get_text_config().vocab_size
        self.automata = folder_automata(config.tokenizer or config.model)  # structured output, loaded at first use
        self._slots: OrderedDict[str, _Slot] = OrderedDict()  # session -> runner, least recently used first
        self._running: dict[str, _Running] = {}
        self.last_attach: dict[str, verifier_pb2.AttachResponse] = {}  # session -> its latest AttachResponse
        self.verifier_security = peer_security(config)  # TLS and the internal token when dialing verifiers
        self.predraft_totals = PreDraftTotals()
        self._threads = ThreadPoolExecutor(config.max_sessions, thread_name_prefix="draft")  # one per session
        # Pre-drafts side by side (predraft_width > 1) run in threads of their own, beside the session's.
        self.predraft_width = config.predraft_width if config.predraft and config.batching else 1
        extra = config.max_sessions * (self.predraft_width - 1)
        self._side_threads = ThreadPoolExecutor(extra, thread_name_prefix="predraft") if extra else None
        self.packer = None  # batched drafting: one forward for every session drafting at once
        if config.batching:
            runners = 1 + (config.predraft_outcomes if self.predraft_width > 1 else 0)  # per session
            max_kv = config.max_sessions * runners * config.max_len
            self.packer = PackedForwards(
                model, max_kv, config.max_batch_nodes, config.batch_wait_ms / 1e3, compute.run if compute else None
            )
        # Every draft forward runs on the compute thread (rsd_runtime.compute: one OpenMP team); the
        # sampling stays in the sessions' threads.
        self.compute = compute

    @property
    def num_running(self) -> int:
        return len(self._running)

    def cancel(self, session_id: str, epoch: int) -> bool:
        run = self._running.get(session_id)
        if run is None or run.epoch != epoch:
            return False
        run.cancel.set()
        return True

    async def run(self, job: RunJob) -> AsyncIterator[StepResult]:
        """The steps of one run; the last one carries the finish reason."""
        running = await self._begin(job)
        slot = None
        try:
            slot = self._take_slot(job.session_id, job.committed_ids)
            async for step in self._loop(job, slot, running.cancel):
                yield step
        finally:
            if slot is not None:
                if slot.drafting is not None and not slot.drafting.done():  # cancelled mid-draft: a thread
                    await asyncio.wait({slot.drafting})  # still uses the runner; let it finish first
                if slot.runner.num_tentative:  # a tree drafted but never answered (cancel, failure)
                    slot.runner.commit([])
                slot.busy = False
            running.done.set()
            if self._running.get(job.session_id) is running:
                del self._running[job.session_id]

    async def _begin(self, job: RunJob) -> _Running:
        """Register the run; a run of an older epoch of the session is cancelled and awaited."""
        old = self._running.get(job.session_id)
        if old is not None:
            if old.epoch >= job.epoch:
                raise RunConflictError(f"session {job.session_id!r}: a run at epoch {old.epoch} is in progress")
            old.cancel.set()
            await old.done.wait()
            if job.session_id in self._running:  # a third run got in first
                raise RunConflictError(f"session {job.session_id!r}: another run started meanwhile")
        running = _Running(job.epoch, asyncio.Event(), asyncio.Event())
        self._running[job.session_id] = running
        return running

    def _take_slot(self, session_id: str, committed: list[int]) -> _Slot:
        """The session's runner, cropped to what still matches `committed`, else a free or evicted one."""
        slot = self._slots.pop(session_id, None)
        if slot is None:
            if len(self._slots) < self.config.max_sessions:
                slot = _Slot(ModelRunner(self.model, self.config.max_len, self.plan))
            else:
                victim = next((s for s, v in self._slots.items() if not v.busy), None)
                if victim is None:
                    raise DraftPoolFullError(f"all {self.config.max_sessions} draft runners are busy")
                slot = self._slots.pop(victim)
                self.last_attach.pop(victim, None)
        self._slots[session_id] = slot  # most recently used
        # The runner holds all but the last committed token (the next root); keep the common prefix.
        keep = common_prefix_length(slot.cached_ids, committed[:-1])
        if keep < slot.runner.cache_len:
            slot.runner.crop(keep)
        slot.cached_ids = slot.cached_ids[:keep]
        slot.busy = True
        return slot

    async def _loop(self, job: RunJob, slot: _Slot, cancel: asyncio.Event) -> AsyncIterator[StepResult]:
        committed, start = list(job.committed_ids), len(job.committed_ids)
        if job.max_new_tokens == 0:
            yield StepResult(start, [], None, common_pb2.FINISH_REASON_LENGTH)
            return
        forward = self.packer.forward if self.packer is not None else self._forward
        # The constraint's automaton may take seconds to build the first time: off the event loop.
        guide = None if job.constraint is None else await asyncio.to_thread(self.automata.guide, *job.constraint)
        top_k, top_p = self.config.proposal_top_k, self.config.proposal_top_p
        drafter = Drafter(
            slot.runner,
            top_k,
            top_p,
            forward,
            output_start=job.output_position,
            guide=guide,
            lookup_n=self.config.lookup_n,
        )
        # A tree from the context alone (rsd.lookup) costs no forward: nothing to draft ahead.
        # auto plans each step from the verdict before it: nothing to draft ahead either.
        auto = None
        if job.method.planned:
            if slot.auto is None or slot.auto.max_depth != job.method.depth:
                slot.auto = AutoPolicy(job.method.depth)
            auto = AutoDrafter(drafter, slot.auto)
        predraft = self.config.predraft and not job.method.draft_free and auto is None
        ahead = _Ahead(self, slot, drafter, job) if predraft else None
        shaper = _Shaper(job) if job.shapes else None
        method, next_tree = job.method if shaper is None else shaper.pick(), None
        async with channel(job.verifier_address, self.verifier_security) as verifier_channel:
            stub = verifier_pb2_grpc.VerifierStub(verifier_channel)
            await self._attach(stub, job)
            call = VerifyStream(stub, self.config.verify_timeout_s, self.config.verify_attempts)
            try:
                while True:
                    if cancel.is_set():
                        yield StepResult(len(committed), [], None, common_pb2.FINISH_REASON_CANCELLED)
                        return
                    t0 = time.perf_counter()
                    tree, next_tree = next_tree, None
                    predrafted = tree is not None
                    if tree is None:
                        rng = StepRandom(job.seed, job.draft_stream, len(committed) - 1)
                        if auto is not None:
                            tree = await self._in_thread(slot, auto.draft, committed, job.sampling, rng)
                        else:
                            tree = await self._in_thread(slot, drafter.draft, committed, method, job.sampling, rng)
                    t1 = time.perf_counter()
                    msg = draft_tree_to_proto(
                        tree, session_id=job.session_id, epoch=job.epoch, root_position=len(committed) - 1
                    )
                    upcoming = method if shaper is None else shaper.pick()  # from the steps before this one
                    if ahead is not None:
                        ahead.pre.method = upcoming
                        ahead.start(committed, tree, job.max_new_tokens - (len(committed) - start), t1)
                    verdict = None
                    try:
                        reply = await call.exchange(msg, cancel)
                        t2 = time.perf_counter()
                        if reply is not None:
                            verdict = check_verdict(reply, msg, tree, job.num_top_logprobs is not None)
                    finally:
                        if ahead is not None:  # the runner is free again after this, holding tree t's state
                            await ahead.stop(verdict)
                    if reply is None:
                        yield StepResult(len(committed), [], None, common_pb2.FINISH_REASON_CANCELLED)
                        return
                    stats = common_pb2.StepStats(
                        num_draft_tokens=tree.num_nodes - 1,
                        num_accepted_tokens=len(verdict.accepted_ids),
                        is_bonus=verdict.is_bonus,
                        # The time spent finishing (or dropping) a pre-draft after the verdict delays this
                        # step's tokens as drafting would: it is draft time.
                        draft_ms=(t1 - t0 + time.perf_counter() - t2) * 1000,
                        round_trip_ms=(t2 - t1) * 1000,
                        verifier=reply.stats,
                    )
                    if shaper is not None:
                        shaper.observe(method, stats, None if predrafted else (t1 - t0) * 1000)
                    if auto is not None:  # the forward's rows: other sessions' trees may have shared it
                        v = stats.verifier
                        accepted, rows = stats.num_accepted_tokens, v.batch_num_nodes
                        auto.observe(tree, accepted, v.forward_ms, stats.round_trip_ms, (t1 - t0) * 1000, rows)
                    method = upcoming
                    if ahead is not None:
                        next_tree = ahead.take(verdict, t2 - t1, stats)
                        slot.runner = drafter.runner  # a tree pre-drafted on a shadow runner brings it along
                    if next_tree is None:
                        drafter.accept(committed, verdict)
                    slot.cached_ids = (committed + verdict.token_ids)[: slot.runner.cache_len]
                    new, finish = _cut(verdict.token_ids, job.max_new_tokens - (len(committed) - start), job)
                    logprobs = None
                    if job.num_top_logprobs is not None:  # check_verdict checked them
                        logprobs = token_logprobs_from_proto(reply.logprobs, len(verdict.token_ids)).head(len(new))
                    if finish:  # close the verifier's stream before the last tokens leave: the session's
                        call.cancel()  # next turn may attach at once (VerifierConfig.attach_wait_s)
                    yield StepResult(len(committed), new, stats, finish, logprobs)
                    committed += new
                    if finish:
                        return
            finally:
                call.cancel()

    def _forward(self, runner: ModelRunner, *args, **kwargs) -> torch.Tensor:
        """ModelRunner.forward, unpacked, on the compute thread."""
        if self.compute is None:
            return ModelRunner.forward(runner, *args, **kwargs)
        return self.compute.run(ModelRunner.forward, runner, *args, **kwargs)

    def _in_thread(self, slot: _Slot, fn, *args) -> asyncio.Future:
        """Run fn(*args) on the slot's runner in a worker thread; slot.drafting tracks it (a cancelled
        run waits for it before it lets go of the runner)."""
        # asyncio.to_thread's default pool holds min(32, cores + 4) threads: fewer than max_sessions on a small
        # machine, and a session queued for a thread cannot join the others' packed forward.
        call = partial(contextvars.copy_context().run, self._drafting, fn, *args)  # keeps the log context
        slot.drafting = asyncio.get_running_loop().run_in_executor(self._threads, call)
        # A session cancelled meanwhile (shutdown) never awaits it: mark its error seen, or asyncio logs it
        # from the garbage collector, at any moment (once inside an ast.parse, which CPython 3.11 broke on).
        slot.drafting.add_done_callback(lambda f: f.cancelled() or f.exception())
        return asyncio.shield(slot.drafting)

    def _side_by_side(self, fns: list[Callable[[], object]]) -> list:
        """From a session's drafting thread: run fns at once, the first here and the others in threads
        of their own, their forwards packed together (PreDrafter.draft_wave). -> their results."""
        self.packer.enter(len(fns) - 1)  # counted before they start: the first forward waits for them
        futures = [self._side_threads.submit(partial(contextvars.copy_context().run, self._side, fn)) for fn in fns[1:]]
        try:
            first = fns[0]()
        finally:
            with self.packer.waiting():  # packed forwards need not wait for this thread meanwhile
                wait(futures)
        return [first] + [f.result() for f in futures]

    def _side(self, fn: Callable[[], object]) -> object:
        try:
            return fn()
        finally:
            self.packer.leave()

    def _drafting(self, fn, *args):
        """fn(*args) in a worker thread; its draft forwards are packed with other sessions' (PackedForwards)."""
        if self.packer is None:
            return fn(*args)
        with self.packer.drafting():
            return fn(*args)

    async def _attach(self, stub: verifier_pb2_grpc.VerifierStub, job: RunJob) -> None:
        request = verifier_pb2.AttachRequest(
            session_id=job.session_id,
            epoch=job.epoch,
            committed_token_ids=job.committed_ids,
            params=job.params,
            output_start_position=job.output_position,
        )
        try:
            reply = await stub.Attach(request, timeout=self.config.attach_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise verifier_error(e.code(), e.details(), "Attach") from None
        if reply.vocab_size != self.vocab_size:
            raise ValueError(f"the verifier's vocabulary ({reply.vocab_size}) is not the draft's ({self.vocab_size})")
        nodes = job.method.max_draft_tokens + 1
        if nodes > reply.max_tree_nodes:
            raise ValueError(
                f"method {job.method.name} drafts up to {nodes} nodes; the verifier takes {reply.max_tree_nodes}"
            )
        self.last_attach[job.session_id] = reply


class _Shaper:
    """params.adaptive_shape (rsd.shape_control): one run's controller and its measured costs. The shape of
    step n + 1 is picked when step n's tree goes out, from the steps before n, so a tree pre-drafted for
    step n + 1 has the shape a draft after the verdict would have, and no step's shape depends on its own
    draws (the law stays exact)."""

    def __init__(self, job: RunJob):
        self.method, self.controller, self.meter = job.method, ShapeController(list(job.shapes)), CostMeter()

    def pick(self) -> Method:
        return method_for(self.method, self.controller.choose(self.meter.costs))

    def observe(self, method: Method, stats: common_pb2.StepStats, draft_ms: float | None) -> None:
        """draft_ms: None when the tree was pre-drafted (its draft hid in the wait)."""
        shape = Shape(method.beam_width or method.branching[0], method.depth)
        self.controller.observe(shape, stats.num_accepted_tokens)
        v = stats.verifier
        self.meter.observe(shape, draft_ms, v.forward_ms, stats.round_trip_ms, v.queue_ms, draft_ms is None)


class _Ahead:
    """A run's pre-drafting (rsd_runtime.predraft): start() when a tree is sent, stop(verdict) when its
    verdict is in, take() the tree drafted for that verdict, if any. Measured per session: the verify round
    trip (pre-drafting starts no tree once it is used up) and whether recent steps hit."""

    def __init__(self, engine: DrafterPool, slot: _Slot, drafter: Drafter, job: RunJob):
        self.engine, self.slot, self.job = engine, slot, job
        self.max_outcomes, self.width = engine.config.predraft_outcomes, engine.predraft_width
        self.pre = PreDrafter(drafter, job.method, job.sampling, job.seed, self.max_outcomes, job.draft_stream)
        self.round_trip_s = math.inf
        self.recent_hits: deque[bool] = deque(maxlen=PREDRAFT_PROBATION_STEPS)  # steps that pre-drafted
        self._arrived, self._verdict, self._task = threading.Event(), None, None

    def start(self, committed: list[int], tree: DraftTree, budget: int, sent_at: float) -> None:
        """Tree was drafted from `committed` and goes out now; `budget` new tokens are left to the run."""
        self.pre.begin(committed, tree, partial(finishes, budget=budget, eos_token_ids=self.job.eos_token_ids))
        cold = len(self.recent_hits) == self.recent_hits.maxlen and not any(self.recent_hits)
        limit = 1 if cold else self.max_outcomes
        self._arrived, self._verdict = threading.Event(), None
        deadline = sent_at + self.round_trip_s
        side = self.engine._side_by_side if self.width > 1 else None
        self._task = self.engine._in_thread(
            self.slot, predraft_while_waiting, self.pre, self._halt, self._arrived, deadline, limit, self.width, side
        )

    def _halt(self, outcome: Outcome | None) -> bool:
        """Whether to stop drafting `outcome` (None: ranking): once the verdict is in, unless it is that
        outcome, whose tree is the next one and runs to its end. Worker thread."""
        return self._arrived.is_set() and (outcome is None or outcome != self._verdict)

    async def stop(self, verdict: Verdict | None) -> None:
        """The verdict is in (None: the exchange failed or was cancelled): drop every pre-draft but its own."""
        self._verdict = None if verdict is None else outcome_of(verdict)
        self._arrived.set()
        if self._task is not None:
            await asyncio.wait({self._task})

    def take(self, verdict: Verdict, round_trip_s: float, stats: common_pb2.StepStats) -> DraftTree | None:
        """The next tree if it was drafted ahead (the drafter then holds its state), else None; counts it."""
        self._task.result()  # a failure in the worker thread is a bug: raise it
        self._task = None
        rt = self.round_trip_s
        self.round_trip_s = round_trip_s if math.isinf(rt) else 0.5 * (rt + round_trip_s)
        pre, next_tree = self.pre, self.pre.take(verdict)
        stats.num_predrafted_trees = len(pre.drafts)
        stats.predraft_hit = next_tree is not None
        stats.wasted_draft_forwards = pre.wasted_forwards(next_tree)
        totals = self.engine.predraft_totals
        totals.trees += len(pre.drafts)
        totals.wasted_draft_forwards += stats.wasted_draft_forwards
        totals.hits += next_tree is not None
        totals.misses += next_tree is None and bool(pre.drafts)
        if pre.drafts:
            self.recent_hits.append(next_tree is not None)
        return next_tree


def predraft_while_waiting(
    pre: PreDrafter,
    halt: Callable[[Outcome | None], bool],
    arrived: threading.Event,
    deadline: float,
    limit: int,
    width: int = 1,
    side_by_side: Callable | None = None,
) -> None:
    """Pre-draft outcome after outcome (`width` at once: PreDrafter.draft_wave) until the verdict has
    arrived, the session's measured verify round trip is used up (deadline, perf_counter seconds), `limit`
    trees are drafted or none is left. halt(outcome) is asked before each forward: the tree being drafted
    when the verdict arrives is finished if it is the verdict's own (a head start on the next step), else
    dropped. Worker thread."""
    while not arrived.is_set() and len(pre.drafts) < limit and time.perf_counter() < deadline:
        n = min(width, limit - len(pre.drafts))
        if not (pre.draft_next(halt) if n == 1 else pre.draft_wave(n, halt, side_by_side)):
            return


_FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    Finish.EOS: common_pb2.FINISH_REASON_EOS,
    Finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
}


def _cut(token_ids: list[int], budget: int, job: RunJob) -> tuple[list[int], int]:
    """Cut a step's tokens at the run's budget and after the first EOS; -> (tokens, finish reason)."""
    new, finish = cut_step(token_ids, budget, job.eos_token_ids)
    return new, _FINISH_REASONS[finish]

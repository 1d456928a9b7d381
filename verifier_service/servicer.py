"""The Verifier gRPC servicer: validates and converts, keeps per-session state, maps errors.

Per session it keeps what verifier.proto asks the verifier to know: the attached epoch, the
committed sequence (set by Attach, extended by each verdict), the sampling params and acceptance
rule (params.verification picks it; each verdict's stats name it), the seed (each step's acceptance
draws come from StepRandom(seed, Stream.VERIFY, root position), as in the in-process
SpeculativeGenerator, so a run reproduces it token for token), the last verified step with its
verdict for idempotent retries, and whether its verdicts carry the emitted tokens' log-probabilities
(params.logprobs, params.top_logprobs; which figures: params.logprobs_mode).

Status codes: malformed request or tree -> INVALID_ARGUMENT; session not attached -> NOT_FOUND;
older epoch, or a tree whose root_position is not the end of the committed sequence ->
FAILED_PRECONDITION; no free KV slot -> RESOURCE_EXHAUSTED; anything else -> INTERNAL, logged
once with the session id. A bad tree ends its own stream only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from rsd.acceptance import Rule
from rsd.constraint import Guide
from rsd.logprobs import RAW_LOGPROBS
from rsd.methods import Method
from rsd.random import StepRandom, Stream
from rsd.sampling import SamplingParams
from rsd_runtime.constraint import AutomatonCache, folder_automata
from rsd_service.registry import check_id
from rsd_service.status import RpcError, abort
from rsd_wire import common_pb2, verifier_pb2, verifier_pb2_grpc
from rsd_wire.convert import (
    constraint_from_proto,
    draft_tree_from_proto,
    generation_params_from_proto,
    logprobs_mode_from_proto,
    num_top_logprobs,
    output_start_from_proto,
    rule_from_proto,
    token_logprobs_to_proto,
    verdict_to_proto,
)
from verifier_service.batcher import Batcher, BatchInfo
from verifier_service.engine import PoolFullError, ScoredVerdict, UnknownSessionError, VerifierPool, VerifyRequest

log = logging.getLogger(__name__)


@dataclass
class _Session:
    session_id: str
    epoch: int
    committed: list[int]  # the whole committed sequence; committed[-1] is the next tree's root
    params: SamplingParams
    method: Method
    rule: Rule
    seed: int  # acceptance draws: StepRandom(seed, Stream.VERIFY, root_position)
    cached_at_attach: int  # AttachResponse.cached_length_tokens
    num_top_logprobs: int | None = None  # verdicts carry logprobs with this many top tokens; None: none
    logprobs_mode: str = RAW_LOGPROBS  # which figures (params.logprobs_mode)
    guide: Guide | None = None  # structured output (params.constraint)
    output_start: int = 0  # committed[output_start:] is the turn's output (the penalties count it)
    last_tree: bytes = b""  # the last verified DraftTree, serialized, and its verdict
    last_verdict: verifier_pb2.Verdict | None = None
    num_steps: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one tree of a session at a time


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(
        self,
        engine: VerifierPool,
        batcher: Batcher,
        verifier_id: str,
        max_tree_nodes: int,
        attach_grace_s: float,
        attach_wait_s: float,
        automata: AutomatonCache | None = None,
    ):
        self.engine, self.batcher = engine, batcher
        self.automata = automata or folder_automata("")  # structured output's automata (params.constraint)
        batcher.open_sessions = lambda: self.num_open_streams
        self.verifier_id, self.max_tree_nodes = verifier_id, max_tree_nodes
        self.attach_grace_s = attach_grace_s  # VerifierConfig.attach_grace_s
        self.attach_wait_s = attach_wait_s  # VerifierConfig.attach_wait_s
        self._stream_closed = asyncio.Event()  # set whenever a session's last Verify stream closes
        self.sessions: dict[str, _Session] = {}
        self._open_streams: dict[str, int] = {}  # session -> Verify streams that sent it a tree
        self._last_used: dict[str, float] = {}  # session -> monotonic time of its last Attach/verdict

    @property
    def num_sessions(self) -> int:
        """Sessions holding a KV slot."""
        return len(self.sessions)

    @property
    def num_open_streams(self) -> int:
        """Sessions with an open Verify stream that sent a tree (they may send more)."""
        return len(self._open_streams)

    # ---- Attach ---------------------------------------------------------------------------------
    async def Attach(self, request: verifier_pb2.AttachRequest, context) -> verifier_pb2.AttachResponse:
        try:
            return await self._attach(request)
        except Exception as e:
            await self._abort(context, e, request.session_id)

    async def _attach(self, request: verifier_pb2.AttachRequest) -> verifier_pb2.AttachResponse:
        sid = check_id("session_id", request.session_id)
        committed = list(request.committed_token_ids)
        if not committed:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "committed_token_ids must not be empty")
        vocab = self.engine.vocab_size
        bad = next((t for t in committed if not 0 <= t < vocab), None)
        if bad is not None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"committed token {bad} is outside [0, {vocab})")
        if len(committed) >= self.engine.max_len:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(committed)} committed tokens leave no room for a tree (max_len={self.engine.max_len})",
            )
        params, method, seed = generation_params_from_proto(request.params)
        top_logprobs = num_top_logprobs(request.params)
        logprobs_mode = logprobs_mode_from_proto(request.params)
        params.check_vocab(vocab)
        rule = rule_from_proto(request.params, params, method)  # params.verification
        constraint = constraint_from_proto(request.params)  # the automaton may take seconds: off the event loop
        guide = None if constraint is None else await asyncio.to_thread(self.automata.guide, *constraint)
        output_start = output_start_from_proto(request)
        if sid not in self.sessions and self.engine.num_free_slots == 0:
            await self._wait_for_idle()
        async with self.batcher.engine_lock:  # the engine is not thread-safe; the batcher's forward holds it
            current = self.sessions.get(sid)
            if current is not None and request.epoch < current.epoch:
                raise RpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session {sid!r} is attached at epoch {current.epoch}; epoch {request.epoch} is older",
                )
            if current is not None and request.epoch == current.epoch:
                # One run attaches once: a repeat is a retry (same tokens: answered as is) or a stray
                # request that must not crop the running session's cache nor reset its RNG.
                if committed != current.committed:
                    raise RpcError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"session {sid!r} is already attached at epoch {current.epoch} with other tokens",
                    )
                return self._attached(current.cached_at_attach)
            if current is None and self.engine.num_free_slots == 0:
                self._evict_idle(sid)
            cached = self.engine.attach(sid, committed)
            self.sessions[sid] = _Session(
                session_id=sid,
                epoch=request.epoch,
                committed=committed,
                params=params,
                method=method,
                rule=rule,
                seed=seed,
                cached_at_attach=cached,
                num_top_logprobs=top_logprobs,
                logprobs_mode=logprobs_mode,
                guide=guide,
                output_start=output_start,
            )
            self._last_used[sid] = time.monotonic()
        log.info("attached %s epoch %d: %d committed, %d cached", sid, request.epoch, len(committed), cached)
        return self._attached(cached)

    def _attached(self, cached: int) -> verifier_pb2.AttachResponse:
        return verifier_pb2.AttachResponse(
            verifier_id=self.verifier_id,
            cached_length_tokens=cached,
            vocab_size=self.engine.vocab_size,
            max_tree_nodes=self.max_tree_nodes,
        )

    def _evict_idle(self, for_session: str) -> None:
        """Free the slot of the least recently used session with no open Verify stream (its drafter
        finished; a later run re-attaches and re-prefills). Caller holds the engine lock."""
        idle = self._idle_sessions()
        if not idle:
            slots = self.engine.num_slots
            raise PoolFullError(f"all {slots} KV slots hold active sessions; cannot attach {for_session!r}")
        victim = min(idle, key=lambda s: self._last_used.get(s, 0.0))
        self.engine.release(victim)
        del self.sessions[victim]
        self._last_used.pop(victim, None)
        log.info("evicted idle session %s to attach %s", victim, for_session)

    def _idle_sessions(self) -> list[str]:
        now = time.monotonic()
        return [s for s in self.sessions if not self._open_streams.get(s) and not self._awaiting_stream(s, now)]

    async def _wait_for_idle(self) -> None:
        """Every slot is held by a session with an open stream: wait up to attach_wait_s for one to close.
        A run that just finished closes its stream as its last tokens leave, so the next turn's Attach
        can arrive first (seen under load); waiting beats refusing it."""
        deadline = time.monotonic() + self.attach_wait_s
        while not self._idle_sessions() and (left := deadline - time.monotonic()) > 0:
            self._stream_closed.clear()
            try:
                await asyncio.wait_for(self._stream_closed.wait(), left)
            except TimeoutError:
                return

    def _awaiting_stream(self, session_id: str, now: float) -> bool:
        """Attached moments ago, its first tree not sent yet (the drafter drafts it): not idle. Evicting it
        (found by the load test) failed the run with NOT_FOUND at its first step. A drafter that never
        sends one leaves it evictable after attach_grace_s."""
        fresh = now - self._last_used.get(session_id, 0.0) < self.attach_grace_s
        return fresh and self.sessions[session_id].num_steps == 0

    # ---- Verify ---------------------------------------------------------------------------------
    async def Verify(self, request_iterator, context):
        seen: set[str] = set()
        sid = ""
        trees = aiter(request_iterator)
        try:
            while True:
                try:
                    tree_msg = await anext(trees)
                except StopAsyncIteration:
                    return
                except Exception:  # the client went away or the server is stopping: nobody to answer
                    return
                sid = tree_msg.session_id
                if sid not in seen and sid in self.sessions:
                    seen.add(sid)
                    self._open_streams[sid] = self._open_streams.get(sid, 0) + 1
                yield await self._verify(tree_msg)
        except Exception as e:
            await self._abort(context, e, sid)
        finally:
            for s in seen:
                self._open_streams[s] -= 1
                if not self._open_streams[s]:
                    del self._open_streams[s]
                    self._stream_closed.set()

    async def _verify(self, msg: verifier_pb2.DraftTree) -> verifier_pb2.Verdict:
        sid = msg.session_id
        session = self._current(sid, msg.epoch)
        async with session.lock:
            session = self._current(sid, msg.epoch)  # an Attach may have replaced it meanwhile
            last = session.last_verdict
            if last is not None and msg.root_position == last.root_position:  # a retry of the last step
                if msg.SerializeToString(deterministic=True) != session.last_tree:
                    raise RpcError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"session {sid!r}: the step at root_position {msg.root_position} was already verified "
                        "with another tree",
                    )
                return last
            root_position = len(session.committed) - 1
            if msg.root_position != root_position:
                raise RpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session {sid!r}: root_position {msg.root_position}, but the committed sequence has "
                    f"{len(session.committed)} tokens (expected root_position {root_position})",
                )
            tree = draft_tree_from_proto(msg, self.engine.vocab_size, self.max_tree_nodes)  # ValueError: bad tree
            if int(tree.token_ids[0]) != session.committed[-1]:
                raise ValueError(
                    f"the tree's root token {int(tree.token_ids[0])} is not the last committed token "
                    f"{session.committed[-1]}"
                )
            if root_position + tree.num_nodes > self.engine.max_len:
                raise ValueError(
                    f"{root_position} cached + {tree.num_nodes} tree tokens exceed max_len={self.engine.max_len}"
                )
            rng = StepRandom(session.seed, Stream.VERIFY, root_position)
            request = VerifyRequest(
                sid,
                list(session.committed),
                tree,
                session.rule,
                session.params,
                rng,
                session.num_top_logprobs,
                session.guide,
                session.output_start,
                session.logprobs_mode,
            )
            num_new = root_position - self.engine.cached_length(sid) + tree.num_nodes  # prefill chain + tree
            serialized = msg.SerializeToString(deterministic=True)

            def record(verdict: ScoredVerdict, info: BatchInfo) -> verifier_pb2.Verdict:
                """Runs in the batcher right after the engine committed the verdict."""
                if self.sessions.get(sid) is not session:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"session {sid!r} was re-attached or released")
                stats = common_pb2.VerifierStats(
                    queue_ms=info.queue_ms,
                    forward_ms=info.forward_ms,
                    batch_num_sessions=info.num_sessions,
                    batch_num_nodes=info.num_nodes,
                    rule=session.rule.name,
                )
                reply = verdict_to_proto(
                    verdict, session_id=sid, epoch=session.epoch, root_position=msg.root_position, stats=stats
                )
                if verdict.logprobs is not None:
                    reply.logprobs.CopyFrom(token_logprobs_to_proto(verdict.logprobs))
                session.committed += verdict.token_ids
                session.last_tree, session.last_verdict = serialized, reply
                session.num_steps += 1
                self._last_used[sid] = time.monotonic()
                return reply

            step = asyncio.ensure_future(self.batcher.submit(request, num_new, record))
            try:
                return await asyncio.shield(step)
            except asyncio.CancelledError:
                # The stream went away mid-step (a deadline, a dropped connection): the step still runs and
                # commits. Hold the session's lock until it has, so a retry of the step finds its stored
                # verdict instead of verifying it twice (a second cache extension and RNG draw).
                await asyncio.wait({step})
                if not step.cancelled():
                    step.exception()  # retrieved: nobody is left to answer
                raise

    def _current(self, sid: str, epoch: int) -> _Session:
        session = self.sessions.get(sid)
        if session is None:
            raise UnknownSessionError(f"session {sid!r} is not attached to verifier {self.verifier_id}")
        if epoch != session.epoch:
            relation = "older than" if epoch < session.epoch else "not"
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"session {sid!r}: tree of epoch {epoch} is {relation} the attached epoch {session.epoch}",
            )
        return session

    # ---- Release --------------------------------------------------------------------------------
    async def Release(self, request: verifier_pb2.ReleaseRequest, context) -> verifier_pb2.ReleaseResponse:
        try:
            check_id("session_id", request.session_id)
        except ValueError as e:
            await self._abort(context, e, "")
        async with self.batcher.engine_lock:
            session = self.sessions.get(request.session_id)
            # Only the run that attached releases: an older one must not drop a newer run's cache, nor a
            # made-up later epoch someone else's.
            if session is None or session.epoch != request.epoch:
                return verifier_pb2.ReleaseResponse(released=False)
            self.engine.release(request.session_id)
            del self.sessions[request.session_id]
            self._last_used.pop(request.session_id, None)
        return verifier_pb2.ReleaseResponse(released=True)

    async def _abort(self, context, error: Exception, session_id: str) -> None:
        await abort(context, error, log, f"session {session_id or '?'}")

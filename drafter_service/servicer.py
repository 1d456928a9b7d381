"""The Drafter gRPC servicer: validates a RunRequest, streams the engine's steps as RunEvents,
maps errors to status codes.

    bad request (or a verifier that does not fit the draft model)  INVALID_ARGUMENT
    the verifier refused the run's epoch                           FAILED_PRECONDITION
    verifier unreachable, stream broken, verifier overloaded       UNAVAILABLE (with the reason)
    a run of the session at the same or a newer epoch is running   FAILED_PRECONDITION
    every draft runner busy                                        RESOURCE_EXHAUSTED
    anything else                                                  INTERNAL, logged once with the session id
"""

from __future__ import annotations

import logging

import grpc

from drafter_service.engine import DrafterPool, RunJob
from rsd.shape_control import adaptive_family
from rsd_service.registry import ID_PATTERN, check_id
from rsd_service.status import abort
from rsd_wire import drafter_pb2, drafter_pb2_grpc
from rsd_wire.convert import (
    constraint_from_proto,
    generation_params_from_proto,
    logprobs_mode_from_proto,
    num_top_logprobs,
    output_start_from_proto,
    rule_from_proto,
    token_logprobs_to_proto,
)

log = logging.getLogger(__name__)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DrafterPool):
        self.engine = engine

    async def Run(self, request: drafter_pb2.RunRequest, context):
        try:
            job = self.validate(request)
            async for step in self.engine.run(job):
                yield drafter_pb2.RunEvent(
                    session_id=job.session_id,
                    epoch=job.epoch,
                    start_position=step.start_position,
                    token_ids=step.token_ids,
                    stats=step.stats,
                    finish_reason=step.finish_reason,
                    logprobs=None if step.logprobs is None else token_logprobs_to_proto(step.logprobs),
                )
        except Exception as e:
            await abort(context, e, log, f"session {request.session_id or '?'}")

    async def Cancel(self, request: drafter_pb2.CancelRunRequest, context) -> drafter_pb2.CancelRunResponse:
        if not ID_PATTERN.fullmatch(request.session_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"session_id: got {request.session_id[:140]!r}")
        return drafter_pb2.CancelRunResponse(was_running=self.engine.cancel(request.session_id, request.epoch))

    def validate(self, request: drafter_pb2.RunRequest) -> RunJob:
        """RunRequest -> RunJob; ValueError naming the field when the request is malformed."""
        check_id("session_id", request.session_id)
        committed = list(request.committed_token_ids)
        if not committed:
            raise ValueError("committed_token_ids must not be empty")
        vocab = self.engine.vocab_size
        bad = next((t for t in [*committed, *request.eos_token_ids] if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the draft vocabulary [0, {vocab})")
        params = request.params
        sampling, method, seed = generation_params_from_proto(params)
        sampling.check_vocab(vocab)
        top_logprobs = num_top_logprobs(params)
        logprobs_mode_from_proto(params)  # only the verifier applies it; a bad one is refused here already
        rule = rule_from_proto(params, sampling, method)  # the verifier applies it; a bad one is refused here already
        config = self.engine.config
        nodes = method.max_draft_tokens + 1
        if nodes > config.max_tree_nodes:
            shape = params.method.shape
            raise ValueError(f"method {method.name} {shape} drafts up to {nodes} nodes; limit {config.max_tree_nodes}")
        # The draft cache holds the committed tokens but the last, the new ones but the last, and a tree.
        need = len(committed) + request.max_new_tokens + nodes
        if need > config.max_len:
            raise ValueError(
                f"{len(committed)} committed + {request.max_new_tokens} new tokens + a tree of {nodes} nodes "
                f"exceed the drafter's max_len={config.max_len}"
            )
        if not request.verifier_address:
            raise ValueError("verifier_address is required")
        shapes = ()
        if params.adaptive_shape:
            try:
                shapes = tuple(adaptive_family(method))
            except ValueError as e:
                raise ValueError(f"params.adaptive_shape: {e}") from None
        return RunJob(
            session_id=request.session_id,
            epoch=request.epoch,
            committed_ids=committed,
            params=params,
            sampling=sampling,
            method=method,
            seed=seed,
            max_new_tokens=request.max_new_tokens,
            eos_token_ids=frozenset(request.eos_token_ids),
            verifier_address=request.verifier_address,
            verifier_id=request.verifier_id,
            num_top_logprobs=top_logprobs,
            shapes=shapes,
            constraint=constraint_from_proto(params),
            output_start=output_start_from_proto(request),
            draft_stream=rule.draft_stream,
        )

"""The drafter's side of the verifier's gRPC API: the Verify stream of a run (one tree out, its verdict
back, resent on a fresh stream when it times out or breaks), the verdict's checks against the tree that
was sent, and the mapping of the verifier's answers to what the drafter reports (VerifierFailedError)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rsd.acceptance import Verdict
from rsd.tree import DraftTree, path_to
from rsd_service.status import RpcError
from rsd_wire import verifier_pb2, verifier_pb2_grpc
from rsd_wire.convert import token_logprobs_from_proto, verdict_from_proto

log = logging.getLogger(__name__)


class VerifierFailedError(RpcError):
    """The verifier refused or broke the session's stream; `code` is what it answered (UNAVAILABLE
    when it could not be reached or sent something malformed)."""


class VerifyStream:
    """The run's Verify stream, with a deadline per step. A step that times out or whose stream broke is
    resent, the very same tree, on a fresh stream: the verifier keys a step by (session, epoch, root
    position) and answers a repeated tree with the verdict it stored, so its cache grows once.
    timeout_s, attempts: DrafterConfig.verify_timeout_s, verify_attempts."""

    def __init__(self, stub: verifier_pb2_grpc.VerifierStub, timeout_s: float, attempts: int):
        self.stub, self.call = stub, stub.Verify()
        self.timeout_s, self.attempts = timeout_s, attempts

    async def exchange(self, msg: verifier_pb2.DraftTree, cancel: asyncio.Event) -> verifier_pb2.Verdict | None:
        for attempt in range(1, self.attempts + 1):
            try:
                return await asyncio.wait_for(_exchange(self.call, msg, cancel), self.timeout_s)
            except TimeoutError:
                error = VerifierFailedError(grpc.StatusCode.UNAVAILABLE, f"no verdict in {self.timeout_s} s")
            except VerifierFailedError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE:  # the verifier refused the step: a retry would too
                    raise
                error = e
            if attempt == self.attempts:
                raise error
            log.warning("session %s step at %d: %s; resending (%d)", msg.session_id, msg.root_position, error, attempt)
            self.call.cancel()
            await asyncio.sleep(0.05 * attempt)
            self.call = self.stub.Verify()
        raise AssertionError("unreachable")

    def cancel(self) -> None:
        self.call.cancel()


async def _exchange(
    call: grpc.aio.StreamStreamCall, msg: verifier_pb2.DraftTree, cancel: asyncio.Event
) -> verifier_pb2.Verdict | None:
    """Send one tree and read its verdict; None when the run was cancelled while waiting."""
    try:
        await call.write(msg)
        read = asyncio.ensure_future(call.read())
        stop = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not read.done():
            read.cancel()
            return None
        reply = read.result()
    except grpc.aio.AioRpcError as e:
        raise verifier_error(e.code(), e.details(), "Verify") from None
    except asyncio.InvalidStateError:  # a write to a stream that already ended (the verifier went away)
        reply = grpc.aio.EOF
    if reply is grpc.aio.EOF:
        code, details = await call.code(), await call.details()
        if code == grpc.StatusCode.OK:
            code, details = grpc.StatusCode.UNAVAILABLE, "the verifier ended the stream before answering"
        raise verifier_error(code, details, "Verify")
    return reply


def check_verdict(
    reply: verifier_pb2.Verdict, sent: verifier_pb2.DraftTree, tree: DraftTree, logprobs: bool = False
) -> Verdict:
    """The verdict must answer this step and name a root-to-node path of this tree (and carry its tokens'
    log-probabilities when `logprobs`)."""
    try:
        verdict = verdict_from_proto(reply)
        if logprobs:
            token_logprobs_from_proto(reply.logprobs, len(verdict.token_ids))
    except ValueError as e:
        raise VerifierFailedError(grpc.StatusCode.UNAVAILABLE, f"malformed verdict: {e}") from None
    n = tree.num_nodes
    path = path_to(tree.parent_idx, verdict.accepted_idx[-1]) if verdict.accepted_idx else []
    ok = (
        (reply.session_id, reply.epoch, reply.root_position) == (sent.session_id, sent.epoch, sent.root_position)
        and all(i < n for i in verdict.accepted_idx)
        and path == verdict.accepted_idx
        and tree.token_ids[path].tolist() == verdict.accepted_ids
    )
    if not ok:
        raise VerifierFailedError(grpc.StatusCode.UNAVAILABLE, "verdict does not match the tree that was sent")
    return verdict


# Answers of the verifier that say the request itself was wrong: passed on as they are. Anything
# else (unreachable, restarted, overloaded, internal error) is UNAVAILABLE: the gateway then picks
# a live verifier and starts a new epoch (drafter.proto).
_PASSED_ON = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


def verifier_error(code: grpc.StatusCode, details: str, rpc: str) -> VerifierFailedError:
    passed_on = code if code in _PASSED_ON else grpc.StatusCode.UNAVAILABLE
    return VerifierFailedError(passed_on, f"verifier {rpc} failed: {code.name}: {details}")

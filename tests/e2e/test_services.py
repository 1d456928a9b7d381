"""The drafter and verifier services over real gRPC (in-process grpc.aio servers on loopback, port 0)
and a real redis-server, with tiny Llama models.

The test plays the gateway: it calls Drafter.Run with the committed tokens and the verifier's
address, or talks to Verifier.Attach/Verify directly. Reference for every output: the in-process
SpeculativeGenerator with the same seed (and the target's own greedy decoding at T=0).
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import redis
import torch

from drafter_service import server as drafter_server
from drafter_service.config import DrafterConfig
from gateway.store.redis_store import RedisSessionStore
from rsd.acceptance import RULES
from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd.tree import DraftTree
from rsd_runtime import packed
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import batch_variance, load_model
from rsd_runtime.runner import ModelRunner
from rsd_tools.tiny import build_tiny_pair
from rsd_wire import common_pb2, drafter_pb2, verifier_pb2
from rsd_wire.convert import draft_tree_to_proto, proposal_law_to_proto, tensor_to_proto
from tests.fixtures.redis_server import redis_server
from tests.fixtures.services import (
    MAX_LEN,
    NEW_TOKENS,
    PROMPT,
    gen_params,
    penalised_greedy,
    reference,
    run,
    services,
)
from verifier_service import server as verifier_server
from verifier_service.batcher import Batcher
from verifier_service.config import VerifierConfig
from verifier_service.engine import UnknownSessionError, VerifierPool, VerifyRequest

# What tests that must see sessions share a forward let the verifier (and the drafter) wait for them: long enough for
# their steps to meet on a loaded machine (20-30 ms did not, once), and free otherwise, since the wait ends as soon as
# every open session has queued its tree (Batcher.open_sessions; the drafter's packer likewise).
SHARE_WAIT_MS = 1000.0

CASES = [
    ("sd", "3"),
    ("specinfer", "2,2"),
    ("spectr", "2x3"),
    ("rsd_c", "2,2,1"),
    ("rsd_s", "3x3"),
    ("rsd_s", "3x4@0.2"),
    ("lookup", "4"),  # from the context alone: the drafter service runs no forward (rsd.lookup)
    ("lookup", "2,1,1"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    draft_dir, target_dir = build_tiny_pair(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(draft_dir), load_model(target_dir)


# ---------------------------------------------------------------------------------------------
# 1. exactness through drafter -> verifier


def test_every_method_matches_in_process_generator(models):
    """T=0: every method equals the target's greedy output; T>0: SpeculativeGenerator, token for token."""
    greedy = SpeculativeGenerator(ModelRunner(models[1], MAX_LEN)).generate(PROMPT, None, SamplingParams(0), NEW_TOKENS)
    jobs = []
    for i, (name, shape) in enumerate(CASES):
        jobs.append((f"greedy-{i}-{name}", gen_params(name, shape, 0.0, seed=i), greedy.token_ids))
        params = gen_params(name, shape, 0.8, seed=100 + i, top_p=0.95 if i % 2 else None)
        sampling = SamplingParams(0.8, top_p=0.95 if i % 2 else 1.0)
        jobs.append(
            (f"sample-{i}-{name}", params, reference(models, PROMPT, Method.parse(name, shape), sampling, 100 + i))
        )

    async def main():
        unbatched = {"num_slots": len(jobs), "batching": False}  # test 2 covers the batched path
        async with services(models, unbatched, {"max_sessions": len(jobs)}) as (vhandle, _, stub, _):
            outs = await asyncio.gather(*(run(stub, vhandle, sid, params) for sid, params, _ in jobs))
        for (sid, _, expected), (tokens, events) in zip(jobs, outs, strict=True):
            assert tokens == expected, sid
            assert events[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert sum(e.stats.num_accepted_tokens + 1 for e in events) >= len(tokens)
            assert {e.stats.verifier.batch_num_sessions for e in events} == {1}  # batching off

    asyncio.run(main())


# The verification each request picks (GenerationParams.verification) -> the rule the verifier runs at T > 0.
VERIFICATION_CASES = [
    ("sd", "3", "", "rrs"),  # "" = token
    ("sd", "3", "traversal", "traversal"),
    ("sd", "3", "block", "block"),
    ("rsd_s", "1x4", "block", "block"),  # one beam: a chain
    ("specinfer", "2,2", "traversal", "traversal_with_replacement"),
    ("spectr", "2x3", "traversal", "traversal_with_replacement"),
    ("rsd_c", "2,2,1", "traversal", "traversal"),
    ("rsd_s", "3x3", "traversal", "traversal"),
    ("rsd_s", "3x3", "coupled", "coupled"),  # the drafter draws from Stream.COUPLED (Rule.draft_stream)
    ("rsd_c", "2,2,1", "coupled", "coupled"),
    ("lookup", "4", "coupled", "coupled"),
    ("lookup", "4", "traversal", "traversal"),
]


def test_every_verification_matches_in_process_generator(models):
    """Each verification, chosen per request and applied by the verifier (the drafter drafts, and pre-drafts, as
    ever), all sessions at once through the batching services (rules side by side in packed forwards): at T = 0
    the target's greedy output whatever the rule; at T = 1 SpeculativeGenerator's tokens with the same seed and
    verification, token for token. Every verdict's stats name the rule that ran."""
    greedy = SpeculativeGenerator(ModelRunner(models[1], MAX_LEN)).generate(PROMPT, None, SamplingParams(0), NEW_TOKENS)
    jobs = []
    for i, (name, shape, verification, rule) in enumerate(VERIFICATION_CASES):
        params = gen_params(name, shape, 0.0, i, verification=verification)
        jobs.append((f"greedy-{i}", params, greedy.token_ids, "greedy"))
        method, seed = Method.parse(name, shape), 200 + i
        expected = reference(models, PROMPT, method, SamplingParams(1.0), seed, verification=verification or "token")
        jobs.append((f"sample-{i}", gen_params(name, shape, 1.0, seed, verification=verification), expected, rule))

    async def main():
        n = len(jobs)
        verifier_cfg = {"num_slots": n, "batch_wait_ms": SHARE_WAIT_MS}
        async with services(models, verifier_cfg, {"max_sessions": n}) as (vh, _, stub, _):
            outs = await asyncio.gather(*(run(stub, vh, sid, params) for sid, params, _, _ in jobs))
        for (sid, _, expected, rule), (tokens, events) in zip(jobs, outs, strict=True):
            assert tokens == expected, sid
            assert {e.stats.verifier.rule for e in events} == {rule}, sid
        assert max(e.stats.verifier.batch_num_sessions for _, events in outs for e in events) > 1

    asyncio.run(main())


def test_lookups_merged_into_the_drafters_trees_match_the_in_process_generator(models):
    """The drafter service with lookup_n 2 (rsd.lookup.HybridProposal) on a prompt that repeats, pre-drafting on:
    T = 0 is the target's greedy output, T = 0.8 SpeculativeGenerator(lookup_n=2)'s tokens with the same seed."""
    prompt = [*PROMPT, *PROMPT[:4]]
    greedy = SpeculativeGenerator(ModelRunner(models[1], MAX_LEN)).generate(prompt, None, SamplingParams(0), NEW_TOKENS)
    jobs = []
    for i, (name, shape) in enumerate([("sd", "3"), ("rsd_s", "2x3"), ("rsd_c", "2,1,1")]):
        jobs.append((f"greedy-{i}", gen_params(name, shape, 0.0, seed=i), greedy.token_ids))
        expected = reference(models, prompt, Method.parse(name, shape), SamplingParams(0.8), 300 + i, lookup_n=2)
        jobs.append((f"sample-{i}", gen_params(name, shape, 0.8, seed=300 + i), expected))

    async def main():
        drafter_cfg = {"max_sessions": len(jobs), "lookup_n": 2, "predraft": True}
        async with services(models, {"num_slots": len(jobs)}, drafter_cfg) as (vhandle, _, stub, _):
            outs = await asyncio.gather(*(run(stub, vhandle, sid, params, committed=prompt) for sid, params, _ in jobs))
        for (sid, _, expected), (tokens, _) in zip(jobs, outs, strict=True):
            assert tokens == expected, sid

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# 2. several sessions at once, packed into shared forwards


def test_concurrent_sessions_are_packed_and_exact(models, monkeypatch):
    """Four Runs against one batching verifier, with the drafter truncating its proposals to its
    top 16 (sparse laws on the wire): each equals its solo in-process output, and some target
    forwards held more than one session. Every packed forward ran on its service's compute thread
    (rsd_runtime.compute)."""
    threads = []  # the thread each packed forward ran on

    def on_thread(fn):
        def wrapped(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(packed, "forward_packed", on_thread(packed.forward_packed))
    jobs = {f"s{i}": (PROMPT[: 2 + i], gen_params(*CASES[(i + 1) % 5], temperature=1.0, seed=7 + i)) for i in range(4)}
    expected = {
        sid: reference(
            models, prompt, Method.parse(p.method.name, p.method.shape), SamplingParams(1.0), p.seed, draft_top_k=16
        )
        for sid, (prompt, p) in jobs.items()
    }

    async def main():
        cfg, drafter_cfg = {"batch_wait_ms": SHARE_WAIT_MS}, {"proposal_top_k": 16, "batch_wait_ms": SHARE_WAIT_MS}
        async with services(models, cfg, drafter_cfg) as (vhandle, dhandle, stub, _):
            vhandle.engine.verify_batch = on_thread(vhandle.engine.verify_batch)
            outs = await asyncio.gather(*(run(stub, vhandle, sid, p, committed=pr) for sid, (pr, p) in jobs.items()))
            stats, draft_stats = vhandle.batcher.stats, dhandle.engine.packer.stats
        for sid, (tokens, _) in zip(jobs, outs, strict=True):
            assert tokens == expected[sid], sid
        sessions_per_forward = [e.stats.verifier.batch_num_sessions for _, events in outs for e in events]
        assert max(sessions_per_forward) > 1
        assert stats.num_multi_session_forwards > 0 and stats.max_sessions > 1
        # The drafter packed the sessions' draft forwards too (rsd_runtime.packed).
        assert draft_stats.max_calls > 1 and draft_stats.forwards < draft_stats.calls
        assert {name.split("_")[0] for name in threads} == {"drafter-compute", "verifier-compute"}

    asyncio.run(main())


@pytest.mark.parametrize("others", [1, 3, 7])
def test_a_seeded_session_gets_its_lone_tokens_whoever_shares_the_batch(models, others):
    """Session 0 at T = 0.8 alone, then packed with `others` sessions of other methods, prompts (one of 70
    tokens: a packed forward above small_gemm's 64 rows) and seeds, through the batching services: the same
    tokens, as vLLM's batch-invariant mode and SGLang's deterministic inference promise. Holds where no path
    of either model varies with its batch (rsd_runtime.models.batch_variance)."""
    draft, target = models
    why = batch_variance(target) or batch_variance(draft)
    if why:
        pytest.skip(f"not batch-invariant on this machine: {why}")
    vocab = target.config.vocab_size
    mine = ("me", PROMPT, gen_params("rsd_s", "3x3", 0.8, seed=11))
    crowd = [
        (
            f"o{i}",
            [2] + [(5 + 7 * i + j) % vocab for j in range(69 if i == 1 else 3 + i)],
            gen_params(*CASES[i % 6], 0.8, 50 + i),
        )
        for i in range(others)
    ]

    async def main(jobs):
        cfg = {"batch_wait_ms": SHARE_WAIT_MS, "num_slots": 8}
        async with services(models, cfg, {"max_sessions": 8}) as (vhandle, _, stub, _):
            return await asyncio.gather(*(run(stub, vhandle, sid, p, committed=pr) for sid, pr, p in jobs))

    ((alone, _),) = asyncio.run(main([mine]))
    outs = asyncio.run(main([mine, *crowd]))
    assert outs[0][0] == alone
    assert max(e.stats.verifier.batch_num_sessions for e in outs[0][1]) > 1  # it did share forwards


# ---------------------------------------------------------------------------------------------
# 3. bad input


def valid_tree(root: int, vocab: int, scale: float = 1.0) -> DraftTree:
    """root -> a -> b, with full-support laws (scale != 1 makes them unnormalised)."""
    probs = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)), -1) * scale
    return DraftTree(torch.tensor([root, 20, 21]), torch.tensor([-1, 0, 1]), probs)


async def verify_once(vstub, msg) -> verifier_pb2.Verdict:
    call = vstub.Verify()
    await call.write(msg)
    reply = await call.read()
    await call.done_writing()
    if reply is grpc.aio.EOF:
        raise grpc.aio.AioRpcError(await call.code(), None, None, await call.details())
    return reply


async def expect_status(code, coro) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, info.value.details()
    assert info.value.details()
    return info.value.details()


def test_bad_input_gets_a_status_and_harms_no_one(models):
    vocab = models[1].config.vocab_size
    good = gen_params("rsd_c", "2,2,1", 0.9, seed=5)
    expected = reference(models, PROMPT, Method.parse("rsd_c", "2,2,1"), SamplingParams(0.9), 5)

    def tree_msg(tree=None, **fields):
        msg = draft_tree_to_proto(tree or valid_tree(PROMPT[-1], vocab), session_id="bad", epoch=3, root_position=4)
        for name, value in fields.items():
            if isinstance(value, torch.Tensor):
                getattr(msg, name).CopyFrom(tensor_to_proto(value))
            else:
                setattr(msg, name, value)
        return msg

    async def attacks(vstub):
        invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
        attach = verifier_pb2.AttachRequest(session_id="bad", epoch=3, committed_token_ids=PROMPT, params=good)
        assert (await vstub.Attach(attach)).vocab_size == vocab
        cycle = await expect_status(invalid, verify_once(vstub, tree_msg(parent_idx=torch.tensor([-1, 2, 1]))))
        assert "parent" in cycle
        oov = await expect_status(invalid, verify_once(vstub, tree_msg(token_ids=torch.tensor([PROMPT[-1], 9999, 21]))))
        assert "vocabulary" in oov
        unnormalised = tree_msg(valid_tree(PROMPT[-1], vocab, scale=1.5))
        assert "sum to 1" in await expect_status(invalid, verify_once(vstub, unnormalised))
        sparse_bad = tree_msg()
        sparse_bad.laws[0].CopyFrom(proposal_law_to_proto(0, torch.tensor([0.0] * (vocab - 1) + [1.0])))
        assert "zero probability" in await expect_status(invalid, verify_once(vstub, sparse_bad))
        assert "root_position" in await expect_status(precondition, verify_once(vstub, tree_msg(root_position=9)))
        assert "epoch" in await expect_status(precondition, verify_once(vstub, tree_msg(epoch=2)))
        await expect_status(grpc.StatusCode.NOT_FOUND, verify_once(vstub, tree_msg(session_id="nobody")))
        wrong_root = tree_msg(token_ids=torch.tensor([PROMPT[-1] + 1, 20, 21]))
        assert "root" in await expect_status(invalid, verify_once(vstub, wrong_root))
        older = verifier_pb2.AttachRequest(session_id="bad", epoch=2, committed_token_ids=PROMPT, params=good)
        await expect_status(precondition, vstub.Attach(older))
        no_seed = verifier_pb2.AttachRequest(session_id="x", epoch=1, committed_token_ids=PROMPT)
        await expect_status(invalid, vstub.Attach(no_seed))
        for verification, reason in [("bogus" * 100, "unknown verification"), ("block", "one chain only")]:
            params = gen_params("rsd_c", "2,2,1", 0.9, seed=5, verification=verification)
            bad_rule = verifier_pb2.AttachRequest(session_id="y", epoch=1, committed_token_ids=PROMPT, params=params)
            details = await expect_status(invalid, vstub.Attach(bad_rule))
            assert details.startswith("params.verification") and reason in details and len(details) < 200
        bad_mode = gen_params("rsd_c", "2,2,1", 0.9, seed=5)
        bad_mode.logprobs, bad_mode.logprobs_mode = True, "processed"
        bad_mode_attach = verifier_pb2.AttachRequest(session_id="y", epoch=1, committed_token_ids=PROMPT)
        bad_mode_attach.params.CopyFrom(bad_mode)
        assert (await expect_status(invalid, vstub.Attach(bad_mode_attach))).startswith("params.logprobs_mode")
        # After all that, the session still verifies a good tree.
        assert (await verify_once(vstub, tree_msg())).root_position == 4

    async def bad_runs(stub, vhandle):
        base = dict(session_id="r", epoch=1, committed_token_ids=PROMPT, params=good, max_new_tokens=4)
        base["verifier_address"] = vhandle.address
        bad = [
            {"committed_token_ids": []},
            {"committed_token_ids": [*PROMPT, vocab]},
            {"session_id": "no spaces"},
            {"params": gen_params("nope", "2", 0.5, seed=1)},
            {"params": gen_params("rsd_c", "0,2", 0.5, seed=1)},
            {"params": common_pb2.GenerationParams(method=good.method)},  # no seed
            {"params": gen_params("sd", "3", -1.0, seed=1)},
            {"params": gen_params("sd", "3", 1.0, seed=1, verification="Token")},  # the drafter refuses it too
            {"params": gen_params("spectr", "2x3", 1.0, seed=1, verification="block")},
            {"params": common_pb2.GenerationParams(method=good.method, seed=1, logprobs_mode="raw")},
            {"verifier_address": ""},
            {"max_new_tokens": MAX_LEN},
        ]
        for fields in bad:
            request = drafter_pb2.RunRequest(**{**base, **fields})
            await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Run(request).read())
        gone = drafter_pb2.RunRequest(**{**base, "verifier_address": "127.0.0.1:1"})
        assert "verifier" in await expect_status(grpc.StatusCode.UNAVAILABLE, stub.Run(gone).read())

    async def main():
        async with services(models) as (vhandle, _, stub, vstub):
            honest = asyncio.create_task(run(stub, vhandle, "honest", good))
            await attacks(vstub)
            await bad_runs(stub, vhandle)
            tokens, _ = await honest
        assert tokens == expected

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# 4. idempotent retry


def test_retried_tree_returns_the_stored_verdict(models):
    vocab = models[1].config.vocab_size

    async def main():
        async with services(models) as (vhandle, _, _, vstub):
            attach = verifier_pb2.AttachRequest(
                session_id="retry", epoch=1, committed_token_ids=PROMPT, params=gen_params("sd", "2", 1.0, seed=3)
            )
            await vstub.Attach(attach)
            msg = draft_tree_to_proto(valid_tree(PROMPT[-1], vocab), session_id="retry", epoch=1, root_position=4)
            first = await verify_once(vstub, msg)
            cached = vhandle.engine.cached_length("retry")
            committed = list(vhandle.servicer.sessions["retry"].committed)
            again = await verify_once(vstub, msg)  # a new stream, as after a lost connection
            assert again == first
            assert vhandle.engine.cached_length("retry") == cached == len(PROMPT) + len(first.accepted_token_ids)
            assert vhandle.servicer.sessions["retry"].committed == committed
            other = draft_tree_to_proto(
                DraftTree(torch.tensor([PROMPT[-1], 30]), torch.tensor([-1, 0]), torch.full((2, vocab), 1 / vocab)),
                session_id="retry",
                epoch=1,
                root_position=4,
            )
            await expect_status(grpc.StatusCode.FAILED_PRECONDITION, verify_once(vstub, other))
            # The next step goes on from the committed sequence.
            root = committed[-1]
            nxt = DraftTree(torch.tensor([root, 40]), torch.tensor([-1, 0]), torch.full((2, vocab), 1 / vocab))
            reply = await verify_once(
                vstub, draft_tree_to_proto(nxt, session_id="retry", epoch=1, root_position=len(committed) - 1)
            )
            assert reply.root_position == len(committed) - 1

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# 5. registration in Redis


def test_services_register_and_expire(models):
    draft, target = models
    with redis_server() as server:
        namespace = server.namespace("services")
        store = RedisSessionStore(server.client(), namespace=namespace)
        reg = {"redis_url": server.url, "redis_namespace": namespace, "heartbeat_s": 0.2, "registration_ttl_s": 1.5}

        async def main():
            vserver, _, vhandle = await verifier_server.create_server(VerifierConfig(**reg, verifier_id="v1"), target)
            dserver, _, dhandle = await drafter_server.create_server(DrafterConfig(**reg), draft)
            try:
                await asyncio.sleep(0.5)  # a couple of heartbeats
                (info,) = store.list_services("verifier")
                assert (info.service_id, info.address, info.capacity) == ("v1", vhandle.address, 8)
                assert [d.address for d in store.list_services("drafter")] == [dhandle.address]
                # A crash: the heartbeat stops and nobody unregisters; the entry expires after its TTL.
                await vhandle.heartbeat.stop(unregister=False)
                vhandle.heartbeat = None
                await asyncio.sleep(0.3)
                assert [s.service_id for s in store.list_services("verifier")] == ["v1"]
                deadline = time.monotonic() + 5
                while store.list_services("verifier") and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert store.list_services("verifier") == []
            finally:
                await vhandle.close(vserver, 0)
                await dhandle.close(dserver, 0)  # a graceful stop unregisters at once
            assert store.list_services("drafter") == []

        asyncio.run(main())
        with pytest.raises(redis.ConnectionError):  # a wrong Redis URL fails at start, not silently

            async def bad():
                await verifier_server.create_server(VerifierConfig(redis_url="redis://127.0.0.1:1/0"), target)

            asyncio.run(bad())


# ---------------------------------------------------------------------------------------------
# 6. a continued run reuses both caches


def test_continued_run_reuses_the_caches(models):
    method = Method.parse("rsd_s", "3x3")

    async def main():
        async with services(models) as (vhandle, dhandle, stub, _):
            first, _ = await run(stub, vhandle, "cont", gen_params("rsd_s", "3x3", 0.7, seed=11), new_tokens=12)
            assert dhandle.engine.last_attach["cont"].cached_length_tokens == 0
            committed = PROMPT + first + [50, 51]  # the next turn: generated tokens, then new input
            second, _ = await run(
                stub, vhandle, "cont", gen_params("rsd_s", "3x3", 0.7, seed=12), committed=committed, epoch=2
            )
            cached = dhandle.engine.last_attach["cont"].cached_length_tokens  # as the verifier answered Attach
            assert cached >= len(PROMPT) + len(first) - 1
            assert vhandle.servicer.sessions["cont"].cached_at_attach == cached
            return first, committed, second

    first, committed, second = asyncio.run(main())
    assert first == reference(models, PROMPT, method, SamplingParams(0.7), 11, new_tokens=12)
    assert second == reference(models, committed, method, SamplingParams(0.7), 12)


PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.8}
OUTPUT_ONLY = {"presence_penalty": 2.0, "frequency_penalty": 2.0}  # where prompt and output differ most


def test_penalties_through_the_services(models):
    """Presence, frequency and repetition penalties (rsd.penalties) through drafter and verifier: at T = 0 the
    target alone with the penalties, token for token (so the penalised argmax at every tree node); at T = 1 the
    in-process generator's tokens with the same seed. A run resumed at a step boundary of the same turn
    (RunRequest.output_start_position, as after a failover) continues it exactly, at T = 1 and T = 0; without the
    field the run is a new turn that counts only its own output, as the target alone on that prompt (which here
    gives other tokens)."""
    want_greedy = penalised_greedy(models[1], PROMPT, NEW_TOKENS, SamplingParams(0, **PENALTIES))
    plain_greedy = penalised_greedy(models[1], PROMPT, NEW_TOKENS, SamplingParams(0))
    assert want_greedy != plain_greedy  # the penalties change this output
    alone = SpeculativeGenerator(ModelRunner(models[1], MAX_LEN))  # the target alone, through rsd's own code
    assert alone.generate(PROMPT, None, SamplingParams(0, **PENALTIES), NEW_TOKENS).token_ids == want_greedy
    method, sampling = Method.parse("rsd_c", "2,2,1"), SamplingParams(1.0, **PENALTIES)
    want_sampled = reference(models, PROMPT, method, sampling, seed=31)
    whole_turn = penalised_greedy(models[1], PROMPT, NEW_TOKENS, SamplingParams(0, **OUTPUT_ONLY))
    first_output = whole_turn[:8]

    def params(temperature, seed, name="rsd_c", shape="2,2,1", penalties=PENALTIES):
        msg = gen_params(name, shape, temperature, seed)
        for key, value in penalties.items():
            setattr(msg.sampling, key, value)
        return msg

    async def main():
        async with services(models) as (vhandle, _, stub, _):
            greedy = [await run(stub, vhandle, f"pen-g-{n}", params(0.0, 1, n, s)) for n, s in CASES[::2]]
            sampled, events = await run(stub, vhandle, "pen-s", params(1.0, 31))
            cut = len(events[0].token_ids) + len(events[1].token_ids)  # a step boundary
            resumed = PROMPT + sampled[:cut]
            same_turn, _ = await run(
                stub, vhandle, "pen-r", params(1.0, 31), resumed, NEW_TOKENS - cut, output_start=len(PROMPT)
            )
            resumed_greedy, greedy_params = PROMPT + first_output, params(0.0, 1, penalties=OUTPUT_ONLY)
            runs = [  # T = 0 resumed: the same turn, and a new turn whose output starts there
                await run(stub, vhandle, f"pen-t{i}", greedy_params, resumed_greedy, NEW_TOKENS - 8, output_start=at)
                for i, at in enumerate([len(PROMPT), None])
            ]
            return greedy, sampled, cut, same_turn, [tokens for tokens, _ in runs]

    greedy, sampled, cut, same_turn, (greedy_same_turn, greedy_new_turn) = asyncio.run(main())
    assert all(tokens == want_greedy for tokens, _ in greedy)
    assert sampled == want_sampled
    assert same_turn == sampled[cut:]
    assert greedy_same_turn == whole_turn[8:]
    new_turn = penalised_greedy(models[1], PROMPT + first_output, NEW_TOKENS - 8, SamplingParams(0, **OUTPUT_ONLY))
    assert greedy_new_turn == new_turn != whole_turn[8:]


# ---------------------------------------------------------------------------------------------
# 7. slots and cancellation


def test_an_attach_waits_for_a_finishing_run(models):
    """One slot, held by a run with its stream open: the next session's Attach waits (attach_wait_s)
    until that run ends and closes its stream, then takes the slot; nothing is refused."""
    params = gen_params("sd", "3", 0.0, seed=0)

    async def main():
        async with services(models, {"num_slots": 1, "attach_wait_s": 60}) as (vhandle, _, stub, _):
            first = asyncio.ensure_future(run(stub, vhandle, "a", params, new_tokens=40))
            while "a" not in vhandle.servicer.sessions or not vhandle.servicer.num_open_streams:
                await asyncio.sleep(0.01)
            second, _ = await run(stub, vhandle, "b", params, new_tokens=4)
            (tokens, _), alone = await first, await run(stub, vhandle, "c", params, new_tokens=40)
            assert tokens == alone[0] and len(second) == 4
            assert set(vhandle.servicer.sessions) == {"c"}

    asyncio.run(main())


def test_idle_sessions_are_evicted_and_runs_cancel(models):
    """One verifier slot: a finished session's cache makes room for a new one, a streaming session's
    does not (the drafter reports UNAVAILABLE: the gateway tries another verifier). Cancel ends a
    run with a CANCELLED event, and only at the run's epoch."""
    params = gen_params("sd", "3", 0.0, seed=0)

    async def main():
        async with services(models, {"num_slots": 1, "attach_wait_s": 0}) as (vhandle, _, stub, _):
            await run(stub, vhandle, "a", params, new_tokens=4)
            assert set(vhandle.servicer.sessions) == {"a"}  # kept for the session's next turn
            fields = dict(
                committed_token_ids=PROMPT, params=params, max_new_tokens=200, verifier_address=vhandle.address
            )
            call = stub.Run(drafter_pb2.RunRequest(session_id="b", epoch=1, **fields))
            assert (await call.read()).token_ids
            assert set(vhandle.servicer.sessions) == {"b"}  # "a" was idle: evicted
            blocked = drafter_pb2.RunRequest(**{**fields, "session_id": "c", "epoch": 1, "max_new_tokens": 4})
            details = await expect_status(grpc.StatusCode.UNAVAILABLE, stub.Run(blocked).read())
            assert "RESOURCE_EXHAUSTED" in details
            assert not (await stub.Cancel(drafter_pb2.CancelRunRequest(session_id="b", epoch=2))).was_running
            assert (await stub.Cancel(drafter_pb2.CancelRunRequest(session_id="b", epoch=1))).was_running
            events = []
            while (event := await call.read()) is not grpc.aio.EOF:
                events.append(event)
            assert events[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
            assert sum(len(e.token_ids) for e in events) < 150
            # The gateway drops a Run mid-stream; the next run of the session (new epoch) is still exact.
            dropped = stub.Run(drafter_pb2.RunRequest(**{**fields, "session_id": "b", "epoch": 2}))
            assert (await dropped.read()).token_ids
            dropped.cancel()
            committed = [*PROMPT, 9, 9]
            tokens, _ = await run(stub, vhandle, "b", params, committed=committed, new_tokens=8, epoch=3)
            return committed, tokens

    committed, tokens = asyncio.run(main())
    assert tokens == reference(models, committed, Method.parse("sd", "3"), SamplingParams(0), 0, new_tokens=8)


# ---------------------------------------------------------------------------------------------
# 8. the batcher alone: a request the engine refuses does not cost its batch-mates their step


def test_batcher_isolates_a_refused_request(models):
    vocab = models[1].config.vocab_size
    engine = VerifierPool(models[1], num_slots=2, max_len=MAX_LEN)
    engine.attach("ok", PROMPT)

    async def main():
        batcher = Batcher(engine, max_batch_nodes=512, batch_wait_ms=50.0)
        batcher.start()
        try:
            greedy = (RULES["greedy"], SamplingParams(0), None)
            good = VerifyRequest("ok", PROMPT, valid_tree(PROMPT[-1], vocab), *greedy)
            ghost = VerifyRequest("ghost", PROMPT, valid_tree(PROMPT[-1], vocab), *greedy)
            outcomes = await asyncio.gather(
                batcher.submit(good, 7, lambda v, info: (v, info)),
                batcher.submit(ghost, 7, lambda v, info: (v, info)),
                return_exceptions=True,
            )
        finally:
            await batcher.stop()
        (verdict, info), refused = outcomes
        assert isinstance(refused, UnknownSessionError)
        assert info.num_sessions == 1  # retried alone after the packed call was refused
        assert engine.cached_length("ok") == len(PROMPT) + len(verdict.accepted_ids)

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# 9. the verifier dies mid-run


def test_verifier_death_mid_run_is_unavailable(models):
    """drafter.proto: a failed verifier stream ends the Run with UNAVAILABLE (the gateway's cue to
    fail over), and the drafter serves the session's next run on a live verifier, exactly."""
    params = gen_params("rsd_c", "2,2,1", 0.0, seed=0)

    async def main():
        async with services(models) as (vhandle, dhandle, stub, _):
            dead_server, _, dead = await verifier_server.create_server(VerifierConfig(max_len=MAX_LEN), models[1])
            request = drafter_pb2.RunRequest(
                session_id="f",
                epoch=1,
                committed_token_ids=PROMPT,
                params=params,
                max_new_tokens=200,
                verifier_address=dead.address,
            )
            call = stub.Run(request)
            first = await call.read()
            await dead.close(dead_server, 0)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert dhandle.engine.num_running == 0
            committed = [*PROMPT, *first.token_ids]
            tokens, _ = await run(stub, vhandle, "f", params, committed=committed, new_tokens=8, epoch=2)
            return committed, tokens

    committed, tokens = asyncio.run(main())
    assert tokens == reference(models, committed, Method.parse("rsd_c", "2,2,1"), SamplingParams(0), 0, new_tokens=8)


def test_batcher_skips_the_wait_when_every_open_session_is_queued():
    """A lone session must not pay batch_wait_ms per step: with an hour-long wait configured, the
    gather returns at once when every session with an open stream has a tree queued."""
    from verifier_service.batcher import Batcher
    from verifier_service.engine import VerifyRequest

    class Forwarded(Exception):
        pass

    class Engine:  # stands for the VerifierPool: says the forward ran
        def verify_batch(self, requests):
            raise Forwarded

    async def run() -> None:
        batcher = Batcher(Engine(), max_batch_nodes=512, batch_wait_ms=3_600_000)
        batcher.open_sessions = lambda: 1
        batcher.start()
        try:
            with pytest.raises(Forwarded):  # not a TimeoutError: the hour was not waited
                await asyncio.wait_for(batcher.submit(VerifyRequest("a", [1, 2], None, None, None), 3, None), 60)
        finally:
            await batcher.stop()

    asyncio.run(run())


def test_adaptive_shapes_are_exact_at_t0_and_vary(models):
    """params.adaptive_shape: the drafter picks each step's (width, depth) up to the given shape
    (rsd.shape_control); at T = 0 the output is the target's greedy one whatever shapes it picks, with
    pre-drafting on and off (T > 0: the enumeration in tests/rsd/test_shape_control.py). A method whose
    trees are not (W, L) is refused."""
    greedy = SpeculativeGenerator(ModelRunner(models[1], MAX_LEN)).generate(PROMPT, None, SamplingParams(0), NEW_TOKENS)
    sizes = set()

    async def main():
        for predraft in (True, False):
            async with services(models, None, {"predraft": predraft}) as (vhandle, _, stub, _):
                for name, shape in (("sd", "4"), ("rsd_s", "3x3"), ("spectr", "2x3")):
                    params = gen_params(name, shape, 0.0, seed=1)
                    params.adaptive_shape = True
                    tokens, events = await run(stub, vhandle, f"adaptive-{name}-{predraft}", params)
                    assert tokens == greedy.token_ids, (name, predraft)
                    sizes.update(e.stats.num_draft_tokens for e in events[:-1])
                    params.sampling.temperature = 0.8  # runs through (each rule takes every (W, L) tree)
                    tokens, _ = await run(stub, vhandle, f"adaptive-t-{name}-{predraft}", params)
                    assert len(tokens) == NEW_TOKENS
                params = gen_params("rsd_c", "2,2", 0.0, seed=1)
                params.adaptive_shape = True
                details = await expect_status(grpc.StatusCode.INVALID_ARGUMENT, run(stub, vhandle, "refused", params))
                assert "params.adaptive_shape" in details

    asyncio.run(main())
    assert len(sizes) > 1  # the shapes did change


def test_auto_is_the_targets_output_whatever_plans_it_makes(models):
    """method auto (rsd.auto): each step's plan (the root alone, a context chain, the model's chain) from the
    costs and acceptance the drafter measured, on a prompt that repeats. At T = 0 the target's greedy output; at
    T = 0.8 under the coupled rule the target alone's seeded tokens (its noise is the target's whatever the plan),
    through the services and in process; under the token rule it runs through. The plans do vary."""
    prompt = [*PROMPT, *PROMPT[:4]]
    target_alone = SpeculativeGenerator(ModelRunner(models[1], MAX_LEN))
    greedy = target_alone.generate(prompt, None, SamplingParams(0), NEW_TOKENS).token_ids
    coupled = target_alone.generate(prompt, None, SamplingParams(0.8), NEW_TOKENS, seed=7, verification="coupled")
    auto = Method.parse("auto", "3")
    assert reference(models, prompt, auto, SamplingParams(0.8), 7, verification="coupled") == coupled.token_ids
    sizes = set()

    async def main():
        async with services(models, None, {"lookup_n": 2}) as (vhandle, _, stub, _):
            tokens, events = await run(stub, vhandle, "auto-greedy", gen_params("auto", "3", 0.0, 1), committed=prompt)
            assert tokens == greedy
            sizes.update(e.stats.num_draft_tokens for e in events[:-1])
            params = gen_params("auto", "3", 0.8, 7, verification="coupled")
            tokens, events = await run(stub, vhandle, "auto-coupled", params, committed=prompt)
            assert tokens == coupled.token_ids
            sizes.update(e.stats.num_draft_tokens for e in events[:-1])
            tokens, _ = await run(stub, vhandle, "auto-token", gen_params("auto", "3", 0.8, 8), committed=prompt)
            assert len(tokens) == NEW_TOKENS

    asyncio.run(main())
    assert len(sizes) > 1  # the plans did change

"""Bearer tokens, TLS / mTLS and limits, against real servers on loopback.

Certificates are made at test time (rsd_service.pki), in a temporary folder (a CA, a server certificate for
127.0.0.1 / localhost, a client certificate, and a stranger's certificate from another CA): no key
is ever committed. The secure cluster is the real verifier and drafter services plus the gateway,
every hop over mTLS with the internal shared secret, the gateway's public API with a bearer token.
The limits tests run the gateway over the stack of tests/fixtures/stack.py (the real drafter behind DrafterTap,
which slows steps).
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from drafter_service.config import DrafterConfig
from drafter_service.server import create_server as create_drafter
from gateway.config import GatewayConfig
from gateway.server import create_server as create_gateway
from gateway.store.memory_store import MemorySessionStore
from rsd_runtime.models import load_model
from rsd_runtime.tokenizer import load_tokenizer
from rsd_service.client import RsdClient
from rsd_service.security import ClientSecurity, ServerSecurity, TokenInterceptor, channel, read_secret
from rsd_service.serving import wait_healthy
from rsd_tools.tiny import build_tiny_pair
from rsd_wire import common_pb2, drafter_pb2, drafter_pb2_grpc, gateway_pb2, verifier_pb2, verifier_pb2_grpc
from tests.fixtures.pki import make_pki
from tests.fixtures.stack import LoopThread, start_stack
from tests.gateway.test_engine import PROMPT, greedy, reference, status_of
from verifier_service.config import VerifierConfig
from verifier_service.server import create_server as create_verifier

INTERNAL = "internal-s3cret"
PUBLIC = "public-t0ken"

# ---------------------------------------------------------------------------------------------
# Throwaway certificates (rsd_service.pki, as `rsd cluster --secure` makes them)


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    draft_dir, target_dir = build_tiny_pair(tmp_path_factory.mktemp("tiny"), "qwen2")
    return load_model(draft_dir), load_model(target_dir), load_tokenizer(target_dir)


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


class SecureCluster:
    """Verifier, drafter and gateway; every internal hop mTLS + INTERNAL; the gateway's public API
    TLS (mTLS when public_mtls) + a bearer token read from a file."""

    def __init__(self, loop: LoopThread, pair, pki: dict[str, str], folder: Path, public_mtls: bool):
        self.loop, self.pki = loop, pki
        draft_model, target_model, tokenizer = pair
        (folder / "token").write_text(PUBLIC + "\n")
        server_tls = {"tls_cert": pki["server"], "tls_key": pki["server_key"]}
        peer_tls = {"peer_tls_ca": pki["ca"], "peer_tls_cert": pki["client"], "peer_tls_key": pki["client_key"]}
        internal = {**server_tls, "tls_ca": pki["ca"], "internal_token": INTERNAL}

        async def start():
            self.verifier = await create_verifier(VerifierConfig(verifier_id="v0", **internal), target_model)
            self.drafter = await create_drafter(DrafterConfig(drafter_id="d0", **internal, **peer_tls), draft_model)
            cfg = GatewayConfig(
                port=0,
                drafters=f"d0={self.drafter[2].address}",
                verifiers=f"v0={self.verifier[2].address}",
                auth_token_file=str(folder / "token"),
                internal_token=INTERNAL,
                **server_tls,
                **({"tls_ca": pki["ca"]} if public_mtls else {}),
                **peer_tls,
            )
            self.gateway = await create_gateway(cfg, store=MemorySessionStore(), tokenizer=tokenizer)
            self.address = f"127.0.0.1:{self.gateway[1]}"

        loop.run(start(), timeout_s=120)

    def client(self, token: str = PUBLIC, cert: bool = True, tls: bool = True) -> RsdClient:
        p = self.pki
        security = ClientSecurity(
            p["ca"] if tls else "", p["client"] if cert else "", p["client_key"] if cert else "", token
        )
        return RsdClient(self.address, timeout_s=60, security=security)

    def internal(self, token: str = INTERNAL) -> ClientSecurity:
        return ClientSecurity(self.pki["ca"], self.pki["client"], self.pki["client_key"], token)

    def close(self) -> None:
        async def stop():
            server, _, handle = self.gateway
            await handle.close(server, 0)
            for server, _, handle in (self.drafter, self.verifier):
                await handle.close(server, 0)

        self.loop.run(stop())


@pytest.fixture(scope="module")
def mtls(loop, pair, pki, tmp_path_factory):
    cluster = SecureCluster(loop, pair, pki, tmp_path_factory.mktemp("mtls"), public_mtls=True)
    yield cluster
    cluster.close()


def _generate(client: RsdClient, **kwargs):
    return client.generate(PROMPT, method="rsd_c", shape="2,2,1", max_new_tokens=12, **greedy(), **kwargs).wait()


# ---------------------------------------------------------------------------------------------
# Pieces


def test_token_check_and_its_reasons():
    check = TokenInterceptor("s3cret").check
    assert check([("authorization", "Bearer s3cret")]) == ""
    assert check([("authorization", "bearer s3cret")]) == ""  # the scheme is case-insensitive (RFC 7235)
    assert "missing" in check([]) and "missing" in check(None)
    assert "Bearer" in check([("authorization", "s3cret")])
    assert check([("authorization", "Bearer nope")]) == "invalid token"
    assert check([("authorization", "Bearer s3cre")]) == "invalid token"


def test_secrets_and_settings_are_checked(tmp_path):
    (tmp_path / "t").write_text("abc\n")
    assert read_secret("", str(tmp_path / "t"), "auth_token") == "abc"
    assert read_secret("xyz", "", "auth_token") == "xyz" and read_secret("", "", "auth_token") == ""
    (tmp_path / "empty").write_text("\n")
    for value, file, reason in [("a", str(tmp_path / "t"), "not both"), ("", str(tmp_path / "empty"), "empty")]:
        with pytest.raises(ValueError, match=reason):
            read_secret(value, file, "auth_token")
    with pytest.raises(ValueError, match="printable"):
        read_secret("two words", "", "auth_token")
    with pytest.raises(ValueError, match="together"):
        ServerSecurity(tls_cert="a.pem")
    with pytest.raises(ValueError, match="needs tls_cert"):
        ServerSecurity(tls_ca="ca.pem")
    with pytest.raises(ValueError, match="needs tls_ca"):
        ClientSecurity(tls_cert="c.pem", tls_key="c.key")
    # tokens never show in a config's repr (configs get logged)
    shown = repr(GatewayConfig(auth_token="tok-A", internal_token="tok-B")) + repr(
        VerifierConfig(internal_token="tok-C")
    )
    assert not any(t in shown for t in ("tok-A", "tok-B", "tok-C"))
    assert "tok" not in repr(ClientSecurity(token="tok-D")) + repr(ServerSecurity(token="tok-E"))


# ---------------------------------------------------------------------------------------------
# The public API: token and mTLS


def test_generation_over_mtls_with_the_token(mtls, pair):
    with mtls.client() as client:
        gen = _generate(client)
        session = client.get_session(gen.session_id)
    prompt_ids = pair[2].encode(PROMPT, add_special_tokens=False)
    assert gen.token_ids == reference(pair, prompt_ids, "rsd_c", "2,2,1", 12)
    assert session.verifier_id == "v0" and session.committed_length_tokens == len(prompt_ids) + 12


def test_without_or_with_a_wrong_token_is_unauthenticated(mtls):
    for token, reason in [("", "missing"), ("wrong", "invalid token"), (PUBLIC + "x", "invalid token")]:
        with mtls.client(token=token) as client:
            for call in (lambda c=client: _generate(c), lambda c=client: c.get_session("abc")):
                err = status_of(call)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED and reason in err.details(), err.details()
    with mtls.client() as client:  # still serving
        assert _generate(client).finished.num_new_tokens == 12


def test_health_needs_no_token_but_tls(mtls):
    security = ClientSecurity(mtls.pki["ca"], mtls.pki["client"], mtls.pki["client_key"])  # no token
    mtls.loop.run(wait_healthy(mtls.address, "rsd.v1.Gateway", 10, security))
    for address in (mtls.verifier[2].address, mtls.drafter[2].address):
        mtls.loop.run(wait_healthy(address, "", 10, security))
    with pytest.raises(TimeoutError):  # plaintext to a TLS port never gets an answer
        mtls.loop.run(wait_healthy(mtls.address, "", 1.0))


def test_mtls_refuses_clients_without_a_trusted_certificate(mtls):
    for kwargs in ({"cert": False}, {"tls": False, "cert": False}):
        with mtls.client(**kwargs) as client:
            err = status_of(lambda c=client: c.get_session("abc"))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, kwargs
    p = mtls.pki
    stranger = ClientSecurity(p["ca"], p["stranger"], p["stranger_key"], PUBLIC)
    with RsdClient(mtls.address, timeout_s=10, security=stranger) as client:
        assert status_of(lambda: client.get_session("abc")).code() == grpc.StatusCode.UNAVAILABLE


def test_generation_over_tls_without_client_certificates(loop, pair, pki, tmp_path):
    cluster = SecureCluster(loop, pair, pki, tmp_path, public_mtls=False)
    try:
        with cluster.client(cert=False) as client:
            assert _generate(client).finished.num_new_tokens == 12
        with cluster.client(tls=False, cert=False) as client:
            assert status_of(lambda: client.get_session("abc")).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.close()


# ---------------------------------------------------------------------------------------------
# Internal hops: the shared secret


def test_internal_calls_need_the_shared_secret(mtls):
    attach = verifier_pb2.AttachRequest(
        session_id="s1",
        epoch=1,
        committed_token_ids=[2, 10, 11],
        params=common_pb2.GenerationParams(method=common_pb2.Method(name="sd", shape="2")),
    )
    run = drafter_pb2.RunRequest(
        session_id="s1", epoch=1, committed_token_ids=[2, 10], max_new_tokens=2, verifier_address="127.0.0.1:1"
    )

    async def calls(token: str) -> list[grpc.StatusCode]:
        codes = []
        async with channel(mtls.verifier[2].address, mtls.internal(token)) as ch:
            try:
                await verifier_pb2_grpc.VerifierStub(ch).Attach(attach, timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as e:
                codes.append(e.code())
        async with channel(mtls.drafter[2].address, mtls.internal(token)) as ch:
            try:
                async for _ in drafter_pb2_grpc.DrafterStub(ch).Run(run, timeout=10):
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as e:
                codes.append(e.code())
        return codes

    assert mtls.loop.run(calls("")) == [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert mtls.loop.run(calls("not-it")) == [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert mtls.loop.run(calls(PUBLIC)) == [grpc.StatusCode.UNAUTHENTICATED] * 2  # the public token is not it
    # with the secret the calls get through to the servicers (which judge the requests themselves)
    assert grpc.StatusCode.UNAUTHENTICATED not in mtls.loop.run(calls(INTERNAL))


def test_a_gateway_with_the_wrong_secret_gets_nothing_through(loop, pair, pki, tmp_path):
    draft_model, target_model, tokenizer = pair
    tls = {"tls_cert": pki["server"], "tls_key": pki["server_key"]}

    async def start():
        verifier = await create_verifier(VerifierConfig(**tls, internal_token=INTERNAL), target_model)
        drafter = await create_drafter(
            DrafterConfig(**tls, internal_token=INTERNAL, peer_tls_ca=pki["ca"]), draft_model
        )
        cfg = GatewayConfig(
            port=0,
            drafters=f"d0={drafter[2].address}",
            verifiers=f"v0={verifier[2].address}",
            peer_tls_ca=pki["ca"],
            internal_token="not-the-secret",
            max_failovers=0,
        )
        gateway = await create_gateway(cfg, store=MemorySessionStore(), tokenizer=tokenizer)
        return [verifier, drafter, gateway]

    servers = loop.run(start(), timeout_s=60)
    try:
        with RsdClient(f"127.0.0.1:{servers[2][1]}", timeout_s=30) as client:
            err = status_of(lambda: _generate(client))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid token" in err.details()
    finally:

        async def stop():
            for server, _, handle in reversed(servers):
                await handle.close(server, 0)

        loop.run(stop())


# ---------------------------------------------------------------------------------------------
# Limits: RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED with a reason, and the gateway keeps serving


def _wait_idle(stack, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.engine.num_running and time.monotonic() < deadline:
        time.sleep(0.02)


def test_limits_are_resource_exhausted_and_the_gateway_keeps_serving(loop, pair):
    s = start_stack(
        loop,
        pair,
        MemorySessionStore(),
        drafter_kwargs={"step_delay_s": 0.05},
        max_running_turns=1,
        max_message_bytes=4096,
    )
    try:
        with s.client() as client:
            running = client.generate(PROMPT, max_new_tokens=400, **greedy())
            events = iter(running)
            next(events)
            busy = status_of(lambda: client.generate(PROMPT, max_new_tokens=4).wait())
            assert busy.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_running_turns" in busy.details()
            client.cancel(running.session_id)
            list(events)
            _wait_idle(s)
            big = status_of(lambda: client.generate("w5 " * 2000, max_new_tokens=4).wait())  # 6 KB > 4 KB
            assert big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "4096" in big.details()
            assert client.generate(PROMPT, max_new_tokens=4, **greedy()).wait().finished.num_new_tokens == 4
    finally:
        s.stop()


def test_request_timeout_is_deadline_exceeded_and_keeps_the_committed_tokens(loop, pair):
    """The drafter stalls after its first step (on an event, not a race against a sleep), so the turn
    can only end by the deadline, with that step's tokens committed; request_timeout_s only has to
    exceed one tiny-model step."""
    drafter = {"step_delay_s": 0.05, "hold_after_steps": 1}
    s = start_stack(loop, pair, MemorySessionStore(), drafter_kwargs=drafter, request_timeout_s=2.0)
    prompt_ids = pair[2].encode(PROMPT, add_special_tokens=False)
    try:
        with s.client() as client:
            gen = client.generate(PROMPT, max_new_tokens=400, **greedy())
            err = status_of(gen.wait)
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "request_timeout_s" in err.details()
            session = client.get_session(gen.session_id, include_token_ids=True)
            streamed = len(gen.token_ids)
            assert 0 < streamed < 400 and session.committed_length_tokens >= len(prompt_ids) + streamed
            assert list(session.committed_token_ids)[: len(prompt_ids) + streamed] == prompt_ids + gen.token_ids
            assert session.status == gateway_pb2.SESSION_STATUS_FAILED
            _wait_idle(s)
            more = client.generate("w5", session_id=gen.session_id, max_new_tokens=3).wait()  # the session goes on
            assert more.finished.num_new_tokens == 3
    finally:
        s.stop()


def test_cli_generate_with_token_file_and_mtls(mtls, tmp_path, capsys, monkeypatch):
    from rsd_tools import cli

    (tmp_path / "token").write_text(PUBLIC)
    p = mtls.pki
    argv = ["generate", "--server", mtls.address, "--prompt", "w7 w8", "--max-new-tokens", "5", "--tls-ca", p["ca"]]
    argv += ["--tls-cert", p["client"], "--tls-key", p["client_key"]]
    assert cli.main([*argv, "--token-file", str(tmp_path / "token")]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("w7 w8") and "5 tokens" in captured.err
    monkeypatch.setenv("RSD_TOKEN", "wrong")
    assert cli.main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err

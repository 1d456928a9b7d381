"""The launcher (rsd cluster): the whole tiny cluster as real processes on loopback, one generation
through the gateway, then a clean stop; the secured cluster (--secure); a cluster of two verifiers
that survives a `kill -9` (--keep-running). Process start-up (Python processes importing torch on a
small machine) is most of the time, so each cluster is started once."""

from __future__ import annotations

import io
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from rsd_runtime import quant_q8
from rsd_service.client import RsdClient
from rsd_service.security import ClientSecurity, channel
from rsd_tools import cli
from rsd_tools.cluster import (
    build_parser,
    cluster_security,
    compare_target_alone,
    run_generation,
    serving_numeric,
    start_cluster,
    target_alone_command,
)
from rsd_tools.launcher import ClusterSecurity
from rsd_wire import common_pb2, verifier_pb2, verifier_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cluster")
    models = tmp_path_factory.mktemp("models")
    argv = ["--tiny", "--cache-dir", str(models), "--run-dir", str(run_dir), "--max-new-tokens", "12"]
    args = build_parser().parse_args([*argv, "--start-timeout-s", "120", "--threads", "1"])
    started = start_cluster(args)
    processes = list(started.processes)
    yield started, args
    started.stop()
    for p in processes:  # every process stopped on SIGTERM by itself, cleanly
        assert p.proc.returncode == 0, f"{p.name} exited with {p.proc.returncode}:\n{p.log_tail()}"


def test_cluster_runs_every_service_as_a_process(cluster):
    started, _ = cluster
    names = [p.name for p in started.processes]
    expected = ["verifier-0", "drafter-0", "gateway-0"]
    assert names == (["redis", *expected] if shutil.which("redis-server") else expected)
    assert all(p.proc.poll() is None for p in started.processes)
    assert all((started.run_dir / f"{name}.log").is_file() for name in names)
    for p in started.processes:  # both model services get the launcher's dtype (default float32)
        if p.name.startswith(("verifier", "drafter")):
            assert p.proc.args[p.proc.args.index("--dtype") + 1] == "float32"
        if p.name.startswith("drafter"):  # and the drafter the fastest of its quantize settings
            assert p.proc.args[p.proc.args.index("--quantize") + 1] == "auto"
        assert "--numeric" not in p.proc.args  # numeric auto: exact for a pair that is not GGUF


def test_numeric_auto_serves_a_gguf_pair_on_int8_activations_where_the_cpu_runs_them(tmp_path):
    """--numeric auto (the default, what scripts/run.sh starts): q8_activations for a GGUF pair where this CPU runs
    its kernel in float32, exact for anything else; an explicit choice is kept."""
    from rsd_tools.tiny import build_tiny_gguf_pair, build_tiny_pair

    gguf, hf = build_tiny_gguf_pair(tmp_path), build_tiny_pair(tmp_path)
    runs = quant_q8.unavailable_reason() == ""
    assert serving_numeric("auto", *gguf) == ("q8_activations" if runs else "exact")
    assert serving_numeric("auto", *gguf, dtype="bfloat16") == "exact"
    assert serving_numeric("auto", gguf[0], hf[1]) == serving_numeric("auto", *hf) == "exact"
    assert serving_numeric("exact", *gguf) == "exact"
    assert build_parser().parse_args([]).numeric == "auto"


def test_generation_through_the_gateway(cluster, capsys):
    started, args = cluster
    out = io.StringIO()
    text = run_generation(started.gateway_address, args, out)
    assert text.strip() and out.getvalue().startswith("w2 w10") and out.getvalue().rstrip().endswith(text.strip())
    assert "block efficiency" in capsys.readouterr().err
    with RsdClient(started.gateway_address) as client:
        gen = client.generate("w5 w6", temperature=0.0, max_new_tokens=6).wait()
        session = client.get_session(gen.session_id)
    assert len(gen.token_ids) == 6 and session.committed_length_tokens == 8
    assert session.verifier_id == "verifier-0" and session.drafter_id == "drafter-0"
    assert [line.split()[0] for line in started.describe()] == [p.name for p in started.processes]
    assert all(f"pid {p.proc.pid}" in line for p, line in zip(started.processes, started.describe(), strict=True))


def test_compare_target_alone_runs_the_same_generation_without_speculation(cluster, capsys):
    """--compare-target-alone (scripts/run.sh sets it): the cluster's prompt and settings through `rsd generate
    --method ar`, its tokens/s printed beside the speculative rate."""
    _, args = cluster
    cmd = target_alone_command(args, "exact")
    assert cmd[cmd.index("--method") + 1] == "ar" and "--tiny" in cmd and cmd[cmd.index("--seed") + 1] == "0"
    alone = compare_target_alone(args, "exact", 1.0)
    assert alone is not None and alone > 0
    assert f"= {1.0 / alone:.2f}x the target alone" in capsys.readouterr().err


def test_cli_generate_with_server(cluster, capsys):
    started, _ = cluster
    argv = ["generate", "--server", started.gateway_address, "--prompt", "w7 w8", "--max-new-tokens", "5"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("w7 w8") and len(captured.out.split()) == 2 + 5
    assert "5 tokens" in captured.err
    bad = ["generate", "--server", started.gateway_address, "--prompt", "w7", "--method", "sd", "--shape", "x"]
    assert cli.main(bad) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    chosen = ["generate", "--server", started.gateway_address, "--prompt", "w7", "--max-new-tokens", "4"]
    chosen += ["--method", "sd", "--shape", "3", "--temperature", "1", "--verification", "block"]
    assert cli.main(chosen) == 0
    assert "verification=block rule=block" in capsys.readouterr().err  # the verifier's stats name the rule
    assert cli.main([*chosen[:-7], "rsd_c", "--shape", "2,1", "--temperature", "1", "--verification", "block"]) == 1
    assert "INVALID_ARGUMENT: params.verification" in capsys.readouterr().err


def test_openai_api_of_the_cluster(cluster):
    import openai

    started, _ = cluster
    assert started.http_url.startswith("http://127.0.0.1:") and started.http_url.endswith("/v1")
    client = openai.OpenAI(base_url=started.http_url, api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["rsd-tiny"]
    messages = [{"role": "user", "content": "w5 w6"}]
    out = client.chat.completions.create(model="rsd-tiny", messages=messages, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and 1 <= out.usage.completion_tokens <= 5


# ---------------------------------------------------------------------------------------------
# Settings checked before anything starts


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--verifiers", "0"], "--verifiers must be at least 1"),
        (["--gateways", "2", "--no-redis"], "needs redis-server"),
        (["--tls-cert", "s.pem", "--tls-key", "s.key"], "needs --tls-ca"),
        (["--public-mtls"], "--public-mtls needs --tls-client-cert"),
    ],
)
def test_sizes_and_security_settings_are_checked(tmp_path, flags, reason):
    args = build_parser().parse_args(["--tiny", "--cache-dir", str(tmp_path / "m"), "--run-dir", str(tmp_path), *flags])
    with pytest.raises(ValueError, match=reason):
        start_cluster(args)


def test_secure_makes_what_the_flags_leave_out(tmp_path):
    (tmp_path / "token").write_text("mine\n")
    argv = ["--secure", "--public-mtls", "--auth-token-file", str(tmp_path / "token")]
    sec = cluster_security(build_parser().parse_args(argv), tmp_path)
    made = tmp_path / "secure"
    assert sec.auth_token_file == str(tmp_path / "token") and sec.client().token == "mine"
    assert sec.internal_token_file == str(made / "internal_token") and sec.tls_ca == str(made / "ca.pem")
    assert sec.public_mtls and sec.client().tls_cert == sec.client_cert == str(made / "client.pem")
    assert made.stat().st_mode & 0o777 == 0o700


def test_security_flags_of_each_service():
    sec = ClusterSecurity("/s.pem", "/s.key", "/ca.pem", "/c.pem", "/c.key", False, "/token", "/internal")
    verifier, drafter, gateway = (sec.service_flags(role) for role in ("verifier", "drafter", "gateway"))
    assert verifier == [
        *("--tls-cert", "/s.pem", "--tls-key", "/s.key", "--tls-ca", "/ca.pem"),  # mTLS: client certificates required
        *("--internal-token-file", "/internal"),
    ]
    dialing = ["--peer-tls-ca", "/ca.pem", "--peer-tls-cert", "/c.pem", "--peer-tls-key", "/c.key"]
    assert drafter == [*verifier[:6], *dialing, "--internal-token-file", "/internal"]
    assert gateway == [*verifier[:4], *dialing, "--internal-token-file", "/internal", "--auth-token-file", "/token"]
    public_mtls = ClusterSecurity(**{**sec.__dict__, "public_mtls": True})
    assert public_mtls.service_flags("gateway")[:6] == verifier[:6]
    assert public_mtls.probe("gateway") == ClientSecurity("/ca.pem", "/c.pem", "/c.key")
    assert sec.probe("gateway") == ClientSecurity("/ca.pem") and sec.probe("verifier") == public_mtls.probe("drafter")
    tokens_only = ClusterSecurity(auth_token_file="/token")
    assert tokens_only.service_flags("verifier") == [] and tokens_only.probe("gateway") is None
    assert tokens_only.service_flags("gateway") == ["--auth-token-file", "/token"]


# ---------------------------------------------------------------------------------------------
# --secure: throwaway CA and tokens, every hop checked


def test_secure_cluster_in_one_command(tmp_path, capsys):
    argv = ["--tiny", "--secure", "--cache-dir", str(tmp_path / "models"), "--run-dir", str(tmp_path / "run")]
    args = build_parser().parse_args([*argv, "--max-new-tokens", "6", "--start-timeout-s", "120"])
    started = start_cluster(args)
    sec = started.security
    try:
        text = run_generation(started.gateway_address, args, io.StringIO(), security=started.client_security())
        assert text.strip()
        assert sec.summary() == "public token, internal token, TLS, mTLS between services"
        token = Path(sec.auth_token_file).read_text().strip()
        internal = Path(sec.internal_token_file).read_text().strip()
        for path in (sec.auth_token_file, sec.internal_token_file, sec.tls_key, sec.client_key):
            assert os.stat(path).st_mode & 0o777 == 0o600
        for p in started.processes:  # tokens travel as files, never on a command line (`ps` shows those)
            assert token not in " ".join(p.proc.args) and internal not in " ".join(p.proc.args)
        no_token = ClientSecurity(tls_ca=sec.tls_ca)
        assert _generate_code(started.gateway_address, no_token) == grpc.StatusCode.UNAUTHENTICATED
        plaintext = ClientSecurity(token=token)
        assert _generate_code(started.gateway_address, plaintext) == grpc.StatusCode.UNAVAILABLE
        verifier = next(p for p in started.processes if p.name == "verifier-0")
        assert _release_code(verifier.address, ClientSecurity(sec.tls_ca, sec.client_cert, sec.client_key, internal))
        assert _release_code(verifier.address, ClientSecurity(sec.tls_ca, sec.client_cert, sec.client_key)) == (
            grpc.StatusCode.UNAUTHENTICATED  # mTLS passed, the internal token missing
        )
        assert _release_code(verifier.address, ClientSecurity(sec.tls_ca, token=internal)) == (
            grpc.StatusCode.UNAVAILABLE  # no client certificate: the handshake fails
        )
        # what `rsd cluster` prints for a client works as printed
        command = sec.how_to_connect(started.gateway_address)[0].split()
        assert command[:4] == ["rsd", "generate", "--server", started.gateway_address]
        assert cli.main([*command[1 : command.index("--prompt")], "--prompt", "w7 w8", "--max-new-tokens", "3"]) == 0
        assert capsys.readouterr().out.startswith("w7 w8")
        # and so does its openai client of the HTTP API (base URL, token file, CA)
        assert started.http_url.startswith("https://")
        snippet = sec.openai_snippet(started.http_url)
        assert sec.how_to_connect(started.gateway_address, started.http_url)[-1].strip() == snippet
        scope: dict = {}
        exec(snippet, scope)
        assert [m.id for m in scope["client"].models.list().data] == ["rsd-tiny"]
    finally:
        started.stop()


def _generate_code(address: str, security: ClientSecurity) -> grpc.StatusCode:
    with RsdClient(address, security=security) as client, pytest.raises(grpc.RpcError) as info:
        client.generate("w2 w3", max_new_tokens=2).wait()
    return info.value.code()


def _release_code(address: str, security: ClientSecurity) -> grpc.StatusCode | bool:
    """Verifier.Release of an unknown session: True when answered, else the status code."""
    import asyncio

    async def call():
        async with channel(address, security) as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            await stub.Release(verifier_pb2.ReleaseRequest(session_id="nobody", epoch=1), timeout=30)

    try:
        asyncio.run(call())
    except grpc.aio.AioRpcError as e:
        return e.code()
    return True


# ---------------------------------------------------------------------------------------------
# --verifiers 2 --keep-running: kill -9 a verifier; the rest serve, the launcher restarts it

_LISTED = re.compile(r"^  (\S+)\s+(\S+)\s+pid (\d+)$")
_RESTARTED = re.compile(r"^\[cluster\] (\S+) restarted: pid (\d+) at (\S+)")


class Lines:
    """The launcher's stderr, line by line, read in a thread; until() waits for a matching line (or fails)."""

    def __init__(self, stream):
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # EOF

    def until(self, pattern: str, timeout_s: float = 300.0) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r}; output so far:\n" + "\n".join(self.seen)) from None
            assert line is not None, f"output ended before {pattern!r}:\n" + "\n".join(self.seen)
            self.seen.append(line)
            if re.search(pattern, line):
                return line


def _ended(gen) -> bool:
    """A turn that generated and ended normally (a re-prefill after a failover may round a near-tie of the
    random tiny target differently, so the exact tokens, and whether EOS comes early, are not checked)."""
    reasons = (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS)
    return bool(gen.token_ids) and gen.finished is not None and gen.finished.reason in reasons


def test_keep_running_restarts_a_killed_verifier(tmp_path):
    argv = ["--tiny", "--cache-dir", str(tmp_path / "models"), "--run-dir", str(tmp_path / "run"), "--threads", "1"]
    argv += ["--verifiers", "2", "--keep-running", "--max-restarts", "1", "--no-generate", "--start-timeout-s", "240"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rsd_tools.cluster", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    out = Lines(launcher.stderr)
    pids: dict[str, int] = {}
    try:
        out.until(r"^\[cluster\] up in")
        while len(pids) < 5:  # redis, verifier-0, verifier-1, drafter-0, gateway-0
            name, address, pid = _LISTED.match(out.until(r"^  \S+ .* pid \d+$")).groups()
            pids[name] = int(pid)
            if name == "gateway-0":
                gateway = address
        assert sorted(pids) == ["drafter-0", "gateway-0", "redis", "verifier-0", "verifier-1"]
        out.until("Ctrl-C stops the cluster")
        with RsdClient(gateway, timeout_s=120) as client:
            first = client.generate("w2 w10 w11", temperature=0.0, seed=0, max_new_tokens=4).wait()
            victim = client.get_session(first.session_id).verifier_id
            os.kill(pids[victim], signal.SIGKILL)
            line = out.until(rf"^\[cluster\] {victim} \(pid {pids[victim]}\) exited with signal 9")
            # the session continues on a live verifier (failover), the rest of the cluster never stopped
            more = client.generate("w5 w6", session_id=first.session_id, temperature=0.0, max_new_tokens=4).wait()
            assert _ended(more) and more.started.start_position == len(first.token_ids) + 3 + 2
            name, new_pid, _ = _RESTARTED.match(out.until(rf"^\[cluster\] {victim} restarted")).groups()
            assert name == victim and int(new_pid) != pids[victim]
            os.kill(int(new_pid), 0)  # alive
            again = client.generate("w7 w8", temperature=0.0, max_new_tokens=4).wait()
            assert _ended(again)
            os.kill(int(new_pid), signal.SIGKILL)  # past --max-restarts 1: it stays down, the rest serve on
            out.until(rf"^\[cluster\] {victim} stays down \(--max-restarts 1\)")
            last = client.generate("w9", session_id=again.session_id, max_new_tokens=4).wait()
            assert _ended(last)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(120) == 0
        out.until(r"^\[cluster\] stopped in")
        for pid in [*pids.values(), int(new_pid)]:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert line
    finally:
        print("launcher output:", *out.seen, sep="\n")  # shown when the test fails
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(60)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()


@pytest.mark.parametrize(
    "flags, on",
    [
        ([], False),  # drafter and verifier share the machine's cores: pre-drafting would slow verification
        (["--drafter-cores", "0", "--verifier-cores", "1"], True),
        (["--drafter-cores", "0-1", "--verifier-cores", "1"], False),
        (["--predraft", "on"], True),
        (["--drafter-cores", "0", "--verifier-cores", "1", "--predraft", "off"], False),
    ],
)
def test_predraft_follows_placement(flags, on):
    from rsd_tools.cluster import predraft_on

    assert predraft_on(build_parser().parse_args(flags)) is on


def test_model_services_default_to_all_cores_and_the_fastest_drafter():
    """No --threads: each model service takes one torch thread per core it may use (the service's own
    default), so unpinned services take turns on every core; the drafter's quantize is auto (int8 where
    the VNNI kernel takes a drafter too large for the cache)."""
    args = build_parser().parse_args([])
    assert (args.threads, args.draft_quantize) == (0, "auto")

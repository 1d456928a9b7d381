"""The launcher (rsd cluster): the whole tiny cluster as real processes on loopback, one generation
through the gateway, then a clean stop. One cluster for the whole file: process start-up (three
Python processes importing torch on a small machine) is most of its time."""

from __future__ import annotations

import io
import shutil

import pytest

from rsd_runtime import cli
from rsd_runtime.client import RsdClient
from rsd_runtime.cluster import build_parser, run_generation, start_cluster


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
    expected = ["verifier", "drafter", "gateway"]
    assert names == (["redis", *expected] if shutil.which("redis-server") else expected)
    assert all(p.proc.poll() is None for p in started.processes)
    assert all((started.run_dir / f"{name}.log").is_file() for name in names)
    for p in started.processes:  # both model services get the launcher's dtype (default float32)
        if p.name in ("verifier", "drafter"):
            assert p.proc.args[p.proc.args.index("--dtype") + 1] == "float32"


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


def test_openai_api_of_the_cluster(cluster):
    import openai

    started, _ = cluster
    assert started.http_url.startswith("http://127.0.0.1:") and started.http_url.endswith("/v1")
    client = openai.OpenAI(base_url=started.http_url, api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["rsd-tiny"]
    messages = [{"role": "user", "content": "w5 w6"}]
    out = client.chat.completions.create(model="rsd-tiny", messages=messages, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and 1 <= out.usage.completion_tokens <= 5

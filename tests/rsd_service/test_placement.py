"""Placement (rsd_service.placement): core lists are validated at the edge, and a started service
process (verifier, drafter, gateway) really runs on the cores it was given (every thread:
/proc/PID/task/*/status), a model service with one torch thread per core unless told otherwise."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from drafter_service.config import DrafterConfig
from gateway.config import GatewayConfig
from rsd_service.placement import format_cores, parse_cores
from rsd_service.serving import load_config, wait_healthy
from rsd_tools.tiny import build_tiny_pair
from verifier_service.config import VerifierConfig

REPO = Path(__file__).resolve().parents[2]
CORE = str(max(os.sched_getaffinity(0)))  # a core this machine lets us use (the last one)


@pytest.mark.parametrize(
    ("text", "cores"),
    [("", ()), ("0", (0,)), ("0-1,3", (0, 1, 3)), (" 3, 1-2 ", (1, 2, 3)), ("2,2,0-2", (0, 1, 2)), ("5-5", (5,))],
)
def test_parse_cores(text, cores):
    assert parse_cores(text) == cores
    assert parse_cores(format_cores(cores)) == cores


@pytest.mark.parametrize(
    ("text", "reason"),
    [("0,", "empty item"), (",1", "empty item"), ("a", "cannot read"), ("-1", "cannot read"), ("1-", "cannot read"),
     ("3-1", "backwards"), ("0-1-2", "cannot read"), ("1.5", "cannot read")],
)  # fmt: skip
def test_bad_core_lists_are_refused_with_the_reason(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_cores(text)
    for config in (DrafterConfig, VerifierConfig, GatewayConfig):
        with pytest.raises(ValueError, match=f"invalid {config.__name__}: cores .*{reason}"):
            config(cores=text)


def test_gateway_reads_its_cores_like_the_model_services():
    """The gateway's cores: a ServiceConfig field, so RSD_GATEWAY_CORES and --cores (the flag wins)."""
    env = {"RSD_GATEWAY_CORES": "1"}
    assert load_config(GatewayConfig, "gateway", [], env=env).cores == "1"
    assert load_config(GatewayConfig, "gateway", ["--cores", "0-1,3"], env=env).cores == "0-1,3"
    assert GatewayConfig().cores == ""  # any core
    with pytest.raises(ValueError, match="invalid GatewayConfig: cores '0,': empty item"):
        load_config(GatewayConfig, "gateway", [], env={"RSD_GATEWAY_CORES": "0,"})


def test_format_cores():
    assert format_cores([3, 0, 1, 2, 7, 9, 10]) == "0-3,7,9-10"
    assert format_cores(()) == ""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def test_apply_placement_pins_every_thread_and_sizes_torch():
    """In a fresh process with threads already running: all of them move, torch gets one thread per core."""
    code = (
        "import os, threading, time\n"
        "t = threading.Thread(target=time.sleep, args=(30,), daemon=True); t.start()\n"
        "from rsd_service.placement import apply_placement\n"
        f"p = apply_placement({CORE!r})\n"
        "import torch\n"
        "masks = {open(f'/proc/self/task/{tid}/status').read().split('Cpus_allowed_list:')[1].split()[0]"
        " for tid in os.listdir('/proc/self/task')}\n"
        "n = len(os.listdir('/proc/self/task'))\n"
        "print(p.cores, p.threads, p.pinned, torch.get_num_threads(), sorted(masks), n)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cores, threads, pinned, torch_threads, masks, num_threads = out.stdout.split(maxsplit=5)
    assert (cores, threads, pinned, torch_threads) == (CORE, "1", "True", "1")
    assert masks == f"['{CORE}']" and int(num_threads.split()[-1]) >= 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpus_allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of a process."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended
            continue
        out.add(status.split("Cpus_allowed_list:")[1].split()[0])
    return out


@pytest.mark.parametrize("service", ["verifier_service", "drafter_service", "gateway"])
def test_started_service_runs_on_its_cores(tmp_path, service):
    """python -m <service> --cores C: once healthy, every thread of the process is allowed core C only;
    the drafter also starts with an int8 model (--quantize int8) and logs what it applied."""
    draft_dir, target_dir = build_tiny_pair(tmp_path, "qwen2")
    port = _free_port()
    args = {
        "verifier_service": ["--model", str(target_dir)],
        "drafter_service": ["--model", str(draft_dir), "--quantize", "int8"],
        "gateway": ["--tokenizer", str(target_dir)],  # no drafter or verifier needed to be healthy
    }[service]
    log = (tmp_path / "log").open("w")
    cmd = [sys.executable, "-m", service, "--port", str(port), "--cores", CORE, *args]
    proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(wait_healthy(f"127.0.0.1:{port}", timeout_s=120))
        assert _cpus_allowed(proc.pid) == {CORE}
        text = (tmp_path / "log").read_text()
        assert f"cores {CORE}" + ("" if service == "gateway" else ", 1 threads") in text
        if service == "drafter_service":
            assert "quantize int8" in text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_service_refuses_cores_it_may_not_use(tmp_path):
    """A core this process may not use: the service exits at once with the allowed list, no traceback."""
    _, target_dir = build_tiny_pair(tmp_path, "qwen2")
    missing = str(max(os.sched_getaffinity(0)) + 1)
    # the gateway's tokenizer folder does not exist: the cores are refused before anything loads
    for service, args in (("verifier_service", ["--model", str(target_dir)]), ("gateway", ["--tokenizer", "t"])):
        cmd = [sys.executable, "-m", service, *args, "--cores", missing]
        out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode != 0, service
        assert f"not available to this process (allowed: {format_cores(os.sched_getaffinity(0))})" in out.stderr
        assert "Traceback" not in out.stderr, service
    for service in ("drafter_service", "gateway"):
        cmd = [sys.executable, "-m", service, "--cores", "1-0"]
        bad = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and "runs backwards" in bad.stderr and "Traceback" not in bad.stderr, service

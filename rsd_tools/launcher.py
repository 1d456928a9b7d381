"""The process launcher: services as plain processes on loopback, each `python -m <service>` with its
log in a run directory. Used by `rsd cluster` (rsd_tools.cluster), the service benchmark
(rsd_bench.services) and the fault tests (tests/e2e/test_faults.py).

    cluster = Cluster(run_dir)
    env = service_env()
    verifier = cluster.spawn("verifier-0", verifier_command(port, target_dir, "verifier-0"), env, f"127.0.0.1:{port}")
    wait_all_ready([verifier], timeout_s=120)
    ...
    cluster.stop()

One function per role builds a service's command line (verifier_command, drafter_command,
gateway_command, redis_command; `cores=` puts a service on CPU cores); ClusterSecurity adds the
security flags of a role and says how the launcher reaches a secured service. model_dirs resolves the
(draft, target) folders every tool asks for.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis

from rsd_service.security import ClientSecurity, read_secret
from rsd_service.serving import wait_healthy

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Models


def model_dirs(
    draft: str | Path | None,
    target: str | Path | None,
    cache_dir: str | Path | None = None,
    tiny: bool = False,
    **tiny_shape: int,
) -> tuple[Path, Path]:
    """The (draft, target) model folders: both given -> those (each a checkpoint folder or a GGUF file or folder:
    rsd_runtime.models.load_model); neither ->
    the tiny Qwen2 pair built under <cache>/tiny (tiny_shape: build_tiny_pair's vocab_size, hidden_size,
    num_layers, draft_layers) when `tiny`, else the real pair provisioned into the cache. The cache is
    cache_dir or rsd_tools.provision.default_cache_dir(). Exits with a message on a misuse."""
    if draft and target:
        from rsd_runtime.gguf_model import gguf_file

        dirs = Path(draft), Path(target)
        for flag, path in zip(("--draft", "--target"), dirs, strict=True):
            if not (path / "config.json").is_file() and gguf_file(path) is None:
                raise SystemExit(f"error: {flag} {path} is not a model folder (no config.json or GGUF file)")
        return dirs
    if draft or target:
        raise SystemExit("error: give both --draft and --target, or neither")
    from rsd_tools.provision import default_cache_dir

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if tiny:
        from rsd_tools.tiny import build_tiny_pair

        return build_tiny_pair(cache / "tiny", "qwen2", **tiny_shape)
    from rsd_tools.provision import provision_pair

    paths = provision_pair(cache)
    return paths["draft"], paths["target"]


# ---------------------------------------------------------------------------------------------
# Command lines, one function per role


def service_env() -> dict[str, str]:
    """The environment of every service process: this one's, offline, unbuffered, this checkout importable."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    return env


def _python_module(module: str, port: int, flags: list[str], cores: str) -> list[str]:
    placement = ["--cores", cores] if cores else []  # "" = any core: the service's default, no flag
    return [sys.executable, "-m", module, "--port", str(port), *placement, *flags]


def verifier_command(port: int, model: str | Path, verifier_id: str, *flags: str, cores: str = "") -> list[str]:
    """`python -m verifier_service` serving `model` on `port`, registered as verifier_id, on `cores`."""
    args = ["--model", str(model), *flags, "--verifier-id", verifier_id]
    return _python_module("verifier_service", port, args, cores)


def drafter_command(port: int, model: str | Path, drafter_id: str, *flags: str, cores: str = "") -> list[str]:
    """`python -m drafter_service` serving `model` on `port`, registered as drafter_id, on `cores`."""
    args = ["--model", str(model), *flags, "--drafter-id", drafter_id]
    return _python_module("drafter_service", port, args, cores)


def gateway_command(port: int, tokenizer: str | Path, *flags: str, cores: str = "") -> list[str]:
    """`python -m gateway` on `port` with the target's tokenizer, on `cores`."""
    return _python_module("gateway", port, ["--tokenizer", str(tokenizer), *flags], cores)


def redis_command(redis_server: str, port: int, run_dir: Path) -> list[str]:
    """redis-server on loopback, no persistence (its working folder: run_dir)."""
    cmd = [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(run_dir)]
    return [*cmd, "--save", "", "--appendonly", "no", "--daemonize", "no"]


# ---------------------------------------------------------------------------------------------
# Security


@dataclass(frozen=True)
class ClusterSecurity:
    """What the launched cluster demands, as absolute file paths ("" = off): every service's server
    certificate (TLS) and the CA that signed it, a client certificate for the internal hops (mTLS),
    client certificates on the public API too (public_mtls), the public and the internal token."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    client_cert: str = ""
    client_key: str = ""
    public_mtls: bool = False
    auth_token_file: str = ""
    internal_token_file: str = ""

    def __post_init__(self) -> None:
        tls, client = bool(self.tls_cert), bool(self.client_cert)
        problems = [
            (tls != bool(self.tls_key), "--tls-cert and --tls-key go together"),
            (tls != bool(self.tls_ca), "--tls-cert needs --tls-ca, the CA that signed it, and the other way round"),
            (client != bool(self.client_key), "--tls-client-cert and --tls-client-key go together"),
            (client and not tls, "--tls-client-cert needs --tls-cert (mTLS is TLS first)"),
            (self.public_mtls and not client, "--public-mtls needs --tls-client-cert (the launcher presents it)"),
        ]
        for found, problem in problems:
            if found:
                raise ValueError(problem)

    @property
    def enabled(self) -> bool:
        return bool(self.tls_cert or self.auth_token_file or self.internal_token_file)

    def summary(self) -> str:
        """What is on, e.g. "public token, internal token, TLS, mTLS between services"."""
        on = {
            "public token": self.auth_token_file,
            "internal token": self.internal_token_file,
            "TLS": self.tls_cert,
            "mTLS between services": self.client_cert,
            "mTLS on the public API": self.public_mtls,
        }
        return ", ".join(name for name, value in on.items() if value)

    def service_flags(self, role: str) -> list[str]:
        """The security flags of a "verifier", "drafter" or "gateway"."""
        flags: list[str] = []
        if self.tls_cert:
            flags += ["--tls-cert", self.tls_cert, "--tls-key", self.tls_key]
            if self.public_mtls if role == "gateway" else bool(self.client_cert):
                flags += ["--tls-ca", self.tls_ca]  # require client certificates that CA signed
        if role != "verifier" and self.tls_cert:  # the dialers: drafter -> verifier, gateway -> both
            flags += ["--peer-tls-ca", self.tls_ca]
            if self.client_cert:
                flags += ["--peer-tls-cert", self.client_cert, "--peer-tls-key", self.client_key]
        if self.internal_token_file:
            flags += ["--internal-token-file", self.internal_token_file]
        if role == "gateway" and self.auth_token_file:
            flags += ["--auth-token-file", self.auth_token_file]
        return flags

    def probe(self, role: str) -> ClientSecurity | None:
        """How the launcher reaches a service's health check (TLS, and a client certificate under mTLS)."""
        if not self.tls_cert:
            return None
        mtls = self.public_mtls if role == "gateway" else bool(self.client_cert)
        return ClientSecurity(self.tls_ca, *((self.client_cert, self.client_key) if mtls else ("", "")))

    def client(self) -> ClientSecurity:
        """How a client of the public API connects."""
        probe = self.probe("gateway") or ClientSecurity()
        token = read_secret("", self.auth_token_file, "auth_token")
        return replace(probe, token=token)

    def how_to_connect(self, address: str, http_url: str = "") -> list[str]:
        """How a client connects, ready to paste: `rsd generate`, RsdClient over gRPC on `address`, and (given the
        HTTP API's `http_url`) the openai client with the token file and the CA (and client certificate)."""
        flags = f" --tls-ca {self.tls_ca}" if self.tls_cert else ""
        if self.public_mtls:
            flags += f" --tls-cert {self.client_cert} --tls-key {self.client_key}"
        if self.auth_token_file:
            flags += f" --token-file {self.auth_token_file}"
        kwargs = [f"tls_ca={self.tls_ca!r}"] if self.tls_cert else []
        if self.public_mtls:
            kwargs += [f"tls_cert={self.client_cert!r}", f"tls_key={self.client_key!r}"]
        if self.auth_token_file:
            kwargs += [f"token=open({self.auth_token_file!r}).read().strip()"]
        lines = [
            f"  rsd generate --server {address}{flags} --prompt '...'",
            f"  RsdClient({address!r}, security=ClientSecurity({', '.join(kwargs)}))",
        ]
        if http_url:
            lines.append("  " + self.openai_snippet(http_url))
        return lines

    def openai_snippet(self, http_url: str) -> str:
        """One line of Python that makes an openai.OpenAI client of the HTTP API at `http_url`."""
        key = f"open({self.auth_token_file!r}).read().strip()" if self.auth_token_file else "'none'"
        client = f"openai.OpenAI(base_url={http_url!r}, api_key={key}"
        if not self.tls_cert:
            return f"import openai; client = {client})"
        certificate = f"; tls.load_cert_chain({self.client_cert!r}, {self.client_key!r})" if self.public_mtls else ""
        return (
            f"import openai, ssl; tls = ssl.create_default_context(cafile={self.tls_ca!r}){certificate}; "
            f"client = {client}, http_client=openai.DefaultHttpxClient(verify=tls))"
        )


# ---------------------------------------------------------------------------------------------
# Processes


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    log_path: Path
    address: str = ""  # host:port of a gRPC service (redis: its host:port)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # to restart it as it was started
    probe: ClientSecurity | None = None  # how the launcher reaches its health check
    restarts: int = 0

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _popen(cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> subprocess.Popen:
    with log_path.open("ab") as log_file:
        return subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )


@dataclass
class Cluster:
    run_dir: Path
    processes: list[Process] = field(default_factory=list)
    redis_url: str = ""
    gateway_address: str = ""  # the first gateway's
    http_url: str = ""  # the first gateway's OpenAI-compatible API, http(s)://host:port/v1
    numeric: str = "exact"  # the model services' numeric (rsd cluster: serving_numeric)
    security: ClusterSecurity = field(default_factory=ClusterSecurity)

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], address: str = "") -> Process:
        """Start `cmd` as `name`, its output in <run_dir>/<name>.log (started afresh)."""
        log_path = self.run_dir / f"{name}.log"
        log_path.unlink(missing_ok=True)
        process = Process(name, _popen(cmd, env, log_path, self.run_dir), log_path, address, env)
        self.processes.append(process)
        return process

    def start_redis(self, redis_server: str, env: dict[str, str], timeout_s: float = 10.0) -> Process:
        """redis-server on a free port (sets redis_url); returns once it answers PING."""
        port = free_port()
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        process = self.spawn("redis", redis_command(redis_server, port, self.run_dir), env, f"127.0.0.1:{port}")
        wait_redis(process, self.redis_url, timeout_s)
        return process

    def restart(self, process: Process) -> None:
        """Start a dead process again: the same command (so the same port) and env, its log continued."""
        with process.log_path.open("ab") as log_file:
            log_file.write(f"\n[cluster] restart {process.restarts + 1}\n".encode())
        process.proc = _popen(list(process.proc.args), process.env, process.log_path, self.run_dir)
        process.restarts += 1

    def restart_with(self, process: Process, name: str, cmd: list[str], timeout_s: float = 30.0) -> Process:
        """Stop `process` (SIGTERM, waiting up to timeout_s) and start `cmd` in its place as `name`, on the
        same address (cmd must name the same port), with a log of its own. Wait for it with wait_all_ready."""
        process.proc.terminate()
        process.proc.wait(timeout_s)
        self.processes.remove(process)
        new = self.spawn(name, cmd, process.env, process.address)
        new.probe = process.probe
        return new

    def client_security(self) -> ClientSecurity:
        """How a client connects to the gateways."""
        return self.security.client()

    def is_up(self, process: Process) -> bool:
        """One quick probe: Redis answers PING, a service's health is SERVING."""
        if process.name == "redis":
            return redis_pings(self.redis_url)
        try:
            asyncio.run(wait_healthy(process.address, timeout_s=0.2, security=process.probe))
        except TimeoutError:
            return False
        return True

    def describe(self) -> list[str]:
        """One line per process: name, address, pid."""
        width = max((len(p.name) for p in self.processes), default=0)
        lines = []
        for p in self.processes:
            address = self.redis_url if p.name == "redis" else p.address
            lines.append(f"  {p.name:<{width}}  {address:<28}  pid {p.proc.pid}")
        return lines

    def stop(self, timeout_s: float = 15.0, *, at_once: bool = False) -> None:
        """SIGTERM in reverse start order (gateways first), each waited for up to timeout_s, SIGKILL what
        is left. at_once: SIGTERM to all first, then wait for all within one timeout_s (faster, where no
        process needs another while it drains)."""
        deadline = time.monotonic() + timeout_s
        if at_once:
            for process in self.processes:
                if process.proc.poll() is None:
                    process.proc.terminate()
        for process in reversed(self.processes):
            if process.proc.poll() is not None:
                continue
            if not at_once:
                process.proc.send_signal(signal.SIGTERM)
            try:
                process.proc.wait(max(deadline - time.monotonic(), 0.1) if at_once else timeout_s)
            except subprocess.TimeoutExpired:
                print(f"[cluster] {process.name} ignored SIGTERM; killing it", file=sys.stderr)
                process.proc.kill()
                process.proc.wait()
        self.processes.clear()


# ---------------------------------------------------------------------------------------------
# Waiting


def redis_pings(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def wait_redis(process: Process, url: str, timeout_s: float = 10.0) -> None:
    """Until Redis at url answers PING; RuntimeError (with its log) if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while not redis_pings(url):
        if time.monotonic() > deadline or process.proc.poll() is not None:
            raise RuntimeError(f"redis-server did not start:\n{process.log_tail()}")
        time.sleep(0.05)


async def wait_ready(process: Process, timeout_s: float) -> None:
    """Health SERVING, failing early (with its log) if the process exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.proc.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.proc.returncode}:\n{process.log_tail()}")
        try:
            await wait_healthy(process.address, timeout_s=1.0, security=process.probe)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{process.name} not healthy after {timeout_s} s:\n{process.log_tail()}") from None


def wait_all_ready(processes: list[Process], timeout_s: float) -> None:
    """wait_ready for every process at once."""

    async def all_ready() -> None:
        await asyncio.gather(*(wait_ready(p, timeout_s) for p in processes))

    asyncio.run(all_ready())

"""Start the whole cluster as plain processes on loopback (no Docker), run one generation, stop.

    rsd cluster --tiny                       # tiny random pair: seconds
    rsd cluster --keep-running               # the real Qwen2.5-Coder pair; Ctrl-C stops it
    python scripts/cluster.py --tiny --prompt "w2 w10 w11"

Processes, each `python -m <service>` with its log in the run directory:
    redis-server   on a free port, no persistence   (only when `redis-server` is on PATH)
    verifier       the target model                 (--verifier-id verifier-0)
    drafter        the draft model                  (--drafter-id drafter-0)
    gateway        the target's tokenizer           (the public API: gRPC, and OpenAI-compatible HTTP)
With Redis the services register themselves and the gateway finds them in the registry; without
it the gateway keeps sessions in its embedded store and is given the services' addresses.
Stop: SIGTERM in reverse start order, then SIGKILL after --stop-timeout-s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from rsd_runtime import DTYPE_NAMES
from rsd_runtime.serving import wait_healthy

TINY_PROMPT = "w2 w10 w11 w12 w13"
CODE_PROMPT = "# Return the n-th Fibonacci number\ndef fibonacci(n):"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    log_path: Path
    address: str = ""  # host:port of a gRPC service

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Cluster:
    run_dir: Path
    processes: list[Process] = field(default_factory=list)
    redis_url: str = ""
    gateway_address: str = ""
    http_url: str = ""  # the gateway's OpenAI-compatible API, http://host:port/v1

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], address: str = "") -> Process:
        log_path = self.run_dir / f"{name}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=self.run_dir, start_new_session=True
            )
        process = Process(name, proc, log_path, address)
        self.processes.append(process)
        return process

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM in reverse start order (gateway first), wait, SIGKILL what is left."""
        for process in reversed(self.processes):
            if process.proc.poll() is None:
                process.proc.send_signal(signal.SIGTERM)
                try:
                    process.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    print(f"[cluster] {process.name} ignored SIGTERM; killing it", file=sys.stderr)
                    process.proc.kill()
                    process.proc.wait()
        self.processes.clear()


def _redis_pings(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


async def _wait_ready(process: Process, timeout_s: float) -> None:
    """Health SERVING, failing early (with its log) if the process exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.proc.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.proc.returncode}:\n{process.log_tail()}")
        try:
            await wait_healthy(process.address, timeout_s=1.0)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{process.name} not healthy after {timeout_s} s:\n{process.log_tail()}") from None


def model_dirs(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.draft and args.target:
        return Path(args.draft), Path(args.target)
    if args.draft or args.target:
        raise SystemExit("give both --draft and --target, or neither")
    from rsd_runtime.provision import default_cache_dir

    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if args.tiny:
        from rsd_runtime.tiny import build_tiny_pair

        return build_tiny_pair(cache / "tiny", "qwen2")
    from rsd_runtime.provision import provision_pair

    paths = provision_pair(cache)
    return paths["draft"], paths["target"]


def start_cluster(args: argparse.Namespace) -> Cluster:
    """Start redis (if available), verifier, drafter and gateway; return when all are healthy."""
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="rsd-cluster-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(run_dir)
    draft_dir, target_dir = model_dirs(args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH", "")]))
    model_flags = ["--threads", str(args.threads)] if args.threads else []
    model_flags += ["--dtype", args.dtype]
    py = sys.executable
    try:
        redis_server = None if args.no_redis else shutil.which("redis-server")
        registry: list[str] = []
        if redis_server:
            port = free_port()
            cmd = [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(run_dir)]
            cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
            cluster.spawn("redis", cmd, env)
            cluster.redis_url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 10
            while not _redis_pings(cluster.redis_url):
                if time.monotonic() > deadline or cluster.processes[-1].proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start:\n{cluster.processes[-1].log_tail()}")
                time.sleep(0.05)
            registry = ["--redis-url", cluster.redis_url]
        v_port, d_port, g_port, h_port = free_port(), free_port(), free_port(), free_port()
        service = [py, "-m"]
        registry_v, registry_d = [*registry, "--verifier-id", "verifier-0"], [*registry, "--drafter-id", "drafter-0"]
        verifier = cluster.spawn(
            "verifier",
            [
                *service,
                "verifier_service",
                "--port",
                str(v_port),
                "--model",
                str(target_dir),
                *registry_v,
                *model_flags,
            ],
            env,
            f"127.0.0.1:{v_port}",
        )
        drafter = cluster.spawn(
            "drafter",
            [*service, "drafter_service", "--port", str(d_port), "--model", str(draft_dir), *registry_d, *model_flags],
            env,
            f"127.0.0.1:{d_port}",
        )
        static = [] if registry else ["--drafters", f"drafter-0={drafter.address}"]
        static += [] if registry else ["--verifiers", f"verifier-0={verifier.address}"]
        http = ["--http-port", str(h_port), "--served-model-name", "rsd-tiny" if args.tiny else target_dir.name]
        gateway = cluster.spawn(
            "gateway",
            [*service, "gateway", "--port", str(g_port), "--tokenizer", str(target_dir), *registry, *static, *http],
            env,
            f"127.0.0.1:{g_port}",
        )
        cluster.gateway_address = gateway.address
        cluster.http_url = f"http://127.0.0.1:{h_port}/v1"

        async def all_ready() -> None:
            await asyncio.gather(*(_wait_ready(p, args.start_timeout_s) for p in (verifier, drafter, gateway)))

        asyncio.run(all_ready())
    except BaseException:
        cluster.stop(args.stop_timeout_s)
        raise
    return cluster


def run_generation(address: str, args: argparse.Namespace, out=sys.stdout) -> str:
    """One generation through the gateway, streamed to `out`; stats to stderr. Returns the text."""
    from rsd_runtime.client import RsdClient

    prompt = args.prompt if args.prompt is not None else (TINY_PROMPT if args.tiny else CODE_PROMPT)
    with RsdClient(address) as client:
        gen = client.generate(
            prompt,
            method=args.method,
            shape=args.shape,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
        t0 = time.perf_counter()
        out.write(prompt)
        for delta in gen:
            out.write(delta.text)
            out.flush()
        out.write("\n")
        print_stats(gen, time.perf_counter() - t0)
    return gen.text


def print_stats(gen, wall_s: float) -> None:
    from rsd_wire import common_pb2

    f = gen.finished
    params = gen.started.params if gen.started is not None else None
    where = f"{params.method.name} {params.method.shape} T={params.sampling.temperature:g}" if params else ""
    if f is None:
        print(f"\n[{where}] stream ended without a finish event", file=sys.stderr)
        return
    steps = max(f.num_steps, 1)
    accepted = sum(s.num_accepted_tokens for s in gen.steps)
    drafted = sum(s.num_draft_tokens for s in gen.steps)
    print(
        f"\n[{where}] session {gen.session_id}: {f.num_new_tokens} tokens in {wall_s:.2f} s "
        f"({f.num_new_tokens / max(wall_s, 1e-9):.2f} tok/s), {f.num_steps} steps, block efficiency "
        f"{f.num_new_tokens / steps:.2f}, accepted {accepted}/{drafted} drafts, "
        f"finish {common_pb2.FinishReason.Name(f.reason)}, committed length {f.committed_length_tokens}",
        file=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rsd cluster", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny seeded random models (seconds)")
    ap.add_argument("--draft", help="draft model folder (default: the real Qwen pair, provisioned)")
    ap.add_argument("--target", help="target model folder")
    ap.add_argument("--cache-dir", default=None, help="model cache (default $RSD_MODEL_CACHE or ~/.cache/rsd/models)")
    ap.add_argument("--keep-running", action="store_true", help="keep the cluster up until Ctrl-C")
    ap.add_argument("--no-generate", action="store_true", help="skip the demo generation")
    ap.add_argument("--no-redis", action="store_true", help="use the gateway's embedded store even if redis exists")
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--method", default="rsd_s")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per model process (0: torch's default)")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=[*DTYPE_NAMES, "auto"],
        help="both model services' dtype (auto: bf16 where the device multiplies it natively)",
    )
    ap.add_argument("--run-dir", default=None, help="logs go here (default: a new temporary folder)")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--stop-timeout-s", type=float, default=15.0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    cluster = start_cluster(args)
    store = f"redis {cluster.redis_url}" if cluster.redis_url else "embedded store"
    print(
        f"[cluster] up in {time.monotonic() - t0:.1f} s: gateway {cluster.gateway_address} "
        f"(OpenAI-compatible API {cluster.http_url}), {store}; logs in {cluster.run_dir}",
        file=sys.stderr,
    )
    try:
        if not args.no_generate:
            run_generation(cluster.gateway_address, args)
        if args.keep_running:
            print(f"[cluster] gateway at {cluster.gateway_address}; Ctrl-C stops the cluster", file=sys.stderr)
            print(f"  rsd generate --server {cluster.gateway_address} --prompt '...'", file=sys.stderr)
            print(f"[cluster] OpenAI base URL: {cluster.http_url}", file=sys.stderr)
            stop = False

            def on_signal(signum, frame):
                nonlocal stop
                stop = True

            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)  # also where a shell started us with SIGINT ignored
            with contextlib.suppress(KeyboardInterrupt):
                while not stop:
                    time.sleep(0.5)
                    dead = [p.name for p in cluster.processes if p.proc.poll() is not None]
                    if dead:
                        print(f"[cluster] exited: {', '.join(dead)}; stopping", file=sys.stderr)
                        return 1
    finally:
        t_stop = time.monotonic()
        cluster.stop(args.stop_timeout_s)
        print(f"[cluster] stopped in {time.monotonic() - t_stop:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

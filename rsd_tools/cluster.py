"""Start the whole cluster as plain processes on loopback (no Docker), run one generation, stop.

    rsd cluster --tiny                       # tiny random pair: seconds
    rsd cluster --keep-running               # the real Qwen2.5-Coder pair; Ctrl-C stops it
    rsd cluster --tiny --verifiers 2 --drafters 2 --gateways 2 --keep-running   # failover, batching, the pool
    rsd cluster --tiny --secure              # tokens + TLS/mTLS on every hop, throwaway certificates
    python scripts/cluster.py --tiny --prompt "w2 w10 w11"

Processes (started by rsd_tools.launcher), each `python -m <service>` with its log in the run directory
(<name>.log):
    redis          redis-server on a free port, no persistence   (only when `redis-server` is on PATH)
    verifier-<i>   the target model     (--verifiers N, default 1; --verifier-id verifier-<i>)
    drafter-<i>    the draft model      (--drafters M, default 1; --drafter-id drafter-<i>)
    gateway-<i>    the target's tokenizer, the public API: gRPC, and OpenAI-compatible HTTP on a port of
                   its own   (--gateways G, default 1; more need Redis)
With Redis the services register themselves and the gateways find them in the registry; without
it the one gateway keeps sessions in its embedded store and is given the services' addresses.

Placement by default: no cores given, each model service takes one torch thread per core (--threads 0)
and the drafter and the verifier take turns on all of them, pre-drafting off (--predraft auto); the
drafter is int8 where the VNNI kernel takes it and it outgrows the cache (--draft-quantize auto). On the 2-core AMX
Xeon measured this beat one core each with pre-drafting (docs/operations.md, placement); give disjoint
--drafter-cores/--verifier-cores (pre-drafting then turns on) where one core draws most of the memory
bandwidth (as on the AVX2 EPYC measured earlier) or each side has a device of its own.

Security (ClusterSecurity; off by default): --secure turns on whatever the flags below do not give,
with throwaway files in <run dir>/secure: a CA with a server and a client certificate (rsd_service.pki),
a random public token and a random internal token. Given files: --tls-cert/--tls-key/--tls-ca (every
service serves TLS with that certificate, which must name 127.0.0.1; peers and the launcher verify it
with the CA), --tls-client-cert/--tls-client-key (client certificate of the internal hops: mTLS),
--public-mtls (the gateways require client certificates too), --auth-token-file, --internal-token-file.

--keep-running keeps the cluster up until Ctrl-C / SIGTERM. A process that dies is reported, the rest
keep serving, and it is restarted (same command, port and log) up to --max-restarts times.
Stop: SIGTERM in reverse start order, then SIGKILL after --stop-timeout-s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rsd_runtime import DTYPE_NAMES, QUANTIZE_MODES
from rsd_service.placement import parse_cores
from rsd_service.security import ClientSecurity
from rsd_tools.defaults import CODE_PROMPT, DEFAULT_METHOD
from rsd_tools.launcher import (
    Cluster,
    ClusterSecurity,
    Process,
    drafter_command,
    free_port,
    gateway_command,
    model_dirs,
    service_env,
    verifier_command,
    wait_all_ready,
)

TINY_PROMPT = "w2 w10 w11 w12 w13"


# ---------------------------------------------------------------------------------------------
# Security


def _new_token(path: Path) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return str(path)


def cluster_security(args: argparse.Namespace, run_dir: Path) -> ClusterSecurity:
    """The flags' ClusterSecurity; with --secure, what they leave out made in run_dir/secure."""

    def absolute(path: str) -> str:
        return str(Path(path).resolve()) if path else ""

    files = (args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_cert, args.tls_client_key)
    tokens = (args.auth_token_file, args.internal_token_file)
    if not args.secure:
        return ClusterSecurity(*map(absolute, files), args.public_mtls, *map(absolute, tokens))
    sec = ClusterSecurity(*map(absolute, files), False, *map(absolute, tokens))  # public_mtls once a cert is made
    folder = run_dir / "secure"
    folder.mkdir(mode=0o700, exist_ok=True)
    made: dict[str, str] = {}
    if not sec.tls_cert:
        from rsd_service.pki import make_local_pki  # cryptography: only for --secure

        pki = make_local_pki(folder)
        made.update(tls_ca=pki["ca"], tls_cert=pki["server"], tls_key=pki["server_key"])
        made.update(client_cert=pki["client"], client_key=pki["client_key"])
    if not sec.auth_token_file:
        made["auth_token_file"] = _new_token(folder / "token")
    if not sec.internal_token_file:
        made["internal_token_file"] = _new_token(folder / "internal_token")
    return replace(sec, **made, public_mtls=args.public_mtls)


# ---------------------------------------------------------------------------------------------
# Start


def start_cluster(args: argparse.Namespace) -> Cluster:
    """Start redis (if available), the verifiers, drafters and gateways; return when all are healthy."""
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="rsd-cluster-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    for flag in ("verifiers", "drafters", "gateways"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1")
    redis_server = None if args.no_redis else shutil.which("redis-server")
    if args.gateways > 1 and not redis_server:
        raise ValueError("--gateways above 1 needs redis-server on PATH (gateways share sessions through Redis)")
    cluster = Cluster(run_dir, security=cluster_security(args, run_dir))
    draft_dir, target_dir = model_dirs(args.draft, args.target, args.cache_dir, args.tiny)
    env = service_env()
    model_flags = ["--threads", str(args.threads)] if args.threads else []
    model_flags += ["--dtype", args.dtype]
    numeric = serving_numeric(args.numeric, target_dir, draft_dir, dtype=args.dtype)
    model_flags += ["--numeric", numeric] if numeric != "exact" else []
    print(f"[cluster] numeric {numeric} (--numeric {args.numeric})", file=sys.stderr)
    cluster.numeric = numeric
    drafter_flags = ["--quantize", args.draft_quantize] if args.draft_quantize != "none" else []
    drafter_flags += [] if predraft_on(args) else ["--predraft", "false"]  # the drafter's default is on
    sec = cluster.security

    def spawn(role: str, index: int, port: int, cmd: list[str]) -> Process:
        """role-index on `port`; verifiers and drafters register under that name (--verifier-id ...)."""
        process = cluster.spawn(f"{role}-{index}", [*cmd, *sec.service_flags(role)], env, f"127.0.0.1:{port}")
        process.probe = sec.probe(role)
        return process

    try:
        registry: list[str] = []
        if redis_server:
            cluster.start_redis(redis_server, env)
            registry = ["--redis-url", cluster.redis_url]
        verifiers = []
        for i, port in enumerate(free_port() for _ in range(args.verifiers)):
            flags = [*registry, *model_flags]
            cmd = verifier_command(port, target_dir, f"verifier-{i}", *flags, cores=args.verifier_cores)
            verifiers.append(spawn("verifier", i, port, cmd))
        drafters = []
        for i, port in enumerate(free_port() for _ in range(args.drafters)):
            flags = [*registry, *model_flags, *drafter_flags]
            cmd = drafter_command(port, draft_dir, f"drafter-{i}", *flags, cores=args.drafter_cores)
            drafters.append(spawn("drafter", i, port, cmd))
        static = [] if registry else ["--drafters", ",".join(f"{p.name}={p.address}" for p in drafters)]
        static += [] if registry else ["--verifiers", ",".join(f"{p.name}={p.address}" for p in verifiers)]
        http_ports = [free_port() for _ in range(args.gateways)]
        http = ["--served-model-name", "rsd-tiny" if args.tiny else target_dir.name]
        gateways = []
        for i, http_port in enumerate(http_ports):
            port = free_port()
            flags = [*registry, *static, *http, "--http-port", str(http_port)]
            flags += ["--gateway-id", f"gateway-{i}"] if args.gateways > 1 else []
            cmd = gateway_command(port, target_dir, *flags, cores=args.gateway_cores)
            gateways.append(spawn("gateway", i, port, cmd))
        cluster.gateway_address = gateways[0].address
        scheme = "https" if sec.tls_cert else "http"
        cluster.http_url = f"{scheme}://127.0.0.1:{http_ports[0]}/v1"
        wait_all_ready([*verifiers, *drafters, *gateways], args.start_timeout_s)
    except BaseException:
        cluster.stop(args.stop_timeout_s)
        raise
    return cluster


def demo_prompt(args: argparse.Namespace) -> str:
    """The generation's prompt: --prompt, else the tiny pair's or the code prompt."""
    return args.prompt if args.prompt is not None else (TINY_PROMPT if args.tiny else CODE_PROMPT)


def run_generation(
    address: str,
    args: argparse.Namespace,
    out=sys.stdout,
    security: ClientSecurity | None = None,
    rates: list[float] | None = None,
) -> str:
    """One generation through the gateway, streamed to `out`; stats to stderr. Returns the text (its tokens/s
    appended to `rates` when given)."""
    from rsd_service.client import RsdClient

    prompt = demo_prompt(args)
    with RsdClient(address, security=security) as client:
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
        rate = print_stats(gen, time.perf_counter() - t0)
    if rates is not None and rate is not None:
        rates.append(rate)
    return gen.text


def target_alone_command(args: argparse.Namespace, numeric: str) -> list[str]:
    """`rsd generate --method ar` with the cluster's prompt, sampling, target, dtype, numeric and verifier cores:
    the same generation from the target alone in one process, which is what speculation must beat."""
    prompt = demo_prompt(args)
    cmd = [sys.executable, "-m", "rsd_cli", "generate", "--method", "ar", "--prompt", prompt]
    cmd += ["--temperature", str(args.temperature), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--seed", str(args.seed), "--target-dtype", args.dtype, "--target-numeric", numeric]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--target", str(args.target)] if args.target else []
    cmd += ["--cache-dir", str(args.cache_dir)] if args.cache_dir else []
    cmd += ["--cores", args.verifier_cores] if args.verifier_cores else []
    return cmd + (["--threads", str(args.threads)] if args.threads else [])


def compare_target_alone(args: argparse.Namespace, numeric: str, speculative_tok_s: float) -> float | None:
    """Run target_alone_command (the cluster stopped: the cores are free) and print both rates and their ratio
    (each generation's tokens over its wall time, prefill included, model loading not). -> the target's tok/s."""
    done = subprocess.run(target_alone_command(args, numeric), capture_output=True, text=True, env=service_env())
    found = re.search(r"\(([\d.]+) tok/s\)", done.stderr)
    if done.returncode or not found:
        print(f"[cluster] the target alone failed (exit {done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    alone = float(found.group(1))
    print(
        f"[cluster] target alone in one process: {alone:.2f} tok/s; speculative through the cluster: "
        f"{speculative_tok_s:.2f} tok/s = {speculative_tok_s / max(alone, 1e-9):.2f}x the target alone",
        file=sys.stderr,
    )
    return alone


def print_stats(gen, wall_s: float) -> float | None:
    """Print the generation's stats line; -> its tokens/s (None without a finish event)."""
    from rsd_wire import common_pb2

    f = gen.finished
    params = gen.started.params if gen.started is not None else None
    where = f"{params.method.name} {params.method.shape} T={params.sampling.temperature:g}" if params else ""
    rule = next((s.verifier.rule for s in reversed(gen.steps) if s.verifier.rule), "")
    where += f" verification={params.verification or 'token'} rule={rule or '-'}" if params else ""
    if f is None:
        print(f"\n[{where}] stream ended without a finish event", file=sys.stderr)
        return None
    steps = max(f.num_steps, 1)
    rate = f.num_new_tokens / max(wall_s, 1e-9)
    accepted = sum(s.num_accepted_tokens for s in gen.steps)
    drafted = sum(s.num_draft_tokens for s in gen.steps)
    print(
        f"\n[{where}] session {gen.session_id}: {f.num_new_tokens} tokens in {wall_s:.2f} s "
        f"({rate:.2f} tok/s), {f.num_steps} steps, block efficiency "
        f"{f.num_new_tokens / steps:.2f}, accepted {accepted}/{drafted} drafts, "
        f"finish {common_pb2.FinishReason.Name(f.reason)}, committed length {f.committed_length_tokens}",
        file=sys.stderr,
    )
    return rate


def _exit_status(code: int) -> str:
    return f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"code {code}"


def keep_running(cluster: Cluster, max_restarts: int, should_stop: Callable[[], bool], poll_s: float = 0.5) -> int:
    """Serve until should_stop(). A process that exits is reported and restarted (same command and port) until
    it has been restarted max_restarts times, then left down; the others serve throughout. A restart is
    reported once the new process is healthy. 1 once every process is down for good."""
    down: set[str] = set()
    starting: set[str] = set()  # restarted, not healthy yet
    while not should_stop():
        time.sleep(poll_s)
        for p in cluster.processes:
            code = None if p.name in down else p.proc.poll()
            if p.name in down or (code is None and p.name not in starting):
                continue
            if code is None:
                if cluster.is_up(p):
                    starting.discard(p.name)
                    where = cluster.redis_url if p.name == "redis" else p.address
                    restarts = f"restart {p.restarts} of {max_restarts}"
                    print(f"[cluster] {p.name} restarted: pid {p.proc.pid} at {where} ({restarts})", file=sys.stderr)
                continue
            starting.discard(p.name)
            print(f"[cluster] {p.name} (pid {p.proc.pid}) exited with {_exit_status(code)}", file=sys.stderr)
            if p.restarts >= max_restarts:
                print(
                    f"[cluster] {p.name} stays down (--max-restarts {max_restarts}); see {p.log_path}", file=sys.stderr
                )
                down.add(p.name)
                continue
            cluster.restart(p)
            starting.add(p.name)
        if len(down) == len(cluster.processes):
            print("[cluster] every process is down", file=sys.stderr)
            return 1
    return 0


def serving_numeric(numeric: str, *model_dirs: Path, dtype: str = "float32", device: str = "cpu") -> str:
    """--numeric auto: the fastest numeric that is exact against itself, "q8_activations" (int8 activations on a
    GGUF pair's own blocks, as llama.cpp computes; rsd_runtime.quant_q8) where every model is a GGUF file and this
    CPU runs its kernel in float32, else "exact". Either is one deterministic function of the weights: T = 0 is
    the target alone's greedy output in that numeric."""
    if numeric != "auto":
        return numeric
    from rsd_runtime import quant_q8
    from rsd_runtime.gguf_model import gguf_file

    gguf = all(gguf_file(d) is not None for d in model_dirs)
    if dtype not in ("float32", "auto") or quant_q8.unavailable_reason(device, gguf=gguf):
        return "exact"
    return "q8_activations"


def predraft_on(args: argparse.Namespace) -> bool:
    """Pre-drafting pays only when the drafter has cores of its own: sharing the verifier's, its
    speculative forwards slow the verification they wait on. auto = on iff both core sets are given
    and disjoint."""
    if args.predraft != "auto":
        return args.predraft == "on"
    if not (args.drafter_cores and args.verifier_cores):
        return False
    return not set(parse_cores(args.drafter_cores)) & set(parse_cores(args.verifier_cores))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rsd cluster", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny seeded random models (seconds)")
    ap.add_argument("--draft", help="draft model folder (default: the real Qwen pair, provisioned)")
    ap.add_argument("--target", help="target model folder")
    ap.add_argument("--cache-dir", default=None, help="model cache (default $RSD_MODEL_CACHE or ~/.cache/rsd/models)")
    ap.add_argument("--keep-running", action="store_true", help="keep the cluster up until Ctrl-C, restarting the dead")
    ap.add_argument(
        "--max-restarts", type=int, default=3, help="with --keep-running: restarts of each process (0: none)"
    )
    ap.add_argument("--verifiers", type=int, default=1, help="verifier processes (verifier-0, verifier-1, ...)")
    ap.add_argument("--drafters", type=int, default=1, help="drafter processes")
    ap.add_argument("--gateways", type=int, default=1, help="gateway processes (more than one needs Redis)")
    sec = ap.add_argument_group("security (off unless given; --secure turns on all of it)")
    sec.add_argument(
        "--secure",
        action="store_true",
        help="tokens and TLS/mTLS on every hop; what the flags below leave out is made in <run dir>/secure "
        "(a throwaway CA with server and client certificates, random tokens)",
    )
    sec.add_argument("--tls-cert", default="", help="every service's certificate (PEM; must name 127.0.0.1)")
    sec.add_argument("--tls-key", default="", help="its key")
    sec.add_argument("--tls-ca", default="", help="the CA that signed the certificates")
    sec.add_argument("--tls-client-cert", default="", help="client certificate of the internal hops: mTLS")
    sec.add_argument("--tls-client-key", default="", help="its key")
    sec.add_argument("--public-mtls", action="store_true", help="the gateways require client certificates too")
    sec.add_argument("--auth-token-file", default="", help="the public API's bearer token")
    sec.add_argument("--internal-token-file", default="", help="the internal hops' shared secret")
    ap.add_argument("--no-generate", action="store_true", help="skip the demo generation")
    ap.add_argument(
        "--compare-target-alone",
        action="store_true",
        help="after the generation and the cluster's stop, run it through the target alone in one process "
        "(rsd generate --method ar, same settings and cores) and print both tokens/s and their ratio",
    )
    ap.add_argument("--no-redis", action="store_true", help="use the gateway's embedded store even if redis exists")
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--method", default=DEFAULT_METHOD)
    ap.add_argument("--shape", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per model process (default 0: one per core it may use, all cores when not pinned)",
    )
    ap.add_argument(
        "--numeric",
        default="auto",
        choices=("auto", "exact", "q8_activations"),
        help="both model services' numeric (auto: q8_activations for a GGUF pair where the CPU runs it, else exact)",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=[*DTYPE_NAMES, "auto"],
        help="both model services' dtype (auto: bf16 where the device multiplies it natively)",
    )
    place = ap.add_argument_group("placement and the drafter's speed")
    place.add_argument(
        "--verifier-cores", default="", help='CPU cores of every verifier, e.g. "1" or "2-3" (default: any)'
    )
    place.add_argument("--drafter-cores", default="", help='CPU cores of every drafter, e.g. "0" (default: any)')
    place.add_argument(
        "--gateway-cores",
        default="",
        help='CPU cores of every gateway, e.g. "0" (default: any; keep off the verifier\'s)',
    )
    place.add_argument(
        "--draft-quantize",
        default="auto",
        choices=QUANTIZE_MODES,
        help="the drafter's quantisation (default auto: int8 where the VNNI kernel takes a drafter past the cache)",
    )
    place.add_argument(
        "--predraft",
        default="auto",
        choices=["auto", "on", "off"],
        help="draft the likely next trees while the verifier verifies (auto: on when the drafter has cores of its own)",
    )
    ap.add_argument("--run-dir", default=None, help="logs go here (default: a new temporary folder)")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--stop-timeout-s", type=float, default=15.0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    try:
        cluster = start_cluster(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    store = f"redis {cluster.redis_url}" if cluster.redis_url else "embedded store"
    print(
        f"[cluster] up in {time.monotonic() - t0:.1f} s ({store}); OpenAI-compatible API {cluster.http_url}; "
        f"logs in {cluster.run_dir}",
        file=sys.stderr,
    )
    print("\n".join(cluster.describe()), file=sys.stderr, flush=True)
    if cluster.security.enabled:
        print(f"[cluster] secured: {cluster.security.summary()}; a client connects with:", file=sys.stderr)
        how = cluster.security.how_to_connect(cluster.gateway_address, cluster.http_url)
        print("\n".join(how), file=sys.stderr, flush=True)
    rates: list[float] = []
    try:
        if not args.no_generate:
            run_generation(cluster.gateway_address, args, security=cluster.client_security(), rates=rates)
        if args.keep_running:
            print(f"[cluster] gateway at {cluster.gateway_address}; Ctrl-C stops the cluster", file=sys.stderr)
            if not cluster.security.enabled:
                print(f"  rsd generate --server {cluster.gateway_address} --prompt '...'", file=sys.stderr)
            print(f"[cluster] OpenAI base URL: {cluster.http_url}", file=sys.stderr)
            sys.stderr.flush()
            stop = False

            def on_signal(signum, frame):
                nonlocal stop
                stop = True

            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)  # also where a shell started us with SIGINT ignored
            with contextlib.suppress(KeyboardInterrupt):
                return keep_running(cluster, args.max_restarts, lambda: stop)
    finally:
        t_stop = time.monotonic()
        cluster.stop(args.stop_timeout_s)
        print(f"[cluster] stopped in {time.monotonic() - t_stop:.1f} s", file=sys.stderr)
    if args.compare_target_alone and rates:
        compare_target_alone(args, cluster.numeric, rates[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A bounded load test: N concurrent clients generating through a gateway for M seconds.

    python -m rsd_bench.loadtest --clients 8 --duration-s 60              # starts `rsd cluster --tiny`
    python -m rsd_bench.loadtest --gateway 127.0.0.1:7000 --pid verifier=123 ...   # a running cluster
    python -m rsd_bench.loadtest --in-process --clients 2 --duration-s 3  # one process, seconds (tests)

Each client loops: one Generate (a prompt of its own, a new session), read the stream to the end,
repeat until the time is up; a request that started before the deadline is finished. Reported:
requests completed, errors by status code (every error is unexpected here: the goal is 0), time to
first token (request sent -> first committed tokens) and per-token latency (the request's time after
its first tokens / its remaining tokens) as p50 / p99 over requests, throughput (new tokens / s), and
each service process's resident memory (VmRSS) at the start, its peak and at the end. Writes
<out>.json and <out>.md (default benchmarks/results/load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from rsd_bench.machine import cpu_info, run_record
from rsd_service.client import RsdClient
from rsd_tools.defaults import DEFAULT_METHOD


@dataclass
class RequestResult:
    ok: bool
    code: str  # "OK" or the status code name
    num_tokens: int = 0
    ttft_s: float = 0.0  # request sent -> first tokens
    per_token_s: float = 0.0  # after the first tokens: time per further token
    total_s: float = 0.0


@dataclass
class MemoryTrack:
    """VmRSS of one process, in MiB."""

    pid: int
    start_mib: float = 0.0
    peak_mib: float = 0.0
    end_mib: float = 0.0

    def sample(self) -> float:
        mib = rss_mib(self.pid)
        self.start_mib = self.start_mib or mib
        self.peak_mib = max(self.peak_mib, mib)
        self.end_mib = mib
        return mib


@dataclass
class LoadReport:
    clients: int
    duration_s: float
    wall_s: float
    setup: dict
    requests_completed: int
    errors: dict[str, int]
    new_tokens: int
    throughput_tok_s: float
    requests_per_s: float
    ttft_ms: dict[str, float]
    per_token_ms: dict[str, float]
    memory_mib: dict[str, dict[str, float]] = field(default_factory=dict)


def rss_mib(pid: int) -> float:
    """Resident set size of a process (Linux /proc), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p99 / max in milliseconds (nearest rank)."""
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    ranked = sorted(values)

    def rank(q: float) -> float:
        return ranked[min(len(ranked) - 1, max(0, round(q * len(ranked)) - 1))] * 1000

    return {"p50": rank(0.50), "p99": rank(0.99), "max": ranked[-1] * 1000}


def one_request(client: RsdClient, prompt: str, args: argparse.Namespace) -> RequestResult:
    t0 = time.perf_counter()
    t_first, t_last, tokens, first_n = 0.0, 0.0, 0, 0
    try:
        gen = client.generate(
            prompt,
            method=args.method,
            shape=args.shape,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
        )
        for delta in gen:
            if delta.token_ids:
                t_last = time.perf_counter()
                if not tokens:
                    t_first, first_n = t_last, len(delta.token_ids)
                tokens += len(delta.token_ids)
    except grpc.RpcError as e:
        return RequestResult(False, e.code().name, tokens, total_s=time.perf_counter() - t0)
    if gen.finished is None or tokens == 0:
        return RequestResult(False, "NO_FINISH" if gen.finished is None else "NO_TOKENS", tokens)
    after_first = tokens - first_n
    per_token = (t_last - t_first) / after_first if after_first else 0.0
    return RequestResult(True, "OK", tokens, t_first - t0, per_token, time.perf_counter() - t0)


def run_clients(address: str, args: argparse.Namespace, memory: dict[str, MemoryTrack]) -> tuple[list, float]:
    """The clients' threads until the deadline; memory sampled every second meanwhile."""
    results: list[RequestResult] = []
    lock = threading.Lock()
    deadline = time.monotonic() + args.duration_s

    def client_loop(i: int) -> None:
        with RsdClient(address, timeout_s=args.request_timeout_s) as client:
            n = 0
            while time.monotonic() < deadline:
                prompt = f"w2 w{10 + i} w{30 + (n % 40)} w{80 + (i * 7 + n) % 60}"
                result = one_request(client, prompt, args)
                with lock:
                    results.append(result)
                n += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for track in memory.values():
            track.sample()
        time.sleep(1.0)
    for t in threads:
        t.join()
    for track in memory.values():
        track.sample()
    return results, time.perf_counter() - t0


def summarize(args, results: list[RequestResult], wall_s: float, memory, setup: dict) -> LoadReport:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1
    tokens = sum(r.num_tokens for r in ok)
    return LoadReport(
        clients=args.clients,
        duration_s=args.duration_s,
        wall_s=round(wall_s, 3),
        setup=setup,
        requests_completed=len(ok),
        errors=errors,
        new_tokens=tokens,
        throughput_tok_s=round(tokens / wall_s, 2) if wall_s else 0.0,
        requests_per_s=round(len(ok) / wall_s, 3) if wall_s else 0.0,
        ttft_ms={k: round(v, 2) for k, v in percentiles([r.ttft_s for r in ok]).items()},
        per_token_ms={k: round(v, 2) for k, v in percentiles([r.per_token_s for r in ok if r.per_token_s]).items()},
        memory_mib={
            name: {
                "start": round(t.start_mib, 1),
                "peak": round(t.peak_mib, 1),
                "end": round(t.end_mib, 1),
                "growth": round(t.end_mib - t.start_mib, 1),
            }
            for name, t in memory.items()
        },
    )


def to_markdown(report: LoadReport) -> str:
    setup = report.setup
    lines = [
        "# Load test (python -m rsd_bench.loadtest)",
        "",
        f"{report.clients} concurrent clients for {report.duration_s:g} s against {setup['cluster']}; "
        f"{setup['method']} {setup['shape']}, T={setup['temperature']:g}, {setup['max_new_tokens']} new tokens "
        f"per request, a new session each; {setup['machine']}.",
        "",
        "| requests completed | errors | new tokens | throughput (tok/s) | requests/s |",
        "| --- | --- | --- | --- | --- |",
        f"| {report.requests_completed} | {sum(report.errors.values())} {report.errors or ''} | {report.new_tokens} "
        f"| {report.throughput_tok_s} | {report.requests_per_s} |",
        "",
        "| latency (ms) | p50 | p99 | max |",
        "| --- | --- | --- | --- |",
        f"| time to first token | {report.ttft_ms['p50']} | {report.ttft_ms['p99']} | {report.ttft_ms['max']} |",
        f"| per token (after the first) | {report.per_token_ms['p50']} | {report.per_token_ms['p99']} "
        f"| {report.per_token_ms['max']} |",
        "",
    ]
    if report.memory_mib:
        lines += ["| process | RSS start (MiB) | peak | end | growth |", "| --- | --- | --- | --- | --- |"]
        for name, m in report.memory_mib.items():
            lines.append(f"| {name} | {m['start']} | {m['peak']} | {m['end']} | {m['growth']:+} |")
        lines.append("")
    return "\n".join(lines)


def write_report(report: LoadReport, out: str) -> tuple[Path, Path]:
    json_path, md_path = Path(f"{out}.json"), Path(f"{out}.md")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({**run_record("loadtest"), **asdict(report)}, indent=2) + "\n")
    md_path.write_text(to_markdown(report))
    return json_path, md_path


# ---------------------------------------------------------------------------------------------
# Where the gateway comes from


class InProcess:
    """Verifier, drafter and gateway servers on one event loop in a thread, on the tiny pair (tests)."""

    def __init__(self, cache_dir: str | None):
        import tempfile

        from rsd_tools.launcher import model_dirs

        self._tmp = None if cache_dir else tempfile.TemporaryDirectory(prefix="rsd-load-")
        self.dirs = model_dirs(None, None, cache_dir or self._tmp.name, tiny=True)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(120)

    async def _start(self) -> str:
        from drafter_service.config import DrafterConfig
        from drafter_service.server import create_server as create_drafter
        from gateway.config import GatewayConfig
        from gateway.server import create_server as create_gateway
        from gateway.store.memory_store import MemorySessionStore
        from rsd_runtime.models import load_model
        from rsd_runtime.tokenizer import load_tokenizer
        from verifier_service.config import VerifierConfig
        from verifier_service.server import create_server as create_verifier

        draft_dir, target_dir = self.dirs
        vserver, _, v = await create_verifier(VerifierConfig(verifier_id="v0"), load_model(target_dir))
        dserver, _, d = await create_drafter(DrafterConfig(drafter_id="d0"), load_model(draft_dir))
        cfg = GatewayConfig(port=0, drafters=f"d0={d.address}", verifiers=f"v0={v.address}")
        gserver, gport, g = await create_gateway(cfg, store=MemorySessionStore(), tokenizer=load_tokenizer(target_dir))
        self.closers = [(g, gserver), (d, dserver), (v, vserver)]
        return f"127.0.0.1:{gport}"

    def stop(self) -> None:
        async def stop_all() -> None:
            for handle, server in self.closers:
                await handle.close(server, 0)

        asyncio.run_coroutine_threadsafe(stop_all(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if self._tmp is not None:
            self._tmp.cleanup()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.loadtest", description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--gateway", default="", help="a running gateway (default: start `rsd cluster --tiny`)")
    ap.add_argument("--pid", action="append", default=[], help="name=pid of a process to track (with --gateway)")
    ap.add_argument("--in-process", action="store_true", help="all servers in this process (seconds; tests)")
    ap.add_argument("--real", action="store_true", help="the cluster on the real model pair, not the tiny one")
    ap.add_argument("--method", default=DEFAULT_METHOD)
    ap.add_argument("--shape", default="3x3")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--cache-dir", default=None, help="model cache of the cluster (see rsd cluster)")
    ap.add_argument("--out", default="benchmarks/results/load", help="writes OUT.json and OUT.md")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.clients < 1 or args.duration_s <= 0:
        raise SystemExit("--clients must be >= 1 and --duration-s > 0")
    memory: dict[str, MemoryTrack] = {}
    cluster = in_process = None
    if args.gateway:
        address, where = args.gateway, f"the gateway at {args.gateway}"
        for item in args.pid:
            name, _, pid = item.partition("=")
            memory[name] = MemoryTrack(int(pid))
    elif args.in_process:
        in_process = InProcess(args.cache_dir)
        address, where = in_process.address, "in-process servers (tiny Qwen2 pair, one process)"
        memory["all-in-one"] = MemoryTrack(os.getpid())
    else:
        from rsd_tools.cluster import build_parser as cluster_parser
        from rsd_tools.cluster import start_cluster

        cluster_args = ["--no-generate", "--start-timeout-s", "600"] + ([] if args.real else ["--tiny"])
        cluster_args += ["--cache-dir", args.cache_dir] if args.cache_dir else []
        cluster = start_cluster(cluster_parser().parse_args(cluster_args))
        address = cluster.gateway_address
        where = "`rsd cluster " + ("" if args.real else "--tiny") + "` (redis, verifier, drafter, gateway processes)"
        memory = {p.name: MemoryTrack(p.proc.pid) for p in cluster.processes}
    try:
        with RsdClient(address, timeout_s=args.request_timeout_s) as client:  # warm-up: loads, first forwards
            one_request(client, "w2 w3 w4", args)
        for track in memory.values():
            track.sample()
        results, wall_s = run_clients(address, args, memory)
    finally:
        if cluster is not None:
            cluster.stop()
        if in_process is not None:
            in_process.stop()
    setup = {
        "cluster": where,
        "method": args.method,
        "shape": args.shape,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "cpu": cpu_info(),  # the machine class (rsd_bench.index)
    }
    report = summarize(args, results, wall_s, memory, setup)
    json_path, md_path = write_report(report, args.out)
    print(to_markdown(report))
    print(f"[loadtest] wrote {json_path} and {md_path}", file=sys.stderr)
    return 0 if not report.errors else 1


if __name__ == "__main__":
    sys.exit(main())

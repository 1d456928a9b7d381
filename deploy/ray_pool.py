"""A verifier pool on Ray: each replica is a Ray actor running a verifier gRPC server, and a control
loop keeps the number of replicas between min and max by the load it measures.

    python -m deploy.ray_pool --replicas 2 --model DIR --redis-url redis://HOST:6379/0 \
        --min-replicas 1 --max-replicas 4 --num-gpus-per-replica 1 --device cuda:0 --dtype bfloat16

- A replica (VerifierReplica) runs verifier_service.server.create_server on the actor's own asyncio
  loop and registers in Redis like a standalone verifier (heartbeat + TTL). The gateway needs nothing
  Ray-specific: it picks the least loaded verifier of the registry for a new session and keeps a
  continued session on the replica named in its KV location.
- Settings: pool fields (PoolConfig: RSD_POOL_<FIELD> env, --field flags) and verifier fields
  (VerifierConfig: RSD_VERIFIER_<FIELD>, --field), in one command line. Device and dtype are the
  verifier's own fields; Ray gives each replica num_gpus_per_replica GPUs and sets its
  CUDA_VISIBLE_DEVICES, so `--device cuda:0` names the replica's first GPU.
- Autoscaling: desired_replicas(), a pure function of the pool's active sessions over a window.
- Scale-down drains first: the replica leaves the registry (no new session arrives), waits until no
  Verify stream is open (or drain_timeout_s), stops its server, and only then is the actor killed.
  A replica that dies anyway (crash, ray.kill) is noticed by the gateway (UNAVAILABLE: new epoch on
  another verifier, from the committed tokens) and by this loop (replaced up to min_replicas).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray

from rsd_service.serving import load_config, setup_logging
from verifier_service.config import VerifierConfig

log = logging.getLogger(__name__)
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class PoolConfig:
    """rsd verifier pool on Ray: replicas of the verifier, autoscaled by load."""

    # Replicas started first; autoscaling keeps the count in [min_replicas, max_replicas]
    # (0 = replicas: a fixed-size pool that still replaces dead replicas).
    replicas: int = 1
    min_replicas: int = 0
    max_replicas: int = 0
    # Ray resources per replica (an actor); GPUs also decide where Ray places it.
    num_gpus_per_replica: float = 0.0
    num_cpus_per_replica: float = 1.0
    # "" = RAY_ADDRESS if set, else a local Ray instance; e.g. "ray-head:6379" joins a cluster.
    ray_address: str = ""
    # Replica ids are "<name>-<n>", n counting up, never reused (a dead replica's entry may linger).
    name: str = "verifier-pool"
    # Scaling: a replica should run about num_slots * target_utilization active sessions.
    target_utilization: float = 0.75
    interval_s: float = 2.0  # between load samples
    window_s: float = 30.0  # scale-down looks at the busiest sample of this window
    scale_up_cooldown_s: float = 10.0  # after any change, before the next scale-up
    scale_down_cooldown_s: float = 60.0  # after any change, before the next scale-down
    drain_timeout_s: float = 120.0  # a draining replica's open streams get this long to finish

    def checks(self) -> dict[str, bool]:
        """Field name -> whether its value is valid (the service configs' interface, rsd_service.config)."""
        lo, hi = self.bounds
        return {
            "replicas": lo <= self.replicas <= hi,
            "min_replicas": self.min_replicas >= 0,
            "max_replicas": hi >= max(lo, 1),
            "num_gpus_per_replica": self.num_gpus_per_replica >= 0,
            "num_cpus_per_replica": self.num_cpus_per_replica >= 0,
            "target_utilization": 0 < self.target_utilization <= 1,
            "interval_s": self.interval_s > 0,
            "window_s": self.window_s >= 0,
            "scale_up_cooldown_s": self.scale_up_cooldown_s >= 0,
            "scale_down_cooldown_s": self.scale_down_cooldown_s >= 0,
            "drain_timeout_s": self.drain_timeout_s >= 0,
        }

    def __post_init__(self) -> None:
        bad = [name for name, ok in self.checks().items() if not ok]
        if bad:
            raise ValueError(f"invalid pool config: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")

    @property
    def bounds(self) -> tuple[int, int]:
        return self.min_replicas or self.replicas, self.max_replicas or self.replicas


# ---------------------------------------------------------------------------------------------
# The policy: load samples -> desired replicas


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int
    max_replicas: int
    sessions_per_replica: float  # active sessions one replica should carry (num_slots * target_utilization)
    scale_up_cooldown_s: float
    scale_down_cooldown_s: float


def desired_replicas(policy: ScalingPolicy, current: int, samples: Sequence[float], since_change_s: float) -> int:
    """How many replicas the pool should have, given `current` (serving + starting) and the pool's
    active sessions sampled over the last window (oldest first).

    Up fast, down slow: scale up to what the latest sample needs; scale down by one replica only when
    even the busiest sample of the window fits in one replica fewer. Between the two lies a band one
    replica wide in which nothing changes (hysteresis), and each direction waits its cooldown after
    the last change. Outside [min, max] the count is corrected at once, cooldown or not.

        sessions_per_replica 3, current 2: latest 7 -> 3; window max 3 -> 1; window max 4..6 -> 2
    """
    clamped = min(max(current, policy.min_replicas), policy.max_replicas)
    if clamped != current or not samples:
        return clamped
    needed = lambda sessions: math.ceil(sessions / policy.sessions_per_replica)  # noqa: E731
    if needed(samples[-1]) > current and since_change_s >= policy.scale_up_cooldown_s:
        return min(needed(samples[-1]), policy.max_replicas)
    if needed(max(samples)) < current and since_change_s >= policy.scale_down_cooldown_s:
        return max(current - 1, policy.min_replicas)
    return current


# ---------------------------------------------------------------------------------------------
# A replica: one Ray actor, one verifier server


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class VerifierReplica:
    """Ray actor body (async methods: Ray runs them on the actor's asyncio loop, where the grpc.aio
    server lives too). Made an actor by ReplicaPool: ray.remote(VerifierReplica).options(...)."""

    async def start(self, config: VerifierConfig) -> tuple[str, str]:
        """Load the model, start the server, register. Returns (verifier_id, address)."""
        from rsd_runtime.compute import single_threaded
        from verifier_service.server import create_server  # imported in the worker, not by the driver

        setup_logging(config.log_format)  # as a standalone verifier logs
        if config.host in _WILDCARD_HOSTS and not config.advertise_address:
            # Listening on every interface: publish the node's address, which other machines reach.
            # The port must be known before create_server registers, so pick it here.
            port = config.port or _free_port(config.host or "0.0.0.0")
            config = dataclasses.replace(config, port=port, advertise_address=f"{_node_ip()}:{port}")
        self.server, _, self.handle = await create_server(config)
        single_threaded()  # the actor's own process: the target runs on the verifier's compute thread
        return self.handle.verifier_id, self.handle.address

    async def load(self) -> tuple[int, int, int]:
        """(sessions with an open Verify stream, sessions holding a KV slot, slots)."""
        return self.handle.load()

    async def drain(self, timeout_s: float, settle_s: float = 0.5) -> int:
        """Leave the registry, let the open Verify streams finish (VerifierHandle.drain_streams), stop the
        server. Returns the sessions still streaming when it stopped (0 = a clean drain)."""
        still_open = await self.handle.drain_streams(timeout_s, settle_s)
        await self.handle.close(self.server, 1.0)
        return still_open


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


# ---------------------------------------------------------------------------------------------
# The pool: start, measure, scale, drain


@dataclass
class Replica:
    index: int
    verifier_id: str
    actor: ray.actor.ActorHandle
    ready: ray.ObjectRef | None = None  # start() while starting, drain() while draining
    address: str = ""
    state: str = "starting"  # starting -> serving -> draining
    drain_deadline: float = 0.0


class ReplicaPool:
    """The driver side. step() is one tick of the control loop; tests call it directly.

    pool = ReplicaPool(verifier_config, pool_config)
    pool.start()                 # the initial replicas, waits until they serve
    while running: pool.step(); time.sleep(pool_config.interval_s)
    pool.close()                 # drains every replica
    """

    def __init__(self, verifier: VerifierConfig, config: PoolConfig):
        if not verifier.redis_url:
            raise ValueError("a pool needs the verifier's --redis-url: the gateway finds replicas in the registry")
        self.verifier, self.config = verifier, config
        lo, hi = config.bounds
        self.policy = ScalingPolicy(
            lo,
            hi,
            verifier.num_slots * config.target_utilization,
            config.scale_up_cooldown_s,
            config.scale_down_cooldown_s,
        )
        self.replicas: dict[str, Replica] = {}
        self.samples: list[tuple[float, float]] = []  # (monotonic time, active sessions of the pool)
        self._next_index = 0
        self._last_change = time.monotonic()
        self._actor_class = ray.remote(VerifierReplica).options(
            num_cpus=config.num_cpus_per_replica, num_gpus=config.num_gpus_per_replica
        )

    # -- views ---------------------------------------------------------------------------------
    def in_state(self, *states: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state in states]

    @property
    def size(self) -> int:
        """Replicas that serve or will: what the policy counts."""
        return len(self.in_state("starting", "serving"))

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> None:
        for _ in range(self.config.replicas):
            self._add()
        self.wait_serving(self.config.replicas, timeout_s)

    def wait_serving(self, count: int, timeout_s: float) -> None:
        """Tick until `count` replicas serve (a replica that fails to start raises here)."""
        deadline = time.monotonic() + timeout_s
        while len(self.in_state("serving")) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} replicas not serving after {timeout_s} s")
            self._poll_starting(timeout_s=0.2, raise_on_failure=True)

    def step(self) -> int:
        """Collect finished starts and drains, sample the load, scale toward the policy's count."""
        self._poll_starting(timeout_s=0.0)
        self._poll_draining()
        now = time.monotonic()
        self.samples.append((now, self._measure()))
        self.samples = [(t, s) for t, s in self.samples if now - t <= self.config.window_s]
        desired = desired_replicas(self.policy, self.size, [s for _, s in self.samples], now - self._last_change)
        log.debug(
            "pool %s: %d replicas, active sessions %s -> %d", self.config.name, self.size, self.samples[-1][1], desired
        )
        self.scale_to(desired)
        return desired

    def scale_to(self, count: int) -> None:
        if count == self.size:
            return
        log.info("pool %s: %d -> %d replicas", self.config.name, self.size, count)
        self._last_change = time.monotonic()
        while self.size < count:
            self._add()
        while self.size > count:
            # The least busy replica loses the fewest warm caches; among equals the newest goes.
            loads = self._loads(self.in_state("serving"))
            victims = self.in_state("starting") or sorted(
                self.in_state("serving"), key=lambda r: (loads.get(r.verifier_id, 0), -r.index)
            )
            self.drain(victims[0].verifier_id)

    def drain(self, verifier_id: str) -> None:
        """Start draining one replica; step() kills its actor once the drain is over."""
        replica = self.replicas[verifier_id]
        log.info("pool %s: draining %s", self.config.name, verifier_id)
        replica.state, replica.drain_deadline = "draining", time.monotonic() + self.config.drain_timeout_s + 10.0
        replica.ready = replica.actor.drain.remote(self.config.drain_timeout_s)

    def close(self, drain: bool = True) -> None:
        """Drain every replica (or not), then kill every actor."""
        if drain:
            for replica in self.in_state("starting", "serving"):
                self.drain(replica.verifier_id)
            while self.in_state("draining"):
                self._poll_draining(timeout_s=0.2)
        for replica in list(self.replicas.values()):
            ray.kill(replica.actor)
        self.replicas.clear()

    # -- internals -----------------------------------------------------------------------------
    def _add(self) -> None:
        verifier_id = f"{self.config.name}-{self._next_index}"
        # Each replica picks its own free port: several may share a node.
        config = dataclasses.replace(self.verifier, verifier_id=verifier_id, port=0)
        actor = self._actor_class.remote()
        self.replicas[verifier_id] = Replica(self._next_index, verifier_id, actor, actor.start.remote(config))
        self._next_index += 1

    def _poll_starting(self, timeout_s: float, raise_on_failure: bool = False) -> None:
        starting = {r.ready: r for r in self.in_state("starting")}
        if not starting:
            return
        done, _ = ray.wait(list(starting), num_returns=len(starting), timeout=timeout_s)
        for ref in done:
            replica = starting[ref]
            try:
                _, replica.address = ray.get(ref)
            except Exception as e:
                log.error("pool %s: replica %s failed to start: %s", self.config.name, replica.verifier_id, e)
                self._remove(replica)
                if raise_on_failure:
                    raise
                continue
            replica.state, replica.ready = "serving", None
            log.info("pool %s: %s serves on %s", self.config.name, replica.verifier_id, replica.address)

    def _poll_draining(self, timeout_s: float = 0.0) -> None:
        draining = {r.ready: r for r in self.in_state("draining")}
        if not draining:
            return
        done, _ = ray.wait(list(draining), num_returns=len(draining), timeout=timeout_s)
        now = time.monotonic()
        for ref, replica in draining.items():
            if ref not in done and now < replica.drain_deadline:
                continue
            try:
                still_open = ray.get(ref, timeout=0) if ref in done else "?"
            except Exception as e:  # it died while draining: nothing left to wait for
                still_open = f"? ({type(e).__name__})"
            log.info(
                "pool %s: %s drained (%s streams still open), stopping",
                self.config.name,
                replica.verifier_id,
                still_open,
            )
            self._remove(replica)

    def _remove(self, replica: Replica) -> None:
        ray.kill(replica.actor)
        del self.replicas[replica.verifier_id]

    def _loads(self, replicas: list[Replica], timeout_s: float = 5.0) -> dict[str, int]:
        """Active sessions per serving replica; a replica that no longer answers is dead and removed."""
        refs = {r.actor.load.remote(): r for r in replicas}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        loads = {}
        for ref in done:
            try:
                loads[refs[ref].verifier_id] = ray.get(ref)[0]
            except ray.exceptions.RayActorError:
                log.warning("pool %s: %s died", self.config.name, refs[ref].verifier_id)
                self._remove(refs[ref])
        return loads  # a slow replica is simply not counted this time

    def _measure(self) -> float:
        return float(sum(self._loads(self.in_state("serving")).values()))


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str], env=None) -> tuple[PoolConfig, VerifierConfig]:
    """Split one command line between PoolConfig and VerifierConfig flags (every flag takes a value)."""
    if "-h" in argv or "--help" in argv:
        print("pool flags (RSD_POOL_<FIELD>), then verifier flags (RSD_VERIFIER_<FIELD>):\n")
        for cls, name in ((PoolConfig, "pool"), (VerifierConfig, "verifier")):
            with contextlib.suppress(SystemExit):
                load_config(cls, name, ["--help"])
        raise SystemExit(0)
    pool_flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(PoolConfig)}
    pool_argv: list[str] = []
    verifier_argv: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        flag = arg.split("=", 1)[0]
        target = pool_argv if flag in pool_flags else verifier_argv
        target.append(arg)
        if "=" not in arg and args and arg.startswith("--"):
            target.append(args.pop(0))
    env = os.environ if env is None else env
    return load_config(PoolConfig, "pool", pool_argv, env=env), load_config(
        VerifierConfig, "verifier", verifier_argv, env=env
    )


def main(argv: Sequence[str] | None = None) -> None:
    try:  # like rsd_service.serving.run_service: a bad flag or value ends the process with the reason
        pool_config, verifier_config = parse_args(sys.argv[1:] if argv is None else argv)
        pool = ReplicaPool(verifier_config, pool_config)  # checks the configs before Ray starts
    except ValueError as e:
        raise SystemExit(f"pool: {e}") from None
    setup_logging(verifier_config.log_format)
    ray.init(address=pool_config.ray_address or None)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        pool.start()
        while not stopping:
            pool.step()
            time.sleep(pool_config.interval_s)
    finally:
        log.info("pool %s: stopping, draining %d replicas", pool_config.name, pool.size)
        pool.close()
        ray.shutdown()


if __name__ == "__main__":
    main()

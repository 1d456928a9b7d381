"""Prometheus metrics of every rsd service, defined here and nowhere else.

Each server handle owns one ServiceMetrics with a registry of its own (two servers in one test
process do not collide) and, when its config's metrics_port is set, prometheus_client's HTTP
exporter on it. CallInterceptor wraps every RPC (health and reflection excepted): it counts calls
by method and status code, times them, puts the method, session and request ids into the log
context (rsd_service.logs.log_context), and hands each response to the service's observer.

    metrics = GatewayMetrics(engine)                          # or VerifierMetrics / DrafterMetrics
    server = await start_server(..., interceptors=[metrics.interceptor(), *auth])
    port = metrics.serve(host, config.metrics_port)           # GET http://host:port/metrics
    metrics.close()

Names: rsd_<service>_<what>_<unit>; counters end in _total (prometheus_client adds it).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rsd_service.logs import log_context
from rsd_service.security import EXEMPT_PREFIXES

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_COUNT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64, 128, 256, 512, 1024)


class ServiceMetrics:
    """Per-call metrics every service has; subclasses add their own and observe responses."""

    def __init__(self, service: str):
        self.service = service
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"rsd_{service}_requests", "RPCs by method and status code", ["method", "code"], registry=self.registry
        )
        self.request_seconds = Histogram(
            f"rsd_{service}_request_seconds",
            "RPC duration by method (streams: until the last message)",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._http: Any = None
        self.port = 0

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter on host:port (0 = off); returns the bound port (0 when off)."""
        if port:
            self._http, _ = start_http_server(port, host, registry=self.registry)
            self.port = self._http.server_port
        return self.port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def interceptor(self) -> CallInterceptor:
        return CallInterceptor(self)

    def observer(self, method: str) -> Callable[[Any], None] | None:
        """A per-call callback for each response message of `method`, or None."""
        return None


class GatewayMetrics(ServiceMetrics):
    def __init__(self, engine: Any):
        super().__init__("gateway")
        r = self.registry
        Gauge("rsd_gateway_running_turns", "turns generating on this gateway", registry=r).set_function(
            lambda: engine.num_running
        )
        self.streams = Gauge("rsd_gateway_open_streams", "Generate streams open (turns and resumes)", registry=r)
        self.tokens = Counter("rsd_gateway_generated_tokens", "tokens streamed to clients", ["method"], registry=r)
        self.ttft = Histogram(
            "rsd_gateway_time_to_first_token_seconds",
            "from a Generate call to its first token",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.token_latency = Histogram(
            "rsd_gateway_token_latency_seconds",
            "time between deltas divided by their tokens (after the first)",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens_per_step = Histogram(
            "rsd_gateway_tokens_per_step",
            "tokens committed per target call: the block efficiency",
            ["method"],
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        # Speculative decoding per method, verification and acceptance rule (vLLM's spec_decode_* counters; the
        # sums of the per-response metrics.speculative_decoding, gateway.openai.schema.SpecDecodeMetrics):
        # acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts (steps).
        spec = ["method", "verification", "rule"]
        self.spec_drafts = Counter(
            "rsd_gateway_spec_decode_num_drafts", "steps: draft trees verified (target calls)", spec, registry=r
        )
        self.spec_draft_tokens = Counter(
            "rsd_gateway_spec_decode_num_draft_tokens", "drafted tree tokens (nodes after the root)", spec, registry=r
        )
        self.spec_accepted_tokens = Counter(
            "rsd_gateway_spec_decode_num_accepted_tokens", "draft tokens the acceptance rule kept", spec, registry=r
        )
        self.spec_emitted_tokens = Counter(
            "rsd_gateway_spec_decode_num_emitted_tokens",
            "tokens the steps committed (accepted + a correction or bonus, fewer at the end of a turn)",
            spec,
            registry=r,
        )
        self.spec_accepted_per_pos = Counter(
            "rsd_gateway_spec_decode_num_accepted_tokens_per_pos",
            "steps that accepted a draft token at depth position + 1 (0-based position)",
            [*spec, "position"],
            registry=r,
        )

    def _observe_step(self, labels: tuple[str, str, str], num_tokens: int, stats: Any) -> None:
        """One step's StepStats, under labels (method, verification, rule)."""
        self.tokens_per_step.labels(labels[0]).observe(num_tokens)
        self.spec_drafts.labels(*labels).inc()
        self.spec_draft_tokens.labels(*labels).inc(stats.num_draft_tokens)
        self.spec_accepted_tokens.labels(*labels).inc(stats.num_accepted_tokens)
        self.spec_emitted_tokens.labels(*labels).inc(num_tokens)
        for position in range(stats.num_accepted_tokens):
            self.spec_accepted_per_pos.labels(*labels, str(position)).inc()

    def observer(self, method: str) -> Callable[[Any], None] | None:
        if not method.endswith("/Generate"):
            return None
        t0 = time.perf_counter()
        state = {"method": "", "verification": "", "last": 0.0}
        self.streams.inc()

        def observe(event: Any) -> None:
            kind = event.WhichOneof("event")
            if kind == "started":
                state["method"] = event.started.params.method.name or "?"
                state["verification"] = event.started.params.verification or "token"
            elif kind == "finished":
                self.streams.dec()
                state["last"] = -1.0  # closed: do not decrement twice
            elif kind == "delta":
                name, now, n = state["method"] or "?", time.perf_counter(), len(event.delta.token_ids)
                if event.delta.HasField("stats"):  # as the per-response object counts: every step
                    stats = event.delta.stats
                    labels = (name, state["verification"] or "token", stats.verifier.rule or "?")
                    self._observe_step(labels, n, stats)
                if not n:
                    return
                self.tokens.labels(name).inc(n)
                if not state["last"]:
                    self.ttft.labels(name).observe(now - t0)
                elif state["last"] > 0:
                    self.token_latency.labels(name).observe((now - state["last"]) / n)
                state["last"] = now

        def end() -> None:
            if state["last"] >= 0:
                self.streams.dec()
                state["last"] = -1.0  # once

        observe.end = end  # type: ignore[attr-defined]
        return observe


class VerifierMetrics(ServiceMetrics):
    def __init__(self, servicer: Any, batcher: Any):
        super().__init__("verifier")
        r = self.registry
        Gauge("rsd_verifier_sessions", "sessions attached (holding a KV slot)", registry=r).set_function(
            lambda: servicer.num_sessions
        )
        Gauge("rsd_verifier_queue_depth", "trees waiting for a forward", registry=r).set_function(
            lambda: batcher.num_queued
        )
        Gauge(
            "rsd_verifier_shared_prefix_tokens",
            "prefix tokens (e.g. the prompt of n > 1 choices) read off another session's KV slot instead of "
            "computed, since start (monotonic)",
            registry=r,
        ).set_function(lambda: servicer.engine.num_shared_tokens)
        self.trees_per_forward = Histogram(
            "rsd_verifier_batch_trees", "trees (sessions) packed into one forward", buckets=_COUNT_BUCKETS, registry=r
        )
        self.nodes_per_forward = Histogram(
            "rsd_verifier_batch_nodes",
            "tokens (tree nodes + prefill) in one forward",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        self.tree_nodes = Histogram(
            "rsd_verifier_tree_nodes", "tokens one session's step adds to a forward", buckets=_COUNT_BUCKETS, registry=r
        )
        self.forward_seconds = Histogram(
            "rsd_verifier_forward_seconds",
            "one packed target forward + acceptance",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        batcher.on_forward = self.on_forward

    def on_forward(self, nodes_per_tree: list[int], seconds: float) -> None:
        self.trees_per_forward.observe(len(nodes_per_tree))
        self.nodes_per_forward.observe(sum(nodes_per_tree))
        for n in nodes_per_tree:
            self.tree_nodes.observe(n)
        self.forward_seconds.observe(seconds)


class DrafterMetrics(ServiceMetrics):
    def __init__(self, engine: Any):
        super().__init__("drafter")
        r = self.registry
        Gauge("rsd_drafter_running", "runs in progress", registry=r).set_function(lambda: engine.num_running)
        # Batched drafting (rsd_runtime.packed): model forwards run, and the sessions' forwards they served.
        packed = getattr(engine, "packer", None)
        if packed is not None:
            Gauge("rsd_drafter_packed_forwards", "draft model forwards run (packed)", registry=r).set_function(
                lambda: packed.stats.forwards
            )
            Gauge(
                "rsd_drafter_packed_session_forwards", "sessions' draft forwards those served", registry=r
            ).set_function(lambda: packed.stats.calls)
        self.draft_seconds = Histogram(
            "rsd_drafter_draft_seconds", "drafting one tree", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.round_trip_seconds = Histogram(
            "rsd_drafter_verify_round_trip_seconds",
            "a tree sent until its verdict",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Pre-drafting (drafter_service.engine): verdicts whose next tree was drafted ahead (hits), verdicts
        # with trees drafted ahead but none for them (misses), draft forwards of trees never sent.
        self.predraft_hits = Counter(
            "rsd_drafter_predraft_hits", "verdicts whose next tree was pre-drafted", registry=r
        )
        self.predraft_misses = Counter(
            "rsd_drafter_predraft_misses", "verdicts none of whose pre-drafted trees matched", registry=r
        )
        self.wasted_draft_forwards = Counter(
            "rsd_drafter_wasted_draft_forwards", "draft forwards of pre-drafted trees never sent", registry=r
        )

    def observer(self, method: str) -> Callable[[Any], None] | None:
        if not method.endswith("/Run"):
            return None

        def observe(event: Any) -> None:
            if event.HasField("stats"):
                stats = event.stats
                self.draft_seconds.observe(stats.draft_ms / 1000)
                self.round_trip_seconds.observe(stats.round_trip_ms / 1000)
                self.predraft_hits.inc(stats.predraft_hit)
                self.predraft_misses.inc(stats.num_predrafted_trees > 0 and not stats.predraft_hit)
                self.wasted_draft_forwards.inc(stats.wasted_draft_forwards)

        return observe


# ---------------------------------------------------------------------------------------------
# The interceptor


def _ids(request: Any) -> list[tuple[str, str]]:
    """session_id / request_id of a request message, where it has them (for the log context)."""
    ids = []
    for name in ("session_id", "request_id"):
        value = getattr(request, name, "")
        if isinstance(value, str) and value:
            ids.append((name, value))
    return ids


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times every RPC by status code, sets the log context, feeds the service's observer."""

    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
        behavior = {
            (False, False): handler.unary_unary,
            (False, True): handler.unary_stream,
            (True, False): handler.stream_unary,
            (True, True): handler.stream_stream,
        }[(streaming_in, streaming_out)]
        name = method.rsplit("/", 1)[-1]
        if inspect.isasyncgenfunction(behavior):
            wrapped = self._wrap_stream(behavior, method, name, streaming_in)
        elif inspect.iscoroutinefunction(behavior):
            wrapped = self._wrap_unary(behavior, method, name, streaming_in)
        else:  # a plain function (e.g. an unimplemented method of a generated base class): leave it
            return handler
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(streaming_in, streaming_out)]
        return make(
            wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    def _finish(self, name: str, context: Any, t0: float, error: BaseException | None) -> None:
        code = _code(context, error)
        self.metrics.requests.labels(name, code).inc()
        self.metrics.request_seconds.labels(name).observe(time.perf_counter() - t0)

    def _wrap_unary(self, behavior, method: str, name: str, streaming_in: bool):
        async def wrapped(request, context):
            token = log_context.set((("method", name), *([] if streaming_in else _ids(request))))
            t0, error = time.perf_counter(), None
            try:
                return await behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                self._finish(name, context, t0, error)
                _reset(token)

        return wrapped

    def _wrap_stream(self, behavior, method: str, name: str, streaming_in: bool):
        async def wrapped(request, context):
            token = log_context.set((("method", name), *([] if streaming_in else _ids(request))))
            t0, error = time.perf_counter(), None
            observe = self.metrics.observer(method)
            try:
                # aclosing: when the call is cancelled, the servicer's generator is closed right here
                # (its finally blocks free runners and slots), not whenever it is garbage collected.
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        if observe is not None:
                            observe(response)
                        yield response
            except BaseException as e:
                error = e
                raise
            finally:
                if observe is not None and hasattr(observe, "end"):
                    observe.end()
                self._finish(name, context, t0, error)
                _reset(token)

        return wrapped


def _reset(token: Any) -> None:
    with contextlib.suppress(ValueError):  # a generator closed from another context: nothing to undo there
        log_context.reset(token)


def _code(context: Any, error: BaseException | None) -> str:
    """The status the call ends with: what the servicer set or aborted with, else from the error."""
    code = None
    with contextlib.suppress(Exception):
        code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int) and code != 0:
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))
    if error is None:
        return "OK"
    if isinstance(error, (GeneratorExit, KeyboardInterrupt)) or type(error).__name__ == "CancelledError":
        return "CANCELLED"
    return "UNKNOWN"  # an unhandled exception: what gRPC answers for it

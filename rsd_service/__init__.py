"""Service kit: what every gRPC service here shares, and no model code (grpc, protobuf; torch is never imported).

Config dataclasses and their flag/env parsing (config, serving.load_config), server bootstrap with health,
reflection, limits and a graceful drain (serving), TLS / bearer tokens (security, pki), Prometheus metrics and
the call interceptor (metrics), core pinning (placement), the service registry and the one exception → gRPC
status table (registry, status), and the gateway client users call (client). Services build on it; it
imports only rsd_wire below it.
"""

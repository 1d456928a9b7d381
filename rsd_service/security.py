"""Who may talk to an rsd service, and over what: bearer tokens and TLS / mTLS, in one place.

Servers (rsd_service.serving.start_server) take a ServerSecurity, clients dial with a ClientSecurity:

    server = ServerSecurity(tls_cert="srv.pem", tls_key="srv.key", tls_ca="ca.pem", token="s3cret")
    # tls_cert + tls_key: TLS; tls_ca as well: clients must present a certificate that CA signed (mTLS);
    # token: every call needs the metadata `authorization: Bearer s3cret`, else UNAUTHENTICATED.
    peer = ClientSecurity(tls_ca="ca.pem", tls_cert="cli.pem", tls_key="cli.key", token="s3cret")
    async with channel("host:7001", peer) as ch: ...        # grpc.aio, the token sent on every call

Two secrets: the gateway's public API takes the clients' token (gateway `auth_token`), and the
internal hops (gateway -> drafter, gateway -> verifier, drafter -> verifier) a shared secret
(`internal_token` of every service). gRPC health and reflection stay open without a token (load
balancers and the compose healthcheck probe them), but not without TLS when TLS is on.
An empty token or no certificate means that check is off: the default, for local runs and tests.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from rsd_wire import GRPC_OPTIONS

log = logging.getLogger(__name__)

# Method prefixes that need no token: probes and tooling. (TLS still applies: it is the channel's.)
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.")


def read_secret(value: str, file: str, name: str) -> str:
    """A token given as a value (e.g. env RSD_GATEWAY_AUTH_TOKEN) or as a file holding it; "" = none."""
    if value and file:
        raise ValueError(f"give {name} or {name}_file, not both")
    if file:
        value = Path(file).read_text().strip()
        if not value:
            raise ValueError(f"{name}_file {file} is empty")
    if any(c.isspace() or not c.isprintable() for c in value):  # it travels as an ASCII header value
        raise ValueError(f"{name} must be printable without spaces")
    return value


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class ServerSecurity:
    """What a server demands: TLS (cert + key), client certificates (ca), a bearer token."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    token: str = field(default="", repr=False)  # never in a repr, hence never in a log

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("tls_ca (client certificates) needs tls_cert and tls_key")

    def credentials(self) -> grpc.ServerCredentials | None:
        """Server credentials for add_secure_port; None = plaintext."""
        if not self.tls_cert:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))],
            root_certificates=_read(self.tls_ca),
            require_client_auth=bool(self.tls_ca),
        )

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []


@dataclass(frozen=True)
class ClientSecurity:
    """How a client dials: TLS when tls_ca is set (the CA that signed the server), a client
    certificate for mTLS (tls_cert + tls_key), and the bearer token sent on every call."""

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("a client certificate needs tls_ca (TLS) as well")

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls_ca:
            return None
        return grpc.ssl_channel_credentials(_read(self.tls_ca), _read(self.tls_key), _read(self.tls_cert))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def server_security(config: Any, token_field: str) -> ServerSecurity:
    """The ServerSecurity of a service config (fields tls_cert, tls_key, tls_ca, <token_field>[_file])."""
    token = read_secret(getattr(config, token_field), getattr(config, f"{token_field}_file"), token_field)
    return ServerSecurity(config.tls_cert, config.tls_key, config.tls_ca, token)


def peer_security(config: Any) -> ClientSecurity:
    """How a service dials its peers (fields peer_tls_ca, peer_tls_cert, peer_tls_key, internal_token[_file])."""
    token = read_secret(config.internal_token, config.internal_token_file, "internal_token")
    return ClientSecurity(config.peer_tls_ca, config.peer_tls_cert, config.peer_tls_key, token)


# ---------------------------------------------------------------------------------------------
# Channels: the one place a client channel is made


def channel(
    address: str, security: ClientSecurity | None = None, options: Sequence[tuple[str, Any]] = GRPC_OPTIONS
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address`: TLS per `security`, its token added to every call."""
    security = security or ClientSecurity()
    interceptors = _token_interceptors(security.metadata()) if security.token else None
    credentials = security.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def sync_channel(
    address: str, security: ClientSecurity | None = None, options: Sequence[tuple[str, Any]] = GRPC_OPTIONS
) -> grpc.Channel:
    """The blocking twin of channel() (RsdClient): the caller sends security.metadata() itself."""
    credentials = (security or ClientSecurity()).credentials()
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def _with_metadata(details: grpc.aio.ClientCallDetails, extra: tuple[tuple[str, str], ...]):
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *extra)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _AddMetadata:
    def __init__(self, extra: tuple[tuple[str, str], ...]):
        self.extra = extra

    async def _call(self, continuation, client_call_details, request):
        return await continuation(_with_metadata(client_call_details, self.extra), request)


class _AddMetadataUnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AddMetadata._call


class _AddMetadataUnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AddMetadata._call


class _AddMetadataStreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AddMetadata._call


class _AddMetadataStreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AddMetadata._call


def _token_interceptors(extra: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    # grpc.aio files each interceptor under the first call kind it subclasses: one object per kind.
    kinds = (_AddMetadataUnaryUnary, _AddMetadataUnaryStream, _AddMetadataStreamUnary, _AddMetadataStreamStream)
    return [kind(extra) for kind in kinds]


# ---------------------------------------------------------------------------------------------
# The server side of the token


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without `authorization: Bearer <token>` with UNAUTHENTICATED (health and
    reflection exempt). Constant-time comparison; the token itself is never logged."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("TokenInterceptor needs a token")
        self._expected = token.encode()

    def check(self, metadata: Sequence[tuple[str, Any]] | None) -> str:
        """ "" when the metadata carries the token, else the reason it does not."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return "missing 'authorization: Bearer <token>' metadata"
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        scheme, _, credential = value.partition(" ")
        if scheme.lower() != "bearer" or not credential:
            return "authorization metadata must be 'Bearer <token>'"
        if not hmac.compare_digest(credential.strip().encode(), self._expected):
            return "invalid token"
        return ""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        reason = self.check(handler_call_details.invocation_metadata)
        if not reason:
            return handler
        log.warning("refused %s: %s", method, reason)
        return _refusing_handler(handler, reason)


def _refusing_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED with `reason`."""

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )

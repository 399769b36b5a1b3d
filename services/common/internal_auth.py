"""Who may call Keel's internal gRPC services: holders of the internal token,
peers with a certificate of the internal CA, or both.

Every internal call carries `x-keel-token` (all four call kinds: grpc.aio
files an interceptor under exactly one kind, so each kind has its own class)
and every internal server refuses a call without it, streaming or not, with
UNAUTHENTICATED and the reason `INTERNAL_AUTH_REQUIRED`. Only health stays
open, for probes; reflection is refused like any method, since it tells a
stranger what to call. With `KEEL_GRPC_TLS_*` the same channels run over TLS,
mutual when a CA is given.

`keel <service>` will not start without one of the two credentials
(`require_internal_auth`), nor with a token weaker than an API key may be
(`secret_weakness`: at least 24 characters, 10 of them different), since
the token opens every internal service; `keel up` makes a token per data dir.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common import settings_registry as registry
from services.common.config import Settings
from services.common.errors import rich_status

TOKEN_HEADER = "x-keel-token"
TOKEN_ENV = registry.KEEL_INTERNAL_TOKEN.name
# As strong as an API key must be (kernel.tenancy.key_weakness): the token
# opens more than any key does.
MIN_TOKEN_CHARS = 24
MIN_TOKEN_DISTINCT_CHARS = 10
UNAUTHENTICATED_REASON = "INTERNAL_AUTH_REQUIRED"
# Probes (kubelet, load balancers) hold no token; health tells nothing else.
OPEN_PREFIXES = ("/grpc.health.",)
TLS_ENV = tuple(
    s.name
    for s in (registry.KEEL_GRPC_TLS_CERT, registry.KEEL_GRPC_TLS_KEY, registry.KEEL_GRPC_TLS_CA)
)


class InternalAuthError(ValueError):
    """Internal auth is missing or half-configured; the message is one line
    naming the variables to set."""


# ------------------------------------------------------------------ TLS


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of one process's certificate, key and (optional) CA."""

    cert: bytes
    key: bytes
    ca: bytes | None

    @property
    def mutual(self) -> bool:
        return self.ca is not None


def _read_pem(variable: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise InternalAuthError(
            f"{variable}={path}: cannot read it ({error.strerror or error})"
        ) from None


def tls_material(settings: Settings) -> TlsMaterial | None:
    """The TLS files of `settings`, read; None when TLS is off. A certificate
    without its key (or the reverse), or a CA alone, is refused: half a TLS
    setup would otherwise fail later, on the first call, far from its cause."""
    if not settings.grpc_tls:
        return None
    if not settings.grpc_tls_cert or not settings.grpc_tls_key:
        values = (settings.grpc_tls_cert, settings.grpc_tls_key, settings.grpc_tls_ca)
        given = [name for name, value in zip(TLS_ENV, values, strict=True) if value]
        raise InternalAuthError(
            f"internal gRPC TLS is half configured ({', '.join(given)} set): "
            "KEEL_GRPC_TLS_CERT and KEEL_GRPC_TLS_KEY are both needed "
            "(and KEEL_GRPC_TLS_CA for mutual TLS)"
        )
    return TlsMaterial(
        cert=_read_pem("KEEL_GRPC_TLS_CERT", settings.grpc_tls_cert),
        key=_read_pem("KEEL_GRPC_TLS_KEY", settings.grpc_tls_key),
        ca=_read_pem("KEEL_GRPC_TLS_CA", settings.grpc_tls_ca) if settings.grpc_tls_ca else None,
    )


def server_credentials(material: TlsMaterial) -> grpc.ServerCredentials:
    """With a CA, a client must present a certificate it signed (mutual TLS)."""
    return grpc.ssl_server_credentials(
        [(material.key, material.cert)],
        root_certificates=material.ca,
        require_client_auth=material.mutual,
    )


def channel_credentials(material: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=material.ca,
        private_key=material.key,
        certificate_chain=material.cert,
    )


def secret_weakness(variable: str, value: str) -> str | None:
    """Why `value` is too weak to be the shared secret `variable`, in one
    line, or None. Keel's own credentials (the internal token, the tool
    tokens) follow the rule of an API key: a guessable one opens the door
    it guards."""
    if len(value) >= MIN_TOKEN_CHARS and len(set(value)) >= MIN_TOKEN_DISTINCT_CHARS:
        return None
    return (
        f"{variable} is too weak ({len(value)} characters, {len(set(value))} different): "
        f"it needs at least {MIN_TOKEN_CHARS} characters, {MIN_TOKEN_DISTINCT_CHARS} of them "
        "different (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
    )


def require_internal_auth(settings: Settings) -> None:
    """Raises InternalAuthError unless internal calls are authenticated: by a
    token strong enough (`secret_weakness`), or by mutual TLS (cert, key
    and CA). A weak token is refused even beside mutual TLS: it is sent on
    every call, and a service reached by token alone would accept it."""
    material = tls_material(settings)
    token = settings.internal_token
    weakness = secret_weakness(TOKEN_ENV, token) if token else None
    if weakness is not None:
        raise InternalAuthError(weakness)
    if token or (material is not None and material.mutual):
        return
    raise InternalAuthError(
        "internal gRPC would be open to any process that reaches it: set "
        f"{TOKEN_ENV} (at least {MIN_TOKEN_CHARS} random characters, the same for every "
        "service) or mutual TLS (KEEL_GRPC_TLS_CERT, KEEL_GRPC_TLS_KEY and KEEL_GRPC_TLS_CA); "
        "`keel up` makes a token by itself"
    )


# ------------------------------------------------------------------ server side


def _presented_token(metadata: Any) -> bytes | None:
    for key, value in metadata or ():
        if key == TOKEN_HEADER:
            return value if isinstance(value, bytes) else str(value).encode()
    return None


_REFUSED = rich_status(
    grpc.StatusCode.UNAUTHENTICATED,
    UNAUTHENTICATED_REASON,
    f"missing or wrong internal token ({TOKEN_HEADER})",
    {},
)


def _refusal(handler: Any) -> Any:
    """A handler of the same call kind as `handler` that only refuses: a
    unary refusal answering a streaming method would leave the caller's
    stream in a state it cannot read. Requests are not even deserialized."""

    async def refuse(_request: Any, context: Any) -> None:
        await context.abort_with_status(_REFUSED)

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(refuse)
    if not handler.request_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if not handler.response_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse)


class TokenServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses every call without the internal token, except health checks.
    Unknown methods are refused too, so a stranger cannot list them."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        presented = _presented_token(handler_call_details.invocation_metadata)
        # Constant time: how long the check takes says nothing about the token.
        if presented is not None and hmac.compare_digest(presented, self._token):
            return handler
        return _refusal(handler)


# ------------------------------------------------------------------ client side


class _TokenCarrier:
    """Adds the internal token to a call's metadata, whatever its kind: gRPC
    wants one interceptor object per kind, and each forwards the same way."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(TOKEN_HEADER, self._token)
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
        )

    async def _forward(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        # `request` is the request, or the request iterator of a client stream.
        return await continuation(self._with_token(client_call_details), request)


class TokenUnaryUnaryInterceptor(_TokenCarrier, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    intercept_unary_unary = _TokenCarrier._forward


class TokenUnaryStreamInterceptor(_TokenCarrier, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
    intercept_unary_stream = _TokenCarrier._forward


class TokenStreamUnaryInterceptor(_TokenCarrier, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[type-arg]
    # gRPC passes the request iterator by position; only its name differs.
    intercept_stream_unary = _TokenCarrier._forward  # type: ignore[assignment]


class TokenStreamStreamInterceptor(_TokenCarrier, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[type-arg]
    intercept_stream_stream = _TokenCarrier._forward  # type: ignore[assignment]


def token_interceptors(token: str) -> list[Any]:
    """One interceptor per call kind, each adding the token."""
    return [
        TokenUnaryUnaryInterceptor(token),
        TokenUnaryStreamInterceptor(token),
        TokenStreamUnaryInterceptor(token),
        TokenStreamStreamInterceptor(token),
    ]

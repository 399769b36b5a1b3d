"""A team's internal gRPC `keel.tools.v1.ToolService` as a tool source.

The target comes from a tenant's loadout: `host:port` is plaintext,
`grpcs://host:port` is TLS, verified against the CA file named by
`KEEL_TOOL_TLS_CA` when set and the system roots otherwise. Every call
carries the token the runner has for this target and tenant
(`KEEL_TOOL_TOKENS`, else `KEEL_TOOL_TOKEN`; agent_io.tools.tool_tokens) as
the metadata `x-keel-tool-token`. That token is a credential of its own on
purpose: a tenant chooses the target, so Keel's internal token must never be
sent to it, nor the token of another tenant's service.

Every call has a deadline (the call's timeout), and every failure is an
`is_error` outcome naming it: a timeout, a service unreachable or gone
mid-call, a refused token, an unknown tool, a malformed reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from agent_io.tools.base import ToolCall, ToolOutcome, ToolSpec
from keel.tools.v1 import tools_pb2 as pb
from keel.tools.v1 import tools_pb2_grpc as pb_grpc
from services.common import settings_registry as registry
from services.common.setting import read_text

__all__ = [
    "TLS_CA_ENV",
    "TLS_SCHEME",
    "TOKEN_METADATA",
    "GrpcSourceConfig",
    "GrpcToolSource",
    "ToolSourceError",
]

log = logging.getLogger(__name__)

TOKEN_METADATA = "x-keel-tool-token"
TLS_CA_ENV = registry.KEEL_TOOL_TLS_CA.name
TLS_SCHEME = "grpcs://"
PLAIN_SCHEME = "grpc://"
DEFAULT_LIST_TIMEOUT_S = 10.0
# Larger results are refused by the transport (RESOURCE_EXHAUSTED, an error
# outcome); the registry cuts what the model sees far below this.
MAX_MESSAGE_BYTES = 16 << 20
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Notice a peer that vanished without a FIN during a long call.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class ToolSourceError(Exception):
    """The tools of a source could not be listed (the message says why)."""


@dataclass(frozen=True)
class GrpcSourceConfig:
    name: str
    # "host:port" (plaintext) or "grpcs://host:port" (TLS).
    target: str
    # The token of this target and tenant (KEEL_TOOL_TOKENS, else
    # KEEL_TOOL_TOKEN; "" = send none).
    token: str = ""
    # PEM file of the CA a TLS target's certificate must chain to ("" = the
    # system roots); KEEL_TOOL_TLS_CA by default.
    tls_ca_file: str = field(
        default_factory=lambda: read_text(os.environ, registry.KEEL_TOOL_TLS_CA)
    )
    list_timeout_s: float = DEFAULT_LIST_TIMEOUT_S

    @property
    def tls(self) -> bool:
        return self.target.startswith(TLS_SCHEME)

    @property
    def address(self) -> str:
        """The target without its scheme, as gRPC dials it."""
        for scheme in (TLS_SCHEME, PLAIN_SCHEME):
            if self.target.startswith(scheme):
                return self.target[len(scheme) :]
        return self.target


def _open_channel(config: GrpcSourceConfig) -> grpc.aio.Channel:
    """Raises OSError when the CA file cannot be read."""
    if not config.tls:
        return grpc.aio.insecure_channel(config.address, options=_CHANNEL_OPTIONS)
    ca = Path(config.tls_ca_file).read_bytes() if config.tls_ca_file else None
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.aio.secure_channel(config.address, credentials, options=_CHANNEL_OPTIONS)


def _spec_from_pb(tool: pb.Tool) -> ToolSpec:
    """Raises ToolSourceError for a schema that is not a JSON object."""
    try:
        schema = json.loads(tool.input_schema_json or "{}")
    except ValueError as exc:
        raise ToolSourceError(
            f"tool {tool.name!r}: input_schema_json is not JSON ({exc})"
        ) from None
    if not isinstance(schema, dict):
        raise ToolSourceError(f"tool {tool.name!r}: input_schema_json is not a JSON object")
    return ToolSpec(tool.name, tool.description, schema)


class GrpcToolSource:
    """One ToolService: one channel, the tool list fetched once, a deadline
    on every call."""

    def __init__(self, config: GrpcSourceConfig) -> None:
        self._config = config
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ToolServiceAsyncStub | None = None
        self._specs: tuple[ToolSpec, ...] | None = None
        self._listing = asyncio.Lock()
        self._closed = False

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def config(self) -> GrpcSourceConfig:
        return self._config

    def _where(self) -> str:
        return f"tool service {self._config.name!r} at {self._config.target}"

    def _connect(self) -> pb_grpc.ToolServiceAsyncStub:
        """The stub on this source's one channel, opened on first use (not in
        __init__, so a source can be built outside an event loop)."""
        if self._closed:
            raise ToolSourceError(f"{self._where()} is closed")
        if self._stub is None:
            try:
                self._channel = _open_channel(self._config)
            except OSError as exc:
                raise ToolSourceError(
                    f"{self._where()}: cannot read the TLS CA {self._config.tls_ca_file!r}"
                    f" ({TLS_CA_ENV}): {exc}"
                ) from None
            self._stub = pb_grpc.ToolServiceStub(self._channel)
        return self._stub

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA, self._config.token),) if self._config.token else ()

    async def list_tools(self) -> Sequence[ToolSpec]:
        """The service's tools (fetched once, then cached); raises
        ToolSourceError naming the problem when they cannot be listed."""
        async with self._listing:
            if self._specs is None:
                stub = self._connect()
                timeout = self._config.list_timeout_s
                try:
                    reply = await stub.ListTools(
                        pb.ListToolsRequest(), timeout=timeout, metadata=self._metadata()
                    )
                except grpc.aio.AioRpcError as err:
                    message = self._failure(err, "listing tools", timeout)
                    raise ToolSourceError(message) from None
                if not isinstance(reply, pb.ListToolsResponse):  # undecodable: None
                    raise ToolSourceError(f"malformed reply from {self._where()} to ListTools")
                self._specs = tuple(_spec_from_pb(tool) for tool in reply.tools)
            return self._specs

    async def call(self, call: ToolCall, timeout_s: float) -> ToolOutcome:
        """Runs one call with `timeout_s` as its deadline; every failure is an
        error outcome."""
        label = f"{self._config.name}.{call.name}"
        try:
            arguments_json = json.dumps(dict(call.arguments))
        except (TypeError, ValueError) as exc:
            return ToolOutcome(f"{label}: arguments are not JSON: {exc}", is_error=True)
        deadline = Timestamp()
        deadline.FromNanoseconds(time.time_ns() + int(timeout_s * 1e9))
        request = pb.CallToolRequest(
            call_id=call.tool_call_id,
            name=call.name,
            arguments_json=arguments_json,
            idempotency_key=call.idempotency_key,
            session_id=call.session_id,
            deadline=deadline,
        )
        try:
            stub = self._connect()
            reply = await stub.CallTool(request, timeout=timeout_s, metadata=self._metadata())
        except ToolSourceError as exc:
            return ToolOutcome(f"{label} failed: {exc}", is_error=True)
        except grpc.aio.AioRpcError as err:
            problem = self._failure(err, call.name, timeout_s)
            return ToolOutcome(f"{label} failed: {problem}", is_error=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # anything else from the transport is still a result
            log.warning(
                "%s: unexpected failure calling %s", self._where(), call.name, exc_info=True
            )
            return ToolOutcome(f"{label} failed: {type(exc).__name__}: {exc}", is_error=True)
        return self._outcome(label, reply)

    def _outcome(self, label: str, reply: pb.CallToolResponse) -> ToolOutcome:
        # grpc.aio hands back None for a reply that is not a CallToolResponse
        # on the wire (it logs the decoding error).
        if not isinstance(reply, pb.CallToolResponse):
            problem = f"malformed reply from {self._where()}: not a CallToolResponse"
            return ToolOutcome(f"{label} failed: {problem}", is_error=True)
        if not reply.HasField("structured_json"):
            return ToolOutcome(reply.content, is_error=reply.is_error)
        try:
            structured = json.loads(reply.structured_json)
        except ValueError as exc:
            problem = f"structured_json is not JSON ({exc})"
        else:
            if isinstance(structured, dict):
                content = reply.content or reply.structured_json
                return ToolOutcome(content, is_error=reply.is_error, structured=structured)
            problem = "structured_json is not a JSON object"
        return ToolOutcome(
            f"{label} failed: malformed reply from {self._where()}: {problem}", is_error=True
        )

    def _failure(self, err: grpc.aio.AioRpcError, what: str, timeout_s: float) -> str:
        """What went wrong, in words the model (and an operator) can act on."""
        code, details = err.code(), err.details() or ""
        where = self._where()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"{what} timed out after {timeout_s:g} s ({where})"
        if code is grpc.StatusCode.UNAVAILABLE:
            return f"{where} is unreachable or went away mid-call: {details}"
        if code is grpc.StatusCode.UNAUTHENTICATED:
            return (
                f"authentication refused by {where} (check the runner's KEEL_TOOL_TOKENS "
                f"and KEEL_TOOL_TOKEN, sent as {TOKEN_METADATA}): {details}"
            )
        if code is grpc.StatusCode.PERMISSION_DENIED:
            return f"permission denied by {where}: {details}"
        if code is grpc.StatusCode.NOT_FOUND:
            return f"unknown tool {what!r} at {where}"
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return f"invalid arguments for {what}: {details}"
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return f"{where} replied with more than the limit of {MAX_MESSAGE_BYTES} bytes"
        if code is grpc.StatusCode.UNIMPLEMENTED:
            return f"{where} does not implement keel.tools.v1.ToolService: {details}"
        return f"{where} failed with {code.name}: {details}"

    async def aclose(self) -> None:
        self._closed = True
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close(None)

"""Serve plain Python functions as a `keel.tools.v1.ToolService`.

Each function becomes one tool: its name, its docstring as the description,
and a JSON schema of its arguments built from its type hints::

    from typing import Literal
    from keel_tools import serve_tools

    def refund(order_id: str, amount: float, reason: Literal["damaged", "late"] = "late",
               *, idempotency_key: str) -> dict[str, object]:
        \"\"\"Refunds part of an order.\"\"\"
        return billing.refund(order_id, amount, reason, key=idempotency_key)

    serve_tools([refund], port=7000)   # token from KEEL_TOOL_TOKEN, if set

It listens on loopback unless told otherwise. Any other address (`0.0.0.0`,
a LAN address) needs a token, since whoever reaches it could call every
tool: without one, `ToolServer.start` and `serve_tools` refuse to start
(`UnsafeToolServer`), as they do for a token shorter than 24 characters or
with fewer than 10 different ones. The runner sends the token it has for
this target (`KEEL_TOOL_TOKENS`, else `KEEL_TOOL_TOKEN`).

A call is at-least-once (a runner that crashed mid-call calls again after
its successor takes over), so a tool with an effect takes the keyword
parameter `idempotency_key` and applies its effect once per key; it may also
take `session_id`. Both are filled from the request and are not part of the
schema the model sees.

A function may be sync (run in a worker thread, so a slow one does not
block the others) or async. Its exception becomes an `is_error` result with
its message; a `str` return value is the result text, anything else is sent
as structured JSON plus its JSON text.

How a function becomes a tool (its schema, the check of its arguments) is
keel_tools/definitions.py; this module serves the tools and guards access.
This module depends only on grpcio, the health service and the generated
contract in `keel/`, never on Keel's own servers.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import ipaddress
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from keel.tools.v1 import tools_pb2 as pb
from keel.tools.v1 import tools_pb2_grpc as pb_grpc
from keel_tools.definitions import (
    ToolDefinition,
    arguments_problem,
    define_tool,
    schema_of,
    schema_problem,
)

__all__ = [
    "TOKEN_ENV",
    "TOKEN_METADATA",
    "ToolDefinition",
    "ToolServer",
    "UnsafeToolServer",
    "define_tool",
    "schema_of",
    "schema_problem",
    "serve_tools",
]

log = logging.getLogger(__name__)

TOKEN_ENV = "KEEL_TOOL_TOKEN"
TOKEN_METADATA = "x-keel-tool-token"
SERVICE_NAME = "keel.tools.v1.ToolService"
# Room for large results; the runner cuts what the model sees on its side.
MAX_MESSAGE_BYTES = 16 << 20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
# A token as strong as Keel asks of its own (an API key, the internal token).
MIN_TOKEN_CHARS = 24
MIN_TOKEN_DISTINCT_CHARS = 10
LOOPBACK = "127.0.0.1"


class UnsafeToolServer(ValueError):
    """The server would take calls it should not: a non-loopback address
    without a token, or a token that is easy to guess."""


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a wildcard ("", "0.0.0.0" is one) or a host name
        return False


def _check_token(token: str) -> None:
    if not token:
        return
    if len(token) < MIN_TOKEN_CHARS or len(set(token)) < MIN_TOKEN_DISTINCT_CHARS:
        raise UnsafeToolServer(
            f"the tool token ({TOKEN_ENV}) is too weak ({len(token)} characters, "
            f"{len(set(token))} different): it needs at least {MIN_TOKEN_CHARS} characters, "
            f"{MIN_TOKEN_DISTINCT_CHARS} of them different (e.g. "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )


def _result_response(value: Any) -> pb.CallToolResponse:
    """A return value as the model will see it: text as is; anything else as
    its JSON text plus structured JSON (an object: other values are wrapped
    as {"result": value})."""
    if isinstance(value, str):
        return pb.CallToolResponse(content=value)
    if value is None:
        return pb.CallToolResponse(content="")
    try:
        text = json.dumps(value)
        structured = json.dumps(value if isinstance(value, dict) else {"result": value})
    except (TypeError, ValueError) as exc:
        return pb.CallToolResponse(content=f"result is not JSON: {exc}", is_error=True)
    return pb.CallToolResponse(content=text, structured_json=structured)


class _ToolServicer(pb_grpc.ToolServiceServicer):
    def __init__(self, tools: Mapping[str, ToolDefinition], token: str) -> None:
        self._tools = tools
        self._token = token.encode()

    async def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if not self._token:
            return
        sent = b""
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA:
                sent = value.encode() if isinstance(value, str) else value
        if not hmac.compare_digest(sent, self._token):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_METADATA} metadata"
            )

    async def ListTools(
        self, request: pb.ListToolsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListToolsResponse:
        await self._authenticate(context)
        return pb.ListToolsResponse(tools=[tool.to_pb() for tool in self._tools.values()])

    async def CallTool(
        self, request: pb.CallToolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CallToolResponse:
        await self._authenticate(context)
        tool = self._tools.get(request.name)
        if tool is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tool {request.name!r}")
        try:
            arguments = json.loads(request.arguments_json or "{}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"arguments_json: {exc}")
        if not isinstance(arguments, dict):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "arguments_json is not a JSON object"
            )
        problem = arguments_problem(tool, arguments)
        if problem:
            return pb.CallToolResponse(content=f"invalid arguments: {problem}", is_error=True)
        filled = {"idempotency_key": request.idempotency_key, "session_id": request.session_id}
        for parameter in tool.request_parameters:
            arguments[parameter] = filled[parameter]
        return await self._run(tool, arguments)

    async def _run(self, tool: ToolDefinition, arguments: dict[str, Any]) -> pb.CallToolResponse:
        try:
            bound = inspect.signature(tool.function).bind(**arguments)
        except TypeError as exc:
            return pb.CallToolResponse(content=f"invalid arguments: {exc}", is_error=True)
        try:
            if inspect.iscoroutinefunction(tool.function):
                value = await tool.function(*bound.args, **bound.kwargs)
            else:
                value = await asyncio.to_thread(tool.function, *bound.args, **bound.kwargs)
                if inspect.isawaitable(value):  # e.g. a partial of an async function
                    value = await value
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the tool's failure is the model's information
            log.info("tool %s failed: %r", tool.name, exc)
            return pb.CallToolResponse(content=f"{type(exc).__name__}: {exc}", is_error=True)
        return _result_response(value)


class ToolServer:
    """A gRPC server offering `functions` as a ToolService (plus health).

    With a token (the argument, else KEEL_TOOL_TOKEN), a call without the
    matching `x-keel-tool-token` metadata is refused with UNAUTHENTICATED;
    health checks need no token. Without a token it serves on loopback only.
    Raises UnsafeToolServer for a weak token.
    """

    def __init__(
        self, functions: Iterable[Callable[..., Any]], *, token: str | None = None
    ) -> None:
        tools: dict[str, ToolDefinition] = {}
        for function in functions:
            tool = define_tool(function)
            if tool.name in tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            tools[tool.name] = tool
        self.tools: Mapping[str, ToolDefinition] = tools
        self._token = os.environ.get(TOKEN_ENV, "") if token is None else token
        _check_token(self._token)
        self._server: grpc.aio.Server | None = None
        self.port = 0
        self.host = ""

    @property
    def address(self) -> str:
        """host:port as a client dials it (loopback for a wildcard host)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "[::]", "") else self.host
        return f"{host}:{self.port}"

    async def start(
        self,
        host: str = LOOPBACK,
        port: int = 0,
        credentials: grpc.ServerCredentials | None = None,
    ) -> int:
        """Binds and starts serving (port 0: any free port); returns the port.
        With `credentials` (grpc.ssl_server_credentials) it serves TLS.
        Raises UnsafeToolServer for a non-loopback `host` without a token."""
        if not self._token and not _loopback(host):
            raise UnsafeToolServer(
                f"refusing to serve tools on {host or 'every address'} without a token: "
                f"anyone who reaches it could call them. Set {TOKEN_ENV} (the runner sends "
                f"it as {TOKEN_METADATA}) or serve on {LOOPBACK}"
            )
        server = grpc.aio.server(options=_OPTIONS)
        pb_grpc.add_ToolServiceServicer_to_server(_ToolServicer(self.tools, self._token), server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        address = f"{host}:{port}"
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
        if bound == 0:
            raise OSError(f"cannot bind a ToolService to {address}")
        await server.start()
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server, self.host, self.port = server, host, bound
        if not self._token:
            log.warning(
                "serving tools on %s without a token: any local process may call them", address
            )
        return bound

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def __aenter__(self) -> ToolServer:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def serve_tools(
    functions: Iterable[Callable[..., Any]],
    *,
    port: int,
    host: str = LOOPBACK,
    token: str | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> None:
    """Serves `functions` as a ToolService until the process is stopped: on
    loopback by default; another `host` (e.g. "0.0.0.0" in a container)
    needs a token (`token`, else KEEL_TOOL_TOKEN), or UnsafeToolServer is
    raised before anything listens."""

    async def main() -> None:
        server = ToolServer(functions, token=token)
        await server.start(host, port, credentials)
        log.info("serving tools %s on %s:%d", ", ".join(server.tools), host, server.port)
        try:
            await server.wait_for_termination()
        finally:
            await server.stop()

    asyncio.run(main())

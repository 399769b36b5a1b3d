"""MCP servers as a tool source, through the official `mcp` SDK.

A stdio server is a child process of the runner: started on first use,
started again on the next use after it exited, and stopped by `aclose()`
(drain and shutdown). Its environment is PATH, HOME and LANG of the runner
plus the loadout's resolved `env`, nothing else: the runner's other
variables hold its secrets. It starts inside a sandbox that keeps the
runner's secrets out of its reach (agent_io.tools.child_sandbox). Each line
the server writes on stderr becomes one record of the `agent_io.tools.mcp_streams`
logger, prefixed with the server's name.

A streamable-HTTP server gets the resolved headers on every request. One
that no longer knows the client's session (it restarted) gets a new session
and the refused request again, as the MCP spec asks of a client; one that
cannot be reached fails the call, and the next use connects anew, as a
stdio server that exited is started again.

The SDK's client is a nest of async context managers and task groups that
must be left by the task that entered them, while calls and `aclose()` come
from any task; so each connection is owned by a task of its own and callers
only send requests through its session (agent_io.tools.mcp_streams holds
the streams around it). A call carries the idempotency key
in the request `_meta` as `keel/idempotencyKey`. Every way a call can fail
(timeout, server unreachable or gone mid-call, protocol error, malformed
result) is an error outcome naming the problem. Size limits are applied by
the registry, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Literal, TextIO, TypeVar, cast

import anyio
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client import Transport
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import MCP_SESSION_ID, streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, CallToolResult, Implementation, RequestParamsMeta
from pydantic import ValidationError

from agent_io.tools import child_sandbox
from agent_io.tools.base import BlobSink, ToolCall, ToolOutcome, ToolSpec
from agent_io.tools.child_sandbox import ChildLaunch
from agent_io.tools.mcp_results import MalformedResult, outcome_from_result
from agent_io.tools.mcp_streams import StderrLog, watched

if TYPE_CHECKING:  # the SDK's own names for these types live in private modules
    from mcp.client._transport import TransportStreams

__all__ = ["IDEMPOTENCY_META_KEY", "BlobSink", "McpServerConfig", "McpSource", "McpSourceError"]

IDEMPOTENCY_META_KEY = "keel/idempotencyKey"
INHERITED_VARIABLES = ("PATH", "HOME", "LANG")
CLIENT_INFO = Implementation(name="keel-runner", version="1")
# Bound on the whole listing, and on starting a server before its first use.
DEFAULT_CONNECT_TIMEOUT_S = 30.0
# How long a caller waits to learn why a connection ended.
_FAILURE_GRACE_S = 2.0
_LIST_PAGE_CAP = 100
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class McpServerConfig:
    """One MCP server of a loadout, with its variables already resolved."""

    name: str
    transport: Literal["stdio", "http"]
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    url: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    log_name: str = ""
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S

    @property
    def label(self) -> str:
        return self.log_name or self.name


class McpSourceError(Exception):
    """The server could not be reached or listed (raised by `list_tools` only)."""


class McpSource:
    """The tools of one MCP server; one instance per tenant and loadout revision."""

    def __init__(self, config: McpServerConfig, blob_sink: BlobSink | None = None) -> None:
        self._config = config
        self._blob_sink = blob_sink
        self._specs: tuple[ToolSpec, ...] | None = None
        self._listing = asyncio.Lock()
        self._opening = asyncio.Lock()
        self._connection: _Connection | None = None
        self._closed = False

    @property
    def name(self) -> str:
        return self._config.name

    async def list_tools(self) -> Sequence[ToolSpec]:
        """The server's tools, fetched on first use and cached after that; a
        failure raises `McpSourceError` naming it, and the next use tries again."""
        async with self._listing:
            if self._specs is None:
                self._specs = await self._fetch_specs()
            return self._specs

    async def _fetch_specs(self) -> tuple[ToolSpec, ...]:
        timeout_s = self._config.connect_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                return await self._on_session(_list_all)
        except TimeoutError:
            raise McpSourceError(
                f"{self._describe()}: no tool list within {timeout_s:g} s"
            ) from None
        except Exception as exc:
            raise McpSourceError(f"{self._describe()}: {_reason(exc)}") from None

    async def call(self, call: ToolCall, timeout_s: float) -> ToolOutcome:
        # `_meta` is an open map on the wire; the SDK's TypedDict names only the reserved keys.
        meta = cast(RequestParamsMeta, {IDEMPOTENCY_META_KEY: call.idempotency_key})

        async def call_tool(client: Client) -> CallToolResult:
            return await client.call_tool(call.name, dict(call.arguments), meta=meta)

        try:
            async with asyncio.timeout(timeout_s):
                result = await self._on_session(call_tool)
                return await outcome_from_result(result, self._blob_sink)
        except TimeoutError:
            return self._error(call, f"no result within {timeout_s:g} s")
        except _WentAway as exc:
            return self._error(call, f"the server went away during the call ({exc})")
        except _Unavailable as exc:
            return self._error(call, f"server unavailable: {exc}")
        except MCPError as exc:
            return self._error(call, f"MCP error {exc.code}: {exc.error.message}")
        except (ValidationError, MalformedResult) as exc:
            return self._error(call, f"malformed result: {_reason(exc)}")
        except Exception as exc:  # the SDK's other refusals (output schema, input rounds)
            return self._error(call, f"failed: {_reason(exc)}")

    async def _on_session(self, use: Callable[[Client], Awaitable[_T]]) -> _T:
        """`use(client)` on the live session. When the server no longer knows
        the session (it restarted, or expired it), a new session is started
        and `use` runs again, once: the server refused the first request
        without running it (the spec's answer to a 404)."""
        try:
            return await self._use(await self._open(), use)
        except _SessionLost as lost:
            log.info("%s: %s; starting a new session", self._config.label, lost)
        try:
            return await self._use(await self._open(), use)
        except _SessionLost as lost:
            raise lost.error from None

    async def _use(self, connection: _Connection, use: Callable[[Client], Awaitable[_T]]) -> _T:
        client = await connection.client()
        try:
            return await use(client)
        except MCPError as exc:
            # First: some servers refuse an unknown session with the code
            # the SDK also uses for a closed connection (-32000).
            if await connection.session_lost(client):
                raise _SessionLost(exc) from None
            if exc.code == CONNECTION_CLOSED:
                raise _WentAway(await connection.ended_because(exc.error.message)) from None
            raise

    async def aclose(self) -> None:
        self._closed = True
        async with self._opening:
            if self._connection is not None:
                await self._connection.aclose()

    def _error(self, call: ToolCall, problem: str) -> ToolOutcome:
        return ToolOutcome(f"{self._config.name}.{call.name}: {problem}", is_error=True)

    def _describe(self) -> str:
        where = self._config.url if self._config.transport == "http" else "stdio"
        return f"MCP server {self._config.name!r} ({where})"

    async def _open(self) -> _Connection:
        """The live connection, or a new one when there is none (or it ended)."""
        async with self._opening:
            if self._closed:
                raise _Unavailable("the tool source is closed")
            current = self._connection
            if current is None or current.ended:
                if current is not None:
                    await current.aclose()  # the old child is gone before a new one starts
                current = _Connection(self._config)
                self._connection = current
            return current


class _Unavailable(Exception):
    """The connection could not be made, or was closed before it was."""


class _WentAway(Exception):
    """The connection ended during a request (the message says why)."""


class _SessionLost(Exception):
    """The server refused a request: it does not know the session."""

    def __init__(self, error: MCPError) -> None:
        super().__init__(f"the server no longer knows the session ({error.error.message})")
        self.error = error


async def _list_all(client: Client) -> tuple[ToolSpec, ...]:
    specs: list[ToolSpec] = []
    cursor: str | None = None
    for _ in range(_LIST_PAGE_CAP):
        page = await client.list_tools(cursor=cursor)
        specs.extend(ToolSpec(t.name, t.description or "", t.input_schema) for t in page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tuple(specs)


class _Connection:
    """One session with the server, entered and left by a task of its own."""

    def __init__(self, config: McpServerConfig) -> None:
        self._config = config
        self._ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._transport_ended = asyncio.Event()
        self._scope = anyio.CancelScope(deadline=anyio.current_time() + config.connect_timeout_s)
        self._failure: str | None = None
        # The last status a streamable-HTTP server refused this session with.
        self._refused: int | None = None
        self._forgotten = False
        self._task = asyncio.create_task(self._run(), name=f"mcp-{config.label}")

    @property
    def ended(self) -> bool:
        return self._task.done() or self._transport_ended.is_set() or self._stop.is_set()

    async def client(self) -> Client:
        return await asyncio.shield(self._ready)

    async def ended_because(self, seen: str) -> str:
        """Ends the connection, and says why it ended (what its task found, if
        it tells within a moment, else what the caller `seen`)."""
        self._stop.set()
        await asyncio.wait((self._task,), timeout=_FAILURE_GRACE_S)
        if self._failure:
            return self._failure
        generic = seen in ("", "Connection closed")
        return "its process exited or the connection closed" if generic else seen

    async def session_lost(self, client: Client) -> bool:
        """Whether the server has forgotten this session: it answered 404 to
        a request carrying the session id (the spec's "start a new session"),
        or 400 (some servers' answer to an unknown id) and then refused a
        second request too. A lost session's connection is ended (the next
        use starts a new one), and says so to every request that was on it."""
        if self._forgotten:
            return True
        refused, self._refused = self._refused, None
        if refused == HTTPStatus.BAD_REQUEST:
            with contextlib.suppress(MCPError):
                await client.list_tools()  # any request: ping is gone from newer protocols
            # Refused the same way: the session, not the request, was the problem.
            again, self._refused = self._refused, None
            refused = HTTPStatus.NOT_FOUND if again is not None else None
        if refused == HTTPStatus.NOT_FOUND:
            self._forgotten = True
            self._stop.set()
        return self._forgotten

    async def _saw_response(self, response: httpx2.Response) -> None:
        refusal = response.status_code in (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND)
        if refusal and MCP_SESSION_ID in response.request.headers:
            self._refused = response.status_code

    async def aclose(self) -> None:
        self._stop.set()
        if not self._ready.done():
            self._scope.cancel()  # still starting: stop waiting for it
        await asyncio.wait((self._task,))  # leaves the task alone if this caller is cancelled

    async def _run(self) -> None:
        try:
            with self._scope:
                async with AsyncExitStack() as stack:
                    client = await self._enter(stack)
                    self._scope.deadline = math.inf
                    self._ready.set_result(client)
                    stopping = asyncio.ensure_future(self._stop.wait())
                    ended = asyncio.ensure_future(self._transport_ended.wait())
                    try:
                        await asyncio.wait((stopping, ended), return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        stopping.cancel()
                        ended.cancel()
            if self._scope.cancelled_caught and not self._ready.done():
                self._failure = (
                    "closed while starting"
                    if self._stop.is_set()
                    else f"not started within {self._config.connect_timeout_s:g} s"
                )
        except Exception as exc:  # a dead server or connection is an outcome, not a crash
            self._failure = _reason(exc)
            log.warning("%s: connection ended: %s", self._config.label, self._failure)
        finally:
            if not self._ready.done():
                self._ready.set_exception(_Unavailable(self._failure or "closed while starting"))
                self._ready.exception()  # read here, so an unawaited start never warns

    async def _enter(self, stack: AsyncExitStack) -> Client:
        if self._config.transport == "stdio":
            transport = await self._stdio(stack)
        else:
            transport = await self._http(stack)
        client = Client(
            watched(transport, self._transport_ended), cache=None, client_info=CLIENT_INFO
        )
        return await stack.enter_async_context(client)

    async def _stdio(self, stack: AsyncExitStack) -> Transport:
        launch = _child_launch(self._config)
        stack.callback(launch.cleanup)  # runs last: after the server has stopped
        params = StdioServerParameters(
            command=launch.command, args=launch.args, env=launch.env, cwd=launch.cwd
        )
        read_fd, write_fd = os.pipe()
        errlog: TextIO = os.fdopen(write_fd, "w")
        try:
            reader = await StderrLog.start(read_fd, self._config.label)
        except BaseException:
            errlog.close()
            raise
        # Runs last: the server has stopped by then, so its stderr reaches EOF.
        stack.push_async_callback(reader.finish)
        inner = stdio_client(params, errlog=errlog)

        @asynccontextmanager
        async def spawned() -> AsyncIterator[TransportStreams]:
            try:
                async with inner as streams:
                    errlog.close()  # the child holds its own copy now
                    yield streams
            finally:
                errlog.close()

        return spawned()

    async def _http(self, stack: AsyncExitStack) -> Transport:
        http = httpx2.AsyncClient(
            headers=dict(self._config.headers),
            timeout=httpx2.Timeout(30.0, read=300.0),
            event_hooks={"response": [self._saw_response]},
        )
        await stack.enter_async_context(http)
        return streamable_http_client(self._config.url, http_client=http)


def _child_launch(config: McpServerConfig) -> ChildLaunch:
    """How the server starts (agent_io.tools.child_sandbox), checked before
    anything starts."""
    if not config.command:
        raise _Unavailable("no command configured")
    env = {n: os.environ[n] for n in INHERITED_VARIABLES if n in os.environ}
    env.update(config.env)
    for name in env:
        if not _VARIABLE_NAME.fullmatch(name):
            raise _Unavailable(f"invalid environment variable name {name!r}")
    executable = shutil.which(config.command[0], path=env.get("PATH", os.defpath))
    if executable is None:
        raise _Unavailable(f"command not found: {config.command[0]!r}")
    try:
        return child_sandbox.launch(os.path.abspath(executable), config.command[1:], env)
    except child_sandbox.SandboxError as error:
        raise _Unavailable(str(error)) from None


def _reason(exc: BaseException) -> str:
    """A one-line description, looking through the task groups' exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, MCPError):
        return f"MCP error {exc.code}: {exc.error.message}"
    if isinstance(exc, ValidationError):
        return f"{exc.error_count()} validation error(s): {exc.errors()[0]['msg']}"
    # The first line: some messages go on with a whole schema or traceback.
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    return (
        text
        if isinstance(exc, _Unavailable | _WentAway | MalformedResult)
        else f"{type(exc).__name__}: {text}"
    )

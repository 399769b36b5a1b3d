"""MCP servers as a tool source: a real server written with the `mcp` SDK,
over stdio (a child process of the test) and over streamable HTTP on
loopback. Every failure is an error outcome, and a stdio child never
outlives its source or sees the runner's own variables."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agent_io.tools.base import ToolCall, ToolOutcome
from agent_io.tools.mcp import McpServerConfig, McpSource, McpSourceError
from tests.support.mcp_server import (
    RESOURCE_BYTES,
    HttpMcpServer,
    read_effects,
    server_command,
    server_env,
    tiny_png,
)
from tests.support.polling import eventually
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

TOKEN = "Bearer test-token"
CALL_TIMEOUT_S = 20.0
GONE_DEADLINE_S = 15.0


class MemoryBlobSink:
    """The blob sink of these tests: blobs kept in a dict."""

    def __init__(self) -> None:
        self.blobs: dict[str, tuple[bytes, str]] = {}

    async def store(self, data: bytes, media_type: str) -> str:
        blob_id = f"blob-{len(self.blobs) + 1}"
        self.blobs[blob_id] = (data, media_type)
        return blob_id


class Files:
    """The tool source under test, its blob sink and the server's own records."""

    def __init__(self, source: McpSource, sink: MemoryBlobSink, effects: Path, log: Path):
        self.source = source
        self.sink = sink
        self.effects = effects
        self.log = log

    async def call(
        self,
        name: str,
        idem: str = "idem-1",
        timeout_s: float = CALL_TIMEOUT_S,
        **arguments: object,
    ) -> ToolOutcome:
        return await self.source.call(ToolCall("call-1", name, arguments, idem), timeout_s)


def stdio_source(tmp_path: Path, env: dict[str, str] | None = None) -> Files:
    effects, log = tmp_path / "effects.sqlite", tmp_path / "server.log"
    config = McpServerConfig(
        name="files",
        transport="stdio",
        command=server_command("--effects", str(effects), "--log", str(log)),
        env={**server_env(), **(env or {})},
    )
    sink = MemoryBlobSink()
    return Files(McpSource(config, blob_sink=sink), sink, effects, log)


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpMcpServer, Path]]:
    """One HTTP server for the module (tests use their own keys), requiring a header."""
    where = tmp_path_factory.mktemp("mcp-http")
    server = HttpMcpServer(
        [
            *("--effects", str(where / "effects.sqlite")),
            *("--log", str(where / "server.log")),
            *("--require-header", f"Authorization:{TOKEN}"),
        ]
    )
    yield server, where
    server.stop()


@pytest.fixture(params=["stdio", "http"])
async def files(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Files]:
    if request.param == "stdio":
        served = stdio_source(tmp_path)
    else:
        server, where = request.getfixturevalue("http_server")
        config = McpServerConfig(
            name="files", transport="http", url=server.url, headers={"Authorization": TOKEN}
        )
        sink = MemoryBlobSink()
        served = Files(
            McpSource(config, blob_sink=sink), sink, where / "effects.sqlite", where / "server.log"
        )
    yield served
    await served.source.aclose()


async def wait_until_gone(pid: int) -> None:
    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    await eventually(gone, f"process {pid} to be gone", GONE_DEADLINE_S)


async def server_pid(files: Files) -> int:
    outcome = await files.call("environment")
    assert not outcome.is_error, outcome.content
    assert outcome.structured is not None
    return int(outcome.structured["pid"])


async def test_lists_the_tools_once(files: Files) -> None:
    specs = await files.source.list_tools()
    by_name = {spec.name: spec for spec in specs}
    assert {"echo", "add", "fail", "apply", "slow", "image", "die"} <= by_name.keys()
    assert by_name["echo"].description == "Returns the text it is given."
    assert by_name["echo"].parameters["properties"]["text"]["type"] == "string"
    assert await files.source.list_tools() is specs


async def test_text_structured_and_error_results(files: Files) -> None:
    echoed = await files.call("echo", text="hi there")
    assert (echoed.content, echoed.is_error) == ("hi there", False)

    added = await files.call("add", a=2, b=3)
    assert added.structured == {"sum": 5}
    assert added.content == "2 + 3 = 5"
    assert not added.is_error

    failed = await files.call("fail")
    assert failed.is_error
    assert failed.content == "this tool always fails"


async def test_images_and_binary_resources_become_blobs(files: Files) -> None:
    image = await files.call("image")
    assert not image.is_error
    [image_blob] = image.blobs
    assert files.sink.blobs[image_blob] == (tiny_png(), "image/png")
    assert image_blob in image.content and "image/png" in image.content

    parts = await files.call("resources")
    [resource_blob] = parts.blobs
    assert files.sink.blobs[resource_blob] == (RESOURCE_BYTES, "application/octet-stream")
    assert "a note" in parts.content  # an embedded text resource is text
    assert "https://example.invalid/report.pdf" in parts.content  # and so is a link


async def test_the_key_reaches_the_server_and_the_effect_applies_once(
    files: Files, request: pytest.FixtureRequest
) -> None:
    idem = f"idem-{request.node.callspec.id}"
    first = await files.call("apply", idem=idem, key="x")
    again = await files.call("apply", idem=idem, key="x")  # a retry of the same call
    assert (first.content, again.content) == ("x: applied", "x: already applied")
    assert read_effects(files.effects)[idem] == (1, 2)  # executed twice, applied once
    assert f"idempotencyKey={idem}" in files.log.read_text()


async def test_a_timeout_is_an_error_and_the_next_call_works(files: Files) -> None:
    slow = await files.call("slow", timeout_s=0.3, seconds=30)
    assert slow.is_error
    assert "no result within 0.3 s" in slow.content
    assert (await files.call("echo", text="still here")).content == "still here"


async def test_malformed_results_are_errors(files: Files) -> None:
    refused = await files.call("malformed")  # the SDK checks the tool's output schema
    assert refused.is_error
    assert "files.malformed" in refused.content and "integer" in refused.content

    undecodable = await files.call("undecodable")
    assert undecodable.is_error
    assert "malformed result: image data is not valid base64" in undecodable.content
    assert not files.sink.blobs


async def test_a_large_result_arrives_whole(files: Files) -> None:
    # Cutting is the registry's job (`limit_result`); the source hands it all over.
    big = await files.call("big", bytes=300_000)
    assert (len(big.content), big.is_error) == (300_000, False)


async def test_stderr_is_logged_with_the_server_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent_io.tools")
    files = stdio_source(tmp_path)
    try:
        await files.call("apply", idem="idem-logged", key="y")
    finally:
        await files.source.aclose()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("agent_io.tools.mcp")]
    assert any(
        line.startswith("files: ") and "idempotencyKey=idem-logged" in line for line in lines
    ), lines


async def test_the_child_sees_only_its_own_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_INTERNAL_TOKEN_FOR_TEST", "secret")
    monkeypatch.setenv("SOME_OTHER_VARIABLE", "runner-only")
    files = stdio_source(tmp_path, env={"FILES_ROOT": "/srv/files"})
    try:
        outcome = await files.call("environment")
    finally:
        await files.source.aclose()
    assert outcome.structured is not None
    names = set(outcome.structured["names"])
    assert not [name for name in names if name.startswith("KEEL_")]
    assert (
        {"PATH", "PYTHONPATH", "FILES_ROOT"}
        <= names
        <= {"PATH", "HOME", "LANG", "PYTHONPATH", "FILES_ROOT"}
    )


async def test_a_child_dying_mid_call_is_an_error_and_the_next_call_restarts_it(
    tmp_path: Path,
) -> None:
    files = stdio_source(tmp_path)
    try:
        first_pid = await server_pid(files)
        died = await files.call("die")
        assert died.is_error
        assert "went away during the call" in died.content
        await wait_until_gone(first_pid)
        assert (await files.call("echo", text="back")).content == "back"
        assert await server_pid(files) != first_pid
    finally:
        await files.source.aclose()


async def test_aclose_ends_the_child_and_later_calls_are_errors(tmp_path: Path) -> None:
    files = stdio_source(tmp_path)
    pid = await server_pid(files)
    in_flight = asyncio.create_task(files.call("slow", seconds=30))
    await files.source.aclose()
    await wait_until_gone(pid)
    assert (await in_flight).is_error
    after = await files.call("echo", text="late")
    assert after.is_error and "closed" in after.content


async def test_a_missing_command_is_an_error(tmp_path: Path) -> None:
    source = McpSource(
        McpServerConfig(name="ghost", transport="stdio", command=("no-such-mcp-server",))
    )
    try:
        outcome = await source.call(ToolCall("c", "echo", {}, "k"), CALL_TIMEOUT_S)
        assert outcome.is_error
        assert "command not found: 'no-such-mcp-server'" in outcome.content
        with pytest.raises(McpSourceError, match="command not found"):
            await source.list_tools()
    finally:
        await source.aclose()


async def test_an_unreachable_url_is_an_error() -> None:
    url = f"http://127.0.0.1:{free_port()}/mcp"
    source = McpSource(McpServerConfig(name="far", transport="http", url=url))
    try:
        outcome = await source.call(ToolCall("c", "echo", {}, "k"), CALL_TIMEOUT_S)
        assert outcome.is_error
        assert "far.echo: server unavailable" in outcome.content
        with pytest.raises(McpSourceError, match="far"):
            await source.list_tools()
    finally:
        await source.aclose()


async def test_http_requests_carry_the_configured_headers(
    http_server: tuple[HttpMcpServer, Path],
) -> None:
    # The fixture's sources send the header and are served; one without it is not.
    server, where = http_server
    source = McpSource(McpServerConfig(name="files", transport="http", url=server.url))
    try:
        refused = await source.call(ToolCall("c", "echo", {"text": "x"}, "k"), CALL_TIMEOUT_S)
    finally:
        await source.aclose()
    assert refused.is_error and "files.echo: server unavailable" in refused.content
    assert "refused a request without header authorization" in (where / "server.log").read_text()


async def test_an_http_server_killed_mid_call_is_an_error(tmp_path: Path) -> None:
    server = HttpMcpServer(["--log", str(tmp_path / "server.log")])
    source = McpSource(McpServerConfig(name="files", transport="http", url=server.url))
    try:
        died = await source.call(ToolCall("c", "die", {}, "k"), CALL_TIMEOUT_S)
        assert died.is_error
        assert "went away during the call" in died.content
        gone = await source.call(ToolCall("c2", "echo", {"text": "x"}, "k2"), CALL_TIMEOUT_S)
        assert gone.is_error and "server unavailable" in gone.content
    finally:
        await source.aclose()
        server.stop()

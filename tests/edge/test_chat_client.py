"""`keel chat` (services/cli/chat.py, chat_view.py) against a real `keel up`.

The event stream is cut mid-event twice by a transport wrapper; the client
must resume with Last-Event-ID and print every fact exactly once, in order.
A piped stdin drives the client as a real process, which must print the whole
conversation and exit once every input is answered.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from services.cli.chat import ChatClient, open_session, run_command
from services.cli.chat_view import ChatView, Delta, SseEvent, SseParser
from tests.support.polling import eventually
from tests.support.processes import ChildProcess
from tests.support.web_page import (
    keel_up,
    keel_up_process,
    talk_until_compacted,
    use_quick_compaction,
)

KEY = "chat-client-test-key-0123456789"
WORDS = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with keel_up(tmp_path_factory.mktemp("chat") / "data", key=KEY) as url:
        yield url


# ------------------------------------------------------------ no server


def test_parser_dispatches_complete_events_only() -> None:
    parser = SseParser()
    lines = [
        ": keep-alive",
        "",
        "id: 7",
        "event: input",
        'data: {"seq": 7,',
        'data:  "kind": "input"}',
        "",
        "event: delta",
        'data: {"text": "partial"}',
        "",
        "event: assistant",
        "data: {cut off before its blank line",
    ]
    events = [e for e in (parser.feed(line) for line in lines) if e is not None]
    assert events == [
        SseEvent("input", '{"seq": 7,\n "kind": "input"}', "7"),
        SseEvent("delta", '{"text": "partial"}', None),
    ]


class RecordingView(ChatView):
    def __init__(self) -> None:
        super().__init__(Console(file=io.StringIO(), width=300, color_system=None))
        self.seqs: list[int] = []

    def fact(self, fact: Mapping[str, Any]) -> None:
        self.seqs.append(int(fact["seq"]))
        super().fact(fact)

    def output(self) -> str:
        file = self.console.file
        assert isinstance(file, io.StringIO)
        return file.getvalue()


def test_a_fact_at_or_below_the_cursor_is_ignored() -> None:
    view = RecordingView()
    client = ChatClient(httpx.AsyncClient(), "s", view)

    def fact(seq: int) -> SseEvent:
        data = f'{{"seq": {seq}, "kind": "input", "data": {{"text": "t{seq}"}}}}'
        return SseEvent("input", data, str(seq))

    for seq in (1, 2, 2, 1, 3):
        client.handle(fact(seq))
    assert view.seqs == [1, 2, 3]
    assert client.last_seq == 3


def delta_event(epoch: int, attempt: str, channel: str, text: str, **extra: str) -> SseEvent:
    payload = {"generationId": "gen-4", "epoch": epoch, "attemptId": attempt}
    payload.update(channel=channel, text=text, **extra)
    return SseEvent("delta", json.dumps(payload), None)


def test_a_retried_attempt_replaces_the_preview_and_tool_calls_are_grouped() -> None:
    view = ChatView(Console(file=io.StringIO(), width=300, color_system=None))
    client = ChatClient(httpx.AsyncClient(), "s", view)
    client.handle(delta_event(1, "a-1", "text", "Hello "))
    client.handle(delta_event(1, "a-1", "text", "wor"))
    assert view.preview_texts() == {"gen-4": "Hello wor"}
    # The attempt failed; its retry (a new attempt id) streams from the start.
    client.handle(delta_event(1, "a-2", "text", "Hel"))
    assert view.preview_texts() == {"gen-4": "Hel"}
    # A successor epoch starts over too; a late token of epoch 1 is ignored.
    client.handle(delta_event(2, "a-3", "text", "Hi"))
    client.handle(delta_event(1, "a-2", "text", "lo"))
    assert view.preview_texts() == {"gen-4": "Hi"}
    client.handle(delta_event(2, "a-3", "tool_call", '{"ke', toolCallId="c1", toolName="counter"))
    client.handle(delta_event(2, "a-3", "tool_call", '{"sec', toolCallId="c2", toolName="sleep"))
    client.handle(delta_event(2, "a-3", "tool_call", 'y":1}', toolCallId="c1"))
    assert view.preview_tool_calls("gen-4") == {
        "c1": ("counter", '{"key":1}'),
        "c2": ("sleep", '{"sec'),
    }
    # The committed answer ends the preview; later deltas for it are moot.
    answer = {"seq": 5, "kind": "assistant", "data": {"generationId": "gen-4", "content": []}}
    client.handle(SseEvent("assistant", json.dumps(answer), "5"))
    client.handle(delta_event(2, "a-3", "text", " late"))
    assert view.preview_texts() == {}


def test_a_new_epoch_drops_the_previews_of_older_epochs() -> None:
    view = ChatView(Console(file=io.StringIO(), width=300, color_system=None))
    view.delta(Delta("gen-4", "text", "cut off", epoch=1, attempt_id="a-1"))
    epoch = {"seq": 6, "kind": "epoch_started", "epoch": 2, "data": {"epoch": 2}}
    view.fact(epoch)
    assert view.preview_texts() == {}


# --------------------------------------------------------- real server


class CutStreams(httpx.AsyncBaseTransport):
    """The real transport, except that the first event streams break after
    a given number of bytes (mid-event, as a dropped connection would)."""

    def __init__(self, cuts: list[int]) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._cuts = list(cuts)
        self.cursors: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if not request.url.path.endswith("/events"):
            return response
        self.cursors.append(request.headers.get("last-event-id"))
        if not self._cuts:
            return response
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_CutStream(response.stream, self._cuts.pop(0)),
            extensions=response.extensions,
            request=request,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CutStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, limit: int) -> None:
        self._inner = inner
        self._limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        sent = 0
        async for chunk in self._inner:
            if sent + len(chunk) >= self._limit:
                yield chunk[: self._limit - sent]
                raise httpx.ReadError("connection cut by the test")
            sent += len(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


async def settle(client: ChatClient) -> None:
    """Polls the session resource: "answered" is a server-side condition."""
    await eventually(client.settled, "the session to be answered", DEADLINE_S)


@pytest.mark.slow
async def test_resumes_after_cut_streams_without_repeats(base_url: str) -> None:
    transport = CutStreams([450, 1100])
    view = RecordingView()
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, transport=transport
    ) as http:
        session = await open_session(http, None)
        client = ChatClient(http, session, view)
        follower = asyncio.create_task(client.follow())
        try:
            await client.send(f"/slow 3 {WORDS}")
            await settle(client)
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    # Both cuts happened and each reconnect resumed from the cursor.
    assert len(transport.cursors) >= 3, transport.cursors
    assert transport.cursors[0] is None
    resumed = [int(c) for c in transport.cursors[1:] if c is not None]
    assert len(resumed) == len(transport.cursors) - 1
    assert resumed == sorted(resumed) and resumed[0] >= 1
    # Every fact exactly once, in order, nothing missing.
    assert view.seqs == list(range(1, client.last_seq + 1))
    output = view.output()
    assert output.count(f"You said: {WORDS}") == 1, output
    assert output.count(f"you: /slow 3 {WORDS}") == 1, output
    assert "stream interrupted" in output


async def test_piped_stdin_prints_the_conversation_and_exits(base_url: str) -> None:
    script = (
        "import asyncio, sys\n"
        "from services.cli.chat import run_chat\n"
        "asyncio.run(run_chat(sys.argv[1], sys.argv[2], None))\n"
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="300")
    child = ChildProcess([sys.executable, "-c", script, base_url, KEY], env=env)
    try:
        # One message: the scripted model answers the latest input, so two
        # queued at once could share one answer.
        child.send_line("hello there")
        child.send_line(":bogus")
        assert child.proc.stdin is not None
        child.proc.stdin.close()  # end of input: answer everything, then exit
        await child.line(lambda line: "assistant: You said: hello there" in line, DEADLINE_S)
        code = await asyncio.to_thread(child.proc.wait, DEADLINE_S)
    finally:
        child.kill()  # SIGKILL only if still running; reaps it and closes its pipes
    output = child.output()
    assert code == 0, output
    assert output.count("you: hello there") == 1, output
    assert output.count("assistant: You said: hello there") == 1, output
    assert "unknown command ':bogus'" in output


async def test_skip_settles_what_parked_the_session_and_the_next_input_is_answered(
    base_url: str,
) -> None:
    view = RecordingView()
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}
    ) as http:
        session = await open_session(http, None)
        client = ChatClient(http, session, view)
        follower = asyncio.create_task(client.follow())
        try:
            failed = await client.send("/fail")
            await settle(client)  # parked: it waits for a person
            later = await client.send("hello after the failure")
            assert await run_command(client, ":skip")
            await eventually(
                lambda: "You said: hello after the failure" in view.output(),
                "the later input's answer",
                DEADLINE_S,
            )
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
    output = view.output()
    assert f"session parked on #{failed}" in output, output
    assert f"skipped on #{failed}" in output, output
    assert later > failed
    assert output.count("You said: hello after the failure") == 1, output


class StatusView(ChatView):
    """A view on a (pretend) terminal that remembers every status it showed."""

    def __init__(self) -> None:
        super().__init__(
            Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
        )
        self.shown_compacting = asyncio.Event()

    def status(self, state: str) -> None:
        super().status(state)
        if state == "compacting":
            self.shown_compacting.set()

    def output(self) -> str:
        file = self.console.file
        assert isinstance(file, io.StringIO)
        return file.getvalue()


@pytest.mark.slow
async def test_keel_chat_shows_compacting_on_a_terminal(tmp_path: Path) -> None:
    with keel_up_process(tmp_path / "data", KEY) as up:
        await use_quick_compaction(up.kernel_target)
        view = StatusView()
        async with httpx.AsyncClient(
            base_url=up.base_url, headers={"Authorization": f"Bearer {KEY}"}
        ) as http:
            session = await open_session(http, None)
            client = ChatClient(http, session, view)
            follower = asyncio.create_task(client.follow())
            try:
                # `/slowsummary 3` ends up in the summary, which then takes 3 s.
                texts = ["/slowsummary 3 keep the lamp lit", *["/long 300"] * 16]
                talking = asyncio.create_task(talk_until_compacted(http, session, texts))
                seen = asyncio.create_task(view.shown_compacting.wait())
                await asyncio.wait({talking, seen}, return_when=asyncio.FIRST_COMPLETED)
                if talking.done() and talking.exception() is not None:
                    raise talking.exception()  # type: ignore[misc]
                await asyncio.wait_for(seen, DEADLINE_S)
                # The live region says it, in words, while the summary runs.
                assert "compacting the context…" in view.output()
                await talking
            finally:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
                view.close()

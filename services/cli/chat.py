"""`keel chat`: a terminal client for one session, over the edge's HTTP API.

It behaves like the web page. Committed facts are printed once each, in seq
order, from the session's SSE stream. Token partials (`delta` events) are not
facts: in a terminal they stream into a transient live region that the
committed answer replaces, and they are not shown at all when the output is
not a terminal (so piped output is exactly the committed transcript). A
broken stream is resumed with `Last-Event-ID` = the last seq printed, and a
fact at or below that seq is never printed again.

Lines read from stdin are sent as inputs, each with a fresh requestId (a
transport failure resends the same requestId, which the edge deduplicates).
Lines starting with `:` are client commands; see HELP. At the end of stdin the
client waits until every input has been answered, then returns, so
`keel chat < script.txt` prints a whole conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO
from urllib.parse import quote

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.text import Text

HELP = (
    "Type a message and press Enter. Commands: :retry <seq>  :cancel  :quit  :help. "
    "Model commands (/slow, /tool, /think, /fail, /long) go to the model as text."
)
CANCELLED_STOP = "cancelled"
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 15.0
# Longer than the edge's keep-alive interval: a silent connection this long
# is dead, and resuming costs nothing.
STREAM_READ_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 10.0
# Inputs are idempotent by requestId, so a failed POST is simply resent.
INPUT_POST_ATTEMPTS = 3
SETTLE_POLL_S = 0.2
# A partial that received nothing for this long belongs to a dead attempt
# once a new epoch starts (deltas carry no epoch of their own).
QUIET_PARTIAL_S = 1.0


class ChatError(Exception):
    """A failure that retrying will not fix: a rejected key, a missing session."""


class _Retryable(Exception):
    """A failure of the event stream worth a reconnect (a 5xx, a 429)."""


# ------------------------------------------------------------------ SSE


@dataclass(frozen=True)
class SseEvent:
    event: str
    data: str
    # The `id:` of this event only (None when it had none). Unlike the
    # browser's lastEventId it does not carry over: partials have no id.
    id: str | None


class SseParser:
    """The text/event-stream format, fed one line at a time (line endings
    already removed). An event is dispatched at the blank line ending it, so
    an event cut off by a broken connection is never dispatched."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, line: str) -> SseEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment: the edge's keep-alive
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self._id = value
        # `retry:` and unknown fields are ignored: reconnects are paced here.
        return None

    def _dispatch(self) -> SseEvent | None:
        event = None
        if self._data:
            event = SseEvent(self._event or "message", "\n".join(self._data), self._id)
        self._event, self._data, self._id = "", [], None
        return event


# ----------------------------------------------------------------- view


def _as_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _compaction_headline(data: Mapping[str, Any]) -> str:
    before, after = data.get("tokensBefore"), data.get("tokensAfter")
    headline = "context compacted"
    if isinstance(before, int) and isinstance(after, int):
        headline += f": {before} → {after} tokens"
    elif isinstance(before, int):
        headline += f": {before} tokens summarized"
    span = data.get("summarized")
    if isinstance(span, list) and len(span) == 2:
        headline += f" (facts #{span[0]} to #{span[1]} summarized)"
    return headline


def render_fact(fact: Mapping[str, Any], tool_names: Mapping[str, str]) -> RenderableType | None:
    """How one committed fact looks in the terminal (None: not shown)."""
    kind = str(fact.get("kind"))
    data: Mapping[str, Any] = fact.get("data") or {}
    line = Text()
    line.append(f"#{fact.get('seq')} ", style="dim")
    if kind == "input":
        line.append("you", style="bold cyan")
        if data.get("retryOf"):
            line.append(f" (retry of #{data['retryOf']})", style="dim")
        line.append(": ")
        line.append(str(data.get("text", "")))
        return line
    if kind == "assistant":
        return _render_assistant(line, data)
    if kind == "tool_result":
        name = tool_names.get(str(data.get("toolCallId")), str(data.get("toolCallId")))
        failed = bool(data.get("isError"))
        line.append(f"← {name} {'failed' if failed else 'returned'}: ", style="magenta")
        line.append(_as_text(data.get("content", "")), style="red" if failed else "")
        return line
    if kind == "compaction":
        line.append(f"⚙ {_compaction_headline(data)}", style="green")
        summary = str(data.get("summary", "")).strip()
        if not summary:
            return line
        return Group(line, Text(summary, style="dim green"))
    if kind == "epoch_started":
        return None  # every claim starts one; users care about answers, not owners
    notices = {
        "session_created": ("session created", "dim"),
        "cancelled": ("cancel requested", "yellow"),
        "attempt_failed": (
            f"attempt failed: {data.get('error')}"
            + (" (retrying)" if data.get("retryable") else ""),
            "yellow",
        ),
        "session_parked": (f"session parked: {data.get('reason')}", "bold red"),
        "compaction_failed": (f"compaction failed: {data.get('error')}", "yellow"),
    }
    text, style = notices.get(kind, (kind, "dim"))
    line.append(text, style=style)
    return line


def _render_assistant(line: Text, data: Mapping[str, Any]) -> RenderableType:
    content = [b for b in data.get("content") or [] if isinstance(b, Mapping)]
    calls = [c for c in data.get("toolCalls") or [] if isinstance(c, Mapping)]
    if data.get("stopReason") == CANCELLED_STOP and not content and not calls:
        line.append("answer cancelled", style="yellow")
        return line
    line.append("assistant", style="bold green")
    line.append(": ")
    parts: list[RenderableType] = [line]
    texts = [str(b.get("text", "")) for b in content if b.get("type") == "text"]
    line.append("\n".join(texts))
    for block in content:
        if block.get("type") == "thinking":
            # Collapsed like on the page: the size, not the whole monologue.
            thinking = str(block.get("thinking", ""))
            parts.append(Text(f"   (thought for {len(thinking)} characters)", style="dim italic"))
    for call in calls:
        arguments = json.dumps(call.get("arguments") or {}, ensure_ascii=False)
        parts.append(Text(f"   → {call.get('name')}({arguments})", style="magenta"))
    if data.get("stopReason") == "length":
        parts.append(Text("   (cut at the output limit)", style="dim"))
    if data.get("stopReason") == CANCELLED_STOP:
        parts.append(Text("   (cancelled)", style="yellow"))
    return parts[0] if len(parts) == 1 else Group(*parts)


@dataclass
class _Partial:
    text: str = ""
    thinking: str = ""
    tool_call: str = ""
    last_delta_at: float = field(default_factory=time.monotonic)


class ChatView:
    """Prints facts; shows partials and the busy state in a live region that
    disappears when it is done (only on a terminal)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._live: Live | None = None
        self._pending: dict[str, _Partial] = {}
        self._committed: set[str] = set()
        self._tool_names: dict[str, str] = {}
        self._status = "idle"
        self._connection = ""

    # Facts -------------------------------------------------------------

    def fact(self, fact: Mapping[str, Any]) -> None:
        data: Mapping[str, Any] = fact.get("data") or {}
        kind = fact.get("kind")
        if kind == "assistant":
            generation = str(data.get("generationId"))
            self._committed.add(generation)
            self._pending.pop(generation, None)
            if data.get("stopReason") == CANCELLED_STOP:
                self._pending.clear()  # the cancelled generation never commits
            for call in data.get("toolCalls") or []:
                if isinstance(call, Mapping):
                    self._tool_names[str(call.get("id"))] = str(call.get("name"))
        elif kind == "epoch_started":
            # A new owner restreams the same generationId from its first
            # token; a partial still receiving tokens is the new stream's
            # (deltas may overtake their epoch_started), a quiet one is dead.
            now = time.monotonic()
            for generation, partial in list(self._pending.items()):
                if now - partial.last_delta_at > QUIET_PARTIAL_S:
                    del self._pending[generation]
        elif kind in ("attempt_failed", "session_parked"):
            self._pending.clear()
        # The live region first: printing redraws it below the new line, and
        # it must not flash the partial this fact just replaced.
        self._refresh()
        rendered = render_fact(fact, self._tool_names)
        if rendered is not None:
            self.console.print(rendered)

    def notice(self, message: str, style: str = "dim") -> None:
        self.console.print(Text(message, style=style))

    # Partials and state -------------------------------------------------

    def delta(self, generation_id: str, channel: str, text: str) -> None:
        if generation_id in self._committed:
            return  # its answer is already printed
        partial = self._pending.setdefault(generation_id, _Partial())
        partial.last_delta_at = time.monotonic()
        if channel == "thinking":
            partial.thinking += text
        elif channel == "tool_call":
            partial.tool_call += text
        else:
            partial.text += text
        self._refresh()

    def status(self, state: str) -> None:
        self._status = state
        if state == "idle":
            # Nothing is in flight: a partial left now will never commit.
            self._pending.clear()
        self._refresh()

    def connection(self, state: str) -> None:
        """The stream state: an empty string while streaming, else a word to show."""
        if state == "":
            # A new connection: earlier partials may have a gap now; the
            # live stream starts fresh ones and the answer is complete.
            self._pending.clear()
        self._connection = state
        self._refresh()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _live_renderable(self) -> RenderableType | None:
        parts: list[RenderableType] = []
        for partial in self._pending.values():
            if partial.thinking and not partial.text:
                parts.append(Text(f"(thinking… {len(partial.thinking)} characters)", "dim italic"))
            if partial.text:
                parts.append(Text.assemble(("assistant", "bold green"), ": ", partial.text))
            if partial.tool_call:
                parts.append(Text(f"   → {partial.tool_call}", style="magenta"))
        busy = {"running": "running…", "compacting": "compacting…"}.get(self._status)
        footer = " · ".join(word for word in (busy, self._connection) if word)
        if footer:
            parts.append(Text(footer, style="dim"))
        return Group(*parts) if parts else None

    def _refresh(self) -> None:
        if not self.console.is_terminal:
            return  # piped output shows committed facts only
        renderable = self._live_renderable()
        if renderable is None:
            self.close()
            return
        if self._live is None:
            self._live = Live(renderable, console=self.console, transient=True, auto_refresh=False)
            self._live.start()
        self._live.update(renderable, refresh=True)


# --------------------------------------------------------------- client


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error") or {}
        message = str(error.get("message") or response.reason_phrase)
    except (ValueError, AttributeError):
        message = response.reason_phrase
    return f"{response.status_code} {message}"


def _session_path(session_id: str) -> str:
    return f"/v1/sessions/{quote(session_id, safe='')}"


def _raise_for(response: httpx.Response) -> None:
    if response.status_code >= 500 or response.status_code == 429:
        raise _Retryable(_error_message(response))
    if response.is_error:
        raise ChatError(_error_message(response))


class ChatClient:
    """One session: follows its event stream and sends commands to it."""

    def __init__(self, http: httpx.AsyncClient, session_id: str, view: ChatView) -> None:
        self.http = http
        self.session_id = session_id
        self.view = view
        # The resume cursor: the highest seq printed.
        self.last_seq = 0
        # (text, requestId) of a message whose POST has not succeeded yet.
        self._unsent: tuple[str, str] | None = None

    def _path(self, suffix: str = "") -> str:
        return _session_path(self.session_id) + suffix

    async def follow(self) -> None:
        """Forever: stream events, resuming after every disconnect or drain."""
        delay = RECONNECT_MIN_S
        while True:
            try:
                wait = await self._stream_once()
                delay = RECONNECT_MIN_S
            except (httpx.TransportError, _Retryable) as error:
                reason = str(error) or type(error).__name__
                self.view.connection("reconnecting…")
                self.view.notice(f"stream interrupted ({reason}); resuming after #{self.last_seq}")
                wait = delay
                delay = min(delay * 2, RECONNECT_MAX_S)
            await asyncio.sleep(wait)

    async def _stream_once(self) -> float:
        """One connection; returns how long to wait before the next one."""
        headers = {"Accept": "text/event-stream"}
        if self.last_seq:
            headers["Last-Event-ID"] = str(self.last_seq)
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, read=STREAM_READ_TIMEOUT_S)
        async with self.http.stream(
            "GET", self._path("/events"), headers=headers, timeout=timeout
        ) as response:
            if response.is_error:
                await response.aread()
                _raise_for(response)
            self.view.connection("")
            parser = SseParser()
            async for line in response.aiter_lines():
                event = parser.feed(line)
                if event is None:
                    continue
                if event.event == "drain":
                    # The edge is going away; a successor serves from cursor+1.
                    self.view.connection("reconnecting…")
                    return _retry_after_s(event.data)
                self.handle(event)
        # The server ended the stream without a drain: come back soon.
        self.view.connection("reconnecting…")
        return RECONNECT_MIN_S

    def handle(self, event: SseEvent) -> None:
        try:
            payload = json.loads(event.data)
        except ValueError:
            return
        if not isinstance(payload, dict):
            return
        if event.event == "delta":
            self.view.delta(
                str(payload.get("generationId", "")),
                str(payload.get("channel", "text")),
                str(payload.get("text", "")),
            )
        elif event.event == "status":
            self.view.status(str(payload.get("state", "")))
        elif "kind" in payload:
            seq = payload.get("seq")
            if not isinstance(seq, int) and event.id is not None and event.id.isdigit():
                seq = int(event.id)
            # The dedup safety net: a seq at or below the cursor was printed.
            if not isinstance(seq, int) or seq <= self.last_seq:
                return
            self.last_seq = seq
            self.view.fact(payload)

    async def send(self, text: str) -> int:
        """Commits an input. A fresh requestId per message; a resend after a
        failure (here, or the user typing the same text again after one)
        reuses it, so the edge answers with the same seq instead of
        committing the input twice."""
        if self._unsent is None or self._unsent[0] != text:
            self._unsent = (text, str(uuid.uuid4()))
        body = {"text": text, "requestId": self._unsent[1]}
        for attempt in range(1, INPUT_POST_ATTEMPTS + 1):
            try:
                response = await self.http.post(self._path("/inputs"), json=body)
                _raise_for(response)
            except (httpx.TransportError, _Retryable):
                if attempt == INPUT_POST_ATTEMPTS:
                    raise
                await asyncio.sleep(RECONNECT_MIN_S * attempt)
                continue
            self._unsent = None
            return int(response.json()["seq"])
        raise AssertionError("unreachable")

    async def retry(self, seq: int) -> int:
        # Not resent on failure: a retry has no requestId, two would be two.
        response = await self.http.post(self._path("/retry"), json={"seq": seq})
        _raise_for(response)
        return int(response.json()["seq"])

    async def cancel(self) -> int:
        response = await self.http.post(self._path("/cancel"), json={})
        _raise_for(response)
        return int(response.json()["seq"])

    async def settled(self) -> bool:
        """Every fact printed, and nothing more coming: idle with nothing
        owed, or parked (which waits for a person, not for time)."""
        response = await self.http.get(self._path())
        _raise_for(response)
        session = response.json()
        if self.last_seq < int(session.get("headSeq", 0)):
            return False
        status = session.get("status")
        return status == "parked" or (status == "idle" and not session.get("owedInputs"))


def _retry_after_s(data: str) -> float:
    try:
        value = json.loads(data).get("retry_after_ms")
    except (ValueError, AttributeError):
        value = None
    return max(0.0, float(value)) / 1000 if isinstance(value, int | float) else 1.0


async def open_session(http: httpx.AsyncClient, session_id: str | None) -> str:
    """The given session (which must exist) or a new one."""
    if session_id is None:
        response = await http.post("/v1/sessions", json={})
        _raise_for(response)
        return str(response.json()["id"])
    response = await http.get(_session_path(session_id))
    if response.status_code == 404:
        raise ChatError(f"session {session_id} does not exist (for this key)")
    _raise_for(response)
    return session_id


# ---------------------------------------------------------------- input


def _start_reader(stream: TextIO, queue: asyncio.Queue[str | None]) -> None:
    """Reads lines on a daemon thread: a blocking read can be neither
    cancelled nor awaited, and a daemon thread never holds up the exit."""
    loop = asyncio.get_running_loop()

    def put(item: str | None) -> None:
        # The loop may be gone when stdin ends after the chat is over.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def read() -> None:
        for line in stream:
            put(line.rstrip("\r\n"))
        put(None)

    threading.Thread(target=read, name="keel-chat-stdin", daemon=True).start()


async def _command(client: ChatClient, line: str) -> bool:
    """Runs one line; False when the user asked to quit."""
    text = line.strip()
    if not text:
        return True
    if text.startswith(":"):
        name, _, argument = text[1:].partition(" ")
        if name in ("quit", "q", "exit"):
            return False
        if name == "help":
            client.view.notice(HELP)
        elif name == "cancel":
            await client.cancel()
        elif name == "retry" and argument.strip().lstrip("#").isdigit():
            await client.retry(int(argument.strip().lstrip("#")))
        else:
            client.view.notice(f"unknown command {text!r}. {HELP}", style="yellow")
        return True
    # The input shows up when its fact arrives on the stream, like any other.
    await client.send(line)
    return True


async def _converse(client: ChatClient, stdin: TextIO, follower: asyncio.Task[None]) -> None:
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    _start_reader(stdin, lines)
    while True:
        getter = asyncio.ensure_future(lines.get())
        await asyncio.wait({getter, follower}, return_when=asyncio.FIRST_COMPLETED)
        if follower.done():
            getter.cancel()
            follower.result()  # the stream gave up: raise why
            return
        line = getter.result()
        if line is None:
            break  # end of input: wait for the answers below
        try:
            if not await _command(client, line):
                return
        except ChatError as error:
            client.view.notice(str(error), style="red")
        except (httpx.TransportError, _Retryable) as error:
            # The edge may be restarting; the stream resumes by itself, and
            # sending the same line again is safe (same requestId).
            reason = str(error) or type(error).__name__
            client.view.notice(f"not sent ({reason}); enter it again to retry", style="red")
    while True:
        if follower.done():
            follower.result()
            return
        # An unreachable edge (a restart) is waited out, like the stream is.
        with contextlib.suppress(httpx.TransportError, _Retryable):
            if await client.settled():
                return
        await asyncio.sleep(SETTLE_POLL_S)


async def run_chat(
    base_url: str,
    key: str,
    session_id: str | None,
    *,
    stdin: TextIO | None = None,
    console: Console | None = None,
) -> None:
    """Chat with a session (a new one when session_id is None) until stdin
    ends (then every input is answered first) or `:quit`."""
    console = console if console is not None else Console()
    view = ChatView(console)
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers={"Authorization": f"Bearer {key}"},
        timeout=REQUEST_TIMEOUT_S,
    ) as http:
        try:
            session = await open_session(http, session_id)
            console.print(f"[bold]session {escape(session)}[/bold]  [dim]:help for commands[/dim]")
            client = ChatClient(http, session, view)
            follower = asyncio.create_task(client.follow(), name="keel-chat-events")
            try:
                await _converse(client, stdin if stdin is not None else sys.stdin, follower)
            finally:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
                view.close()
        except ChatError as error:
            console.print(Text(f"keel chat: {error}", style="bold red"))
            raise SystemExit(1) from None
        except (httpx.TransportError, _Retryable) as error:
            console.print(Text(f"keel chat: cannot reach {base_url}: {error}", style="bold red"))
            raise SystemExit(1) from None

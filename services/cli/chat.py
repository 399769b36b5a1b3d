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

A tool call that waits for a person's approval is asked about: the client
prints `approve NAME(ARGS)? [y/n]`, the next `y` or `n` line decides the
oldest waiting call, and the line after it is the note (empty for none).
Any other line is sent as an input, as usual (it is answered once the call
has its result). `:approve` and `:deny` decide without the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import uuid
from typing import TextIO
from urllib.parse import quote

import httpx
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from edge.session_status import AWAITING_APPROVAL, PARKED
from services.cli.chat_view import ChatView, Delta, SseEvent, SseParser
from services.runner.events import IDLE

HELP = (
    "Type a message and press Enter. Commands: :retry <seq>  :skip  :cancel  "
    ":approve [note]  :deny [note]  :quit  :help (:skip settles the inputs a parked "
    "session failed on). "
    "Model commands (/slow, /tool, /think, /fail, /long) go to the model as text."
)
YES, NO = frozenset({"y", "yes"}), frozenset({"n", "no"})
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 15.0
# Longer than the edge's keep-alive interval: a silent connection this long
# is dead, and resuming costs nothing.
STREAM_READ_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 10.0
# Inputs are idempotent by requestId, so a failed POST is simply resent.
INPUT_POST_ATTEMPTS = 3
SETTLE_POLL_S = 0.2


class ChatError(Exception):
    """A failure that retrying will not fix: a rejected key, a missing session."""


class _Retryable(Exception):
    """A failure of the event stream worth a reconnect (a 5xx, a 429)."""


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
        # Tool calls waiting for a decision, oldest first: id -> (name, arguments).
        self.waiting: dict[str, tuple[str, str]] = {}
        # The call a `y`/`n` line decided, while its note is being asked for.
        self.deciding: tuple[str, bool] | None = None
        # The session's head when the chat opened: facts up to it are history.
        self.history_head = 0

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
            self.view.delta(Delta.from_json(payload))
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
            self._follow_approvals(payload, seq)

    def _follow_approvals(self, fact: dict[str, object], seq: int) -> None:
        """Tracks the calls waiting for a decision, and asks about the oldest
        when it changes. The history replayed when the chat opens is not
        asked about as it goes by (a decision may follow a few facts later):
        what still waits at its end is."""
        data = fact.get("data")
        if not isinstance(data, dict):
            return
        call_id = str(data.get("toolCallId", ""))
        oldest = next(iter(self.waiting), None)
        if fact.get("kind") == "approval_requested":
            arguments = json.dumps(data.get("arguments") or {}, ensure_ascii=False)
            self.waiting[call_id] = (str(data.get("name", "")), arguments)
        elif fact.get("kind") in ("approval", "tool_result"):
            self.waiting.pop(call_id, None)
        if seq < self.history_head or not self.waiting or self.deciding is not None:
            return
        if seq == self.history_head or next(iter(self.waiting)) != oldest:
            self.ask()

    def ask(self) -> None:
        """Prints the question about the oldest waiting call."""
        name, arguments = next(iter(self.waiting.values()))
        self.view.notice(f"approve {name}({arguments})? [y/n]", style="bold yellow")

    async def decide(self, approve: bool, note: str, call_id: str | None = None) -> int:
        """Decides `call_id` (default: the oldest waiting call); the decision's seq."""
        if call_id is None:
            if not self.waiting:
                raise ChatError("no tool call waits for a decision")
            call_id = next(iter(self.waiting))
        body: dict[str, object] = {"toolCallId": call_id, "approve": approve}
        if note:
            body["note"] = note
        # Not resent on failure: a second decision is refused (409) anyway.
        response = await self.http.post(self._path("/approvals"), json=body)
        _raise_for(response)
        return int(response.json()["seq"])

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

    async def cancel(self) -> int | None:
        """The cancel's seq; None when the session had nothing to cancel."""
        response = await self.http.post(self._path("/cancel"), json={})
        _raise_for(response)
        seq = response.json().get("seq")
        return None if seq is None else int(seq)

    async def skip(self) -> list[int]:
        """Settles the inputs a parked session failed on; the ones it skipped."""
        response = await self.http.post(self._path("/skip"), json={})
        _raise_for(response)
        return [int(seq) for seq in response.json()["skipped"]]

    async def head_seq(self) -> int:
        response = await self.http.get(self._path())
        _raise_for(response)
        return int(response.json().get("headSeq", 0))

    async def settled(self) -> bool:
        """Every fact printed, and nothing more coming: idle with nothing
        owed, parked, or awaiting an approval (those wait for a person)."""
        response = await self.http.get(self._path())
        _raise_for(response)
        session = response.json()
        if self.last_seq < int(session.get("headSeq", 0)):
            return False
        status = session.get("status")
        return status in (PARKED, AWAITING_APPROVAL) or (
            status == IDLE and not session.get("owedInputs")
        )


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


async def _answer(client: ChatClient, text: str) -> bool:
    """A line that answers the approval prompt: `y`/`n`, then the note.
    False when the line is not an answer (it is then an input)."""
    if client.deciding is not None:
        call_id, approve = client.deciding
        client.deciding = None
        # The next waiting call is asked about when this decision's fact
        # arrives on the stream.
        await client.decide(approve, text, call_id)
        return True
    word = text.lower()
    if client.waiting and word in YES | NO:
        client.deciding = (next(iter(client.waiting)), word in YES)
        client.view.notice("note (Enter for none):", style="bold yellow")
        return True
    return False


async def run_command(client: ChatClient, line: str) -> bool:
    """Runs one line; False when the user asked to quit."""
    text = line.strip()
    # An empty line is a note too (none): checked before it is skipped.
    if await _answer(client, text):
        return True
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
        elif name == "skip":
            await client.skip()
        elif name == "retry" and argument.strip().lstrip("#").isdigit():
            await client.retry(int(argument.strip().lstrip("#")))
        elif name in ("approve", "deny"):
            await client.decide(name == "approve", argument.strip())
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
            if not await run_command(client, line):
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
            client.history_head = await client.head_seq()
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
        except httpx.ConnectError:
            console.print(
                Text(f"keel: no Keel at {base_url} — is `keel up` running?", style="bold red")
            )
            raise SystemExit(1) from None
        except (httpx.TransportError, _Retryable) as error:
            console.print(Text(f"keel chat: cannot reach {base_url}: {error}", style="bold red"))
            raise SystemExit(1) from None

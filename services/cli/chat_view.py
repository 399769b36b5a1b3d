"""What `keel chat` shows: the SSE format and the terminal rendering.

Committed facts are printed once each; token partials (`delta` events, never
facts) stream into a transient live region that the committed answer
replaces, only on a terminal, so piped output is exactly the committed
transcript.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from services.runner.events import COMPACTING, IDLE, RUNNING

CANCELLED_STOP = "cancelled"
# What the live region says while the session is busy.
BUSY_WORDS = {RUNNING: "running…", COMPACTING: "compacting the context…"}


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


def _on(seqs: object) -> str:
    """ " on #3, #4" for a list of input seqs, "" without one."""
    if not isinstance(seqs, list) or not seqs:
        return ""
    return " on " + ", ".join(f"#{seq}" for seq in seqs)


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
    if kind == "approval_requested":
        arguments = json.dumps(data.get("arguments") or {}, ensure_ascii=False)
        line.append(
            f"⏸ {data.get('name')}({arguments}) waits for your approval", style="bold yellow"
        )
        return line
    if kind == "approval":
        name = tool_names.get(str(data.get("toolCallId")), str(data.get("toolCallId")))
        approved = bool(data.get("approve"))
        line.append(
            f"{'✓ approved' if approved else '✗ denied'} {name} (by {data.get('by')})",
            style="green" if approved else "yellow",
        )
        if data.get("note"):
            line.append(f": {data.get('note')}")
        return line
    notices = {
        "session_created": ("session created", "dim"),
        "cancelled": ("cancel requested", "yellow"),
        "attempt_failed": (
            f"attempt failed: {data.get('error')}"
            + (" (retrying)" if data.get("retryable") else ""),
            "yellow",
        ),
        "session_parked": (
            f"session parked{_on(data.get('inputSeqs'))}: {data.get('reason')} "
            "(:retry <seq> asks again, :skip settles the failed inputs)",
            "bold red",
        ),
        "inputs_skipped": (f"skipped{_on(data.get('inputSeqs'))}: {data.get('reason')}", "yellow"),
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
        # A call whose arguments were not a JSON object shows what was sent.
        arguments = call.get("argumentsText")
        if not isinstance(arguments, str):
            arguments = json.dumps(call.get("arguments") or {}, ensure_ascii=False)
        parts.append(Text(f"   → {call.get('name')}({arguments})", style="magenta"))
    if data.get("stopReason") == "length":
        parts.append(Text("   (cut at the output limit)", style="dim"))
    if data.get("stopReason") == CANCELLED_STOP:
        parts.append(Text("   (cancelled)", style="yellow"))
    return parts[0] if len(parts) == 1 else Group(*parts)


@dataclass(frozen=True)
class Delta:
    """One `delta` event: a fragment of a generation as one attempt streams it."""

    generation_id: str
    channel: str
    text: str
    epoch: int | None = None
    attempt_id: str = ""
    tool_call_id: str = ""
    tool_name: str = ""

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Delta:
        epoch = payload.get("epoch")
        return cls(
            generation_id=str(payload.get("generationId", "")),
            channel=str(payload.get("channel", "text")),
            text=str(payload.get("text", "")),
            epoch=epoch if isinstance(epoch, int) else None,
            attempt_id=str(payload.get("attemptId", "")),
            tool_call_id=str(payload.get("toolCallId", "")),
            tool_name=str(payload.get("toolName", "")),
        )


@dataclass
class _Partial:
    """The preview of one generation as streamed by one (epoch, attempt)."""

    epoch: int | None
    attempt_id: str
    text: str = ""
    thinking: str = ""
    # toolCallId -> [tool name, argument fragments so far], in arrival order.
    tool_calls: dict[str, list[str]] = field(default_factory=dict)

    def add(self, delta: Delta) -> None:
        if delta.channel == "thinking":
            self.thinking += delta.text
        elif delta.channel == "tool_call":
            call = self.tool_calls.setdefault(delta.tool_call_id, ["", ""])
            call[0] = delta.tool_name or call[0]
            call[1] += delta.text
        else:
            self.text += delta.text


class ChatView:
    """Prints facts; shows partials and the busy state in a live region that
    disappears when it is done (only on a terminal)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._live: Live | None = None
        self._pending: dict[str, _Partial] = {}
        self._committed: set[str] = set()
        self._tool_names: dict[str, str] = {}
        self._status: str = IDLE
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
            # token: partials of older epochs were cut off.
            epoch = data.get("epoch")
            if isinstance(epoch, int):
                self._drop(lambda partial: partial.epoch is None or partial.epoch < epoch)
        elif kind == "attempt_failed":
            # That attempt's partials never commit; a retry streams anew.
            failed = fact.get("epoch")
            if isinstance(failed, int):
                self._drop(lambda partial: partial.epoch is None or partial.epoch <= failed)
            else:
                self._pending.clear()
        elif kind == "session_parked":
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

    def delta(self, delta: Delta) -> None:
        """A partial keyed by (generationId, epoch, attemptId): a delta of
        another epoch or attempt replaces the preview rather than extending
        it, since a successor or a retry streams the answer from the start."""
        if not delta.generation_id or delta.generation_id in self._committed:
            return  # its answer is already printed
        partial = self._pending.get(delta.generation_id)
        if partial is not None and (partial.epoch, partial.attempt_id) != (
            delta.epoch,
            delta.attempt_id,
        ):
            if (partial.epoch or 0) > (delta.epoch or 0):
                return  # a late token of a superseded epoch
            partial = None
        if partial is None:
            partial = _Partial(delta.epoch, delta.attempt_id)
            self._pending[delta.generation_id] = partial
        partial.add(delta)
        self._refresh()

    def _drop(self, predicate: Callable[[_Partial], bool]) -> None:
        for generation, partial in list(self._pending.items()):
            if predicate(partial):
                del self._pending[generation]

    def status(self, state: str) -> None:
        self._status = state
        if state == IDLE:
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

    def preview_texts(self) -> dict[str, str]:
        """The text of each preview on show, by generationId."""
        return {generation: partial.text for generation, partial in self._pending.items()}

    def preview_tool_calls(self, generation_id: str) -> dict[str, tuple[str, str]]:
        """toolCallId -> (tool name, arguments so far) of one preview."""
        partial = self._pending.get(generation_id)
        calls = partial.tool_calls.items() if partial is not None else ()
        return {call_id: (name, arguments) for call_id, (name, arguments) in calls}

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
            for name, arguments in partial.tool_calls.values():
                parts.append(Text(f"   → {name or 'tool'}({arguments}", style="magenta"))
        footer = Text()
        busy = BUSY_WORDS.get(self._status)
        if busy:
            # Compacting holds the queue for a while: say so plainly.
            footer.append(busy, style="bold green" if self._status == COMPACTING else "dim")
        if self._connection:
            footer.append(f"{' · ' if busy else ''}{self._connection}", style="dim")
        if footer:
            parts.append(footer)
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

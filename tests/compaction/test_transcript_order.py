"""The transcript projection over random interleavings of a session's life.

A small simulator plays the runner's protocol against a list of facts —
inputs arriving at any time, attempts claiming with a watermark, answers
with and without tool calls, tool results, crashes at any step, cancels and
compactions — using the runner's own `owed` to decide what is due and the
projection to build each request, exactly as an attempt does. Every request
it records must be a well-formed conversation, and a rebuild from the ledger
(what `GetContext` and `/context` show) must reproduce it exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from compaction.service import answer_watermark
from compaction.transcript import request_messages
from services.ledger.facts import CommittedFact
from services.runner import transcript as T
from tests.support.transcript_checks import check_well_formed

OPS = ("input", "input", "claim", "step", "step", "step", "crash", "cancel", "compact")


@dataclass
class Recorded:
    generation_id: str
    watermark: int
    messages: tuple[dict[str, Any], ...]


@dataclass
class Session:
    facts: list[CommittedFact] = field(default_factory=list)
    epoch: int = 0
    watermark: int | None = None  # the live attempt's, None when none runs
    requests: list[Recorded] = field(default_factory=list)

    def commit(self, kind: str, data: Mapping[str, Any]) -> int:
        # The ledger's dedup: one answer per generation id, one result per call.
        key = {"assistant": "generationId", "tool_result": "toolCallId"}.get(kind)
        for fact in self.facts:
            if key and fact.kind == kind and fact.data[key] == data[key]:
                return fact.seq
        seq = len(self.facts) + 1
        self.facts.append(CommittedFact("s", seq, kind, dict(data), 0, self.epoch))
        return seq

    def apply(self, op: str, choice: int) -> None:
        if op == "input":
            self.commit("input", {"text": f"u{len(self.facts) + 1}", "requestId": "r"})
        elif op == "cancel":
            self.commit("cancelled", {"reason": "client"})
        elif op == "crash":
            self.watermark = None
        elif op == "claim" and self.watermark is None:
            watermark = T.highest_input(self.facts)
            if not T.owed(self.facts, watermark).nothing:
                self.epoch += 1
                self.watermark = watermark
                self.commit("epoch_started", {"epoch": self.epoch, "watermark": watermark})
        elif op == "step" and self.watermark is not None:
            self.step(choice)
        elif op == "compact" and self.watermark is not None:
            self.compact(choice)

    def step(self, choice: int) -> None:
        """One turn of `Attempt.run_turns`."""
        assert self.watermark is not None
        owed = T.owed(self.facts, self.watermark)
        if owed.cancelled_input_seqs:
            for call in owed.open_calls:
                self.commit(
                    "tool_result",
                    {"toolCallId": call.tool_call_id, "content": "cancelled", "isError": True},
                )
            self.commit(
                "assistant",
                {
                    "generationId": T.cancel_generation_id(
                        owed.latest_cancel_seq, owed.cancelled_input_seqs
                    ),
                    "content": [],
                    "toolCalls": [],
                    "inputSeqs": list(owed.cancelled_input_seqs),
                    "stopReason": T.CANCELLED_STOP,
                },
            )
        elif owed.open_calls:
            call = owed.open_calls[0]
            self.commit("tool_result", {"toolCallId": call.tool_call_id, "content": "r"})
        elif owed.input_seqs:
            generation = T.generation_id(owed.context_head_seq)
            messages = request_messages(self.facts, self.watermark)
            self.requests.append(Recorded(generation, self.watermark, messages))
            calls = [
                {"id": f"c{len(self.facts)}-{i}", "name": "clock", "arguments": {}}
                for i in range(choice % 3)
            ]
            data: dict[str, Any] = {
                "generationId": generation,
                "content": [{"type": "text", "text": f"a{len(self.facts) + 1}"}],
                "toolCalls": calls,
                "stopReason": "toolUse" if calls else "stop",
            }
            if not calls:
                data["inputSeqs"] = list(owed.input_seqs)
            self.commit("assistant", data)
        else:
            self.watermark = None  # Finish

    def compact(self, choice: int) -> None:
        """A compaction before a request, cut at a user message, as the
        policy cuts on turn boundaries (never between a call and its result)."""
        assert self.watermark is not None
        owed = T.owed(self.facts, self.watermark)
        if owed.open_calls or owed.cancelled_input_seqs or not owed.input_seqs:
            return
        entries = T.context_entries(self.facts, self.watermark)
        users = [e["seq"] for e in entries if e.get("message", {}).get("role") == "user"]
        if users:
            first_kept = users[choice % len(users)]
            self.commit("compaction", {"summary": "earlier talk", "firstKept": first_kept})


def answers_follow_their_inputs(facts: Sequence[CommittedFact]) -> None:
    """In the full context, the user messages between two completed answers
    are exactly the inputs the second one consumed."""
    entries = T.context_entries(facts)
    text_of_input = {f.seq: f.data["text"] for f in facts if f.kind == "input"}
    answer_of_text = {
        f.data["content"][0]["text"]: f.data.get("inputSeqs")
        for f in facts
        if f.kind == "assistant" and f.data["content"]
    }
    since_last: list[str] = []
    for entry in entries:
        message = entry.get("message")
        if message is None:  # a compaction
            continue
        if message["role"] == "user":
            since_last.append(message["content"])
        elif message["role"] == "assistant" and not any(
            block.get("type") == "toolCall" for block in message["content"]
        ):
            consumed = answer_of_text[message["content"][0]["text"]] or []
            assert since_last == [text_of_input[seq] for seq in consumed]
            since_last = []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 5)), max_size=60))
def test_every_request_is_well_formed_and_rebuilt_exactly(ops: list[tuple[str, int]]) -> None:
    session = Session()
    session.commit("session_created", {"tenantId": "t"})
    for op, choice in ops:
        session.apply(op, choice)
    # Play the session out, so every input ends answered or cancelled.
    session.apply("crash", 0)
    for _ in range(200):
        session.apply("claim", 1)
        if session.watermark is None:
            break
        for _ in range(500):
            session.apply("step", 0)
            if session.watermark is None:
                break
        else:
            raise AssertionError("an attempt never finishes: it makes no progress")

    facts = session.facts
    assert T.owed(facts, T.highest_input(facts)).nothing
    for request in session.requests:
        check_well_formed(request.messages)
    for answer in facts:
        generation = answer.data.get("generationId", "") if answer.kind == "assistant" else ""
        if not generation.startswith("gen-"):
            continue
        head = int(generation.removeprefix("gen-"))
        watermark = answer_watermark(facts, head)
        rebuilt = request_messages([f for f in facts if f.seq <= head], watermark)
        # The request this answer answered (a crashed attempt may have sent
        # one for the same head under a lower watermark; it was never answered).
        sent = [
            r.messages
            for r in session.requests
            if r.generation_id == generation and r.watermark == watermark
        ]
        assert sent, f"no recorded request for {generation}"
        assert all(messages == rebuilt for messages in sent)
    answers_follow_their_inputs(facts)


def test_an_input_read_later_follows_the_answer_it_missed() -> None:
    """The issue's case: `/slow 2 first`, then `second` while it streams."""
    session = Session()
    session.commit("session_created", {"tenantId": "t"})
    session.apply("input", 0)  # 2: first
    session.apply("claim", 0)  # 3: watermark 2
    session.apply("input", 0)  # 4: second, mid-attempt
    session.apply("step", 0)  # 5: answers [2]
    session.apply("step", 0)  # finish
    session.apply("claim", 0)  # 6: watermark 4
    session.apply("step", 0)  # 7: answers [4]
    roles = [(m["role"], m["content"]) for m in request_messages(session.facts)]
    assert roles == [
        ("user", "u2"),
        ("assistant", [{"type": "text", "text": "a5"}]),
        ("user", "u4"),
        ("assistant", [{"type": "text", "text": "a7"}]),
    ]


def test_a_cancelled_tool_exchange_is_dropped_whole() -> None:
    session = Session()
    session.commit("session_created", {"tenantId": "t"})
    session.apply("input", 0)  # 2
    session.apply("claim", 0)  # 3
    session.apply("step", 1)  # 4: a tool call
    session.apply("cancel", 0)  # 5
    session.apply("step", 0)  # 6, 7: the call closed, the exchange settled
    session.apply("crash", 0)
    session.apply("input", 0)  # 8
    session.apply("claim", 0)
    session.apply("step", 0)
    messages = request_messages(session.facts)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "u8"


def test_inputs_the_cancelled_attempt_never_read_are_settled_too() -> None:
    """A cancel covers every input sent before it; those above the cancelled
    attempt's watermark are settled by the next attempt, under an answer id
    of their own (the first settlement's would deduplicate it away)."""
    session = Session()
    session.commit("session_created", {"tenantId": "t"})
    session.apply("input", 0)  # 2
    session.apply("claim", 0)  # 3: watermark 2
    session.apply("input", 0)  # 4: above the watermark
    session.apply("cancel", 0)  # 5
    session.apply("step", 0)  # 6: settles [2]
    session.apply("step", 0)  # finish
    session.apply("claim", 0)  # 7: watermark 4
    session.apply("step", 0)  # 8: settles [4]
    session.apply("step", 0)  # finish
    assert session.watermark is None
    assert T.owed(session.facts, T.highest_input(session.facts)).nothing
    assert request_messages(session.facts) == ()

"""Double-texting: a second input while an answer is under way, for each
`multitask` strategy, over HTTP and gRPC with a real runner.

The first input is `/slow 60 …` (the scripted model streams its answer over
a minute), so an attempt is running when the second input comes:
- `reject` is refused (session_busy), nothing committed; on an idle session
  it is an ordinary input;
- `interrupt`: the slow answer never commits, and one answer covers both
  (without the interrupt the slow one would be answered alone first);
- `rollback`: the slow input is withdrawn (settled as cancelled, out of the
  model's context) and only the second input is answered; the same request
  sent again commits no second cancel;
- a tenant's loadout `multitask` applies to inputs that name none, and a
  value outside the four is refused with the field named.
"""

from __future__ import annotations

import pytest

from services.ledger import CommittedFact
from services.ledger.facts import ASSISTANT, CANCELLED, INPUT
from services.runner.server import RunnerServer
from tests.support.edge_stack import Stack
from tests.support.front_doors import FrontDoor, Refused
from tests.support.polling import eventually

SLOW = "/slow 60 a long answer that must not finish"
# For `interrupt`: the scripted model acts on every input since its latest
# answer, so the answer to both streams this one's seconds too.
SHORTER = "/slow 6 an answer that is interrupted"


async def _running(stack: Stack, door: FrontDoor, text: str = SLOW) -> tuple[str, int]:
    """A session whose slow answer is under way; its input's seq."""
    session = await door.create_session()
    first = (await door.send_input(session, text, "r-slow")).seq

    async def started() -> bool:
        return any(f.kind == "epoch_started" for f in await stack.facts(session))

    await eventually(started, "the slow answer to start")
    return session, first


async def _final_answers(stack: Stack, session: str) -> list[CommittedFact]:
    return [
        f
        for f in await stack.facts(session)
        if f.kind == ASSISTANT and not f.data.get("toolCalls") and f.data.get("inputSeqs")
    ]


async def _answered(stack: Stack, session: str, seq: int) -> CommittedFact:
    async def probe() -> CommittedFact | None:
        for answer in await _final_answers(stack, session):
            if seq in answer.data["inputSeqs"]:
                return answer
        return None

    found: CommittedFact = await eventually(probe, f"input {seq} to be answered")
    return found


def _busy(refused: Refused) -> bool:
    return (refused.outcome, refused.reason) in {
        ("conflict", "session_busy"),
        ("failed_precondition", "SESSION_BUSY"),
    }


async def test_reject_refuses_while_work_is_owed_and_commits_nothing(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    session, first = await _running(stack, door)
    before = [f.seq for f in await stack.facts(session) if f.kind == INPUT]
    with pytest.raises(Refused) as refused:
        await door.send_input(session, "are you there?", "r-rejected", multitask="reject")
    assert _busy(refused.value), refused.value
    assert [f.seq for f in await stack.facts(session) if f.kind == INPUT] == before

    # Once nothing is owed, a rejectable input is an ordinary one.
    await door.cancel(session)
    await eventually(lambda: _idle(door, session), "the session to be idle after the cancel")
    sent = await door.send_input(session, "now?", "r-accepted", multitask="reject")
    answer = await _answered(stack, session, sent.seq)
    assert answer.data["inputSeqs"] == [sent.seq]
    assert first not in answer.data["inputSeqs"]


async def _idle(door: FrontDoor, session: str) -> bool:
    state = await door.get_session(session)
    return state.status == "idle" and not state.owed_inputs


async def test_interrupt_stops_the_answer_and_one_answer_covers_both(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    session, first = await _running(stack, door, SHORTER)
    second = (await door.send_input(session, "actually, this", "r-int", multitask="interrupt")).seq
    answer = await _answered(stack, session, second)
    assert answer.data["inputSeqs"] == [first, second]
    # The slow answer was stopped, never committed; nothing was answered twice.
    assert [a.data["inputSeqs"] for a in await _final_answers(stack, session)] == [[first, second]]
    facts = await stack.facts(session)
    marked = next(f for f in facts if f.seq == second)
    assert marked.data["multitask"] == "interrupt"
    assert not [f for f in facts if f.kind == CANCELLED]


async def test_rollback_withdraws_the_earlier_input_and_answers_only_the_new(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    session, first = await _running(stack, door)
    sent = await door.send_input(session, "forget that; this", "r-rb", multitask="rollback")
    answer = await _answered(stack, session, sent.seq)
    assert answer.data["inputSeqs"] == [sent.seq]
    facts = await stack.facts(session)
    cancels = [f for f in facts if f.kind == CANCELLED]
    assert [(c.seq, c.data.get("reason")) for c in cancels] == [(sent.seq - 1, "rollback")]
    withdrawn = [
        f for f in facts if f.kind == ASSISTANT and f.data.get("stopReason") == "cancelled"
    ]
    assert [w.data["inputSeqs"] for w in withdrawn] == [[first]]
    # Out of the model's context: the request that answered saw only the new input.
    shown = (await door.get_context(session, answer.seq - 1))["messages"]
    assert SLOW not in repr(shown) and "forget that; this" in repr(shown)

    # The same request again is the same input, and no second cancel.
    again = await door.send_input(session, "forget that; this", "r-rb", multitask="rollback")
    assert again.seq == sent.seq and again.duplicate
    assert len([f for f in await stack.facts(session) if f.kind == CANCELLED]) == 1


async def test_the_tenant_default_applies_and_a_bad_one_is_refused(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    revision, document = await door.get_loadout()
    with pytest.raises(Refused) as refused:
        await door.put_loadout({**document, "multitask": "sometimes"}, revision)
    assert refused.value.outcome == "invalid_argument"
    assert refused.value.field == "multitask" or "multitask:" in str(refused.value)

    await door.put_loadout({**document, "multitask": "reject"}, revision)
    session, _ = await _running(stack, door)

    # The edge reads the default anew within its cache's lifetime (2 s).
    async def refused_by_default() -> bool:
        try:
            await door.send_input(session, "plain", None)
        except Refused as error:
            return _busy(error)
        return False

    await eventually(refused_by_default, "the tenant's reject to apply")

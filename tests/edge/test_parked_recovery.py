"""A session parked by an input the model fails on can be recovered, over
HTTP and gRPC, with a real runner (the scripted model: `/fail` is a failure
retrying cannot fix, so it parks at once).

- the status names the failed input and the reason;
- an input sent to the parked session is owed, and the session stays
  parked: it is never batched with the failed input;
- a skip settles the failed input, and only it: the later input is answered
  on its own, and the model is shown the failed one followed by a note that
  it was skipped and why;
- a cancel of a parked session names every input it settles (the failed
  one and those sent since) and is carried out, not held behind the park;
- a session that is not parked has nothing to skip (SESSION_NOT_PARKED).
"""

from __future__ import annotations

import pytest

from services.ledger.facts import ASSISTANT, INPUTS_SKIPPED
from services.runner.server import RunnerServer
from tests.support.edge_stack import Stack
from tests.support.front_doors import FrontDoor, Refused, SessionState
from tests.support.polling import eventually


async def _parked(door: FrontDoor, session: str) -> SessionState:
    async def probe() -> SessionState | None:
        state = await door.get_session(session)
        return state if state.status == "parked" else None

    parked: SessionState = await eventually(probe, "the session to be parked")
    return parked


async def test_a_parked_session_is_recovered_by_skipping_what_failed(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    session = await door.create_session()
    failed = (await door.send_input(session, "/fail", "r-fail")).seq
    parked = await _parked(door, session)
    assert parked.parked_on == (failed,)
    assert "scripted" in parked.parked_reason

    later = (await door.send_input(session, "hello after the failure", "r-later")).seq
    still = await door.get_session(session)
    assert still.status == "parked"
    assert still.parked_on == (failed,)
    assert still.owed_inputs == (failed, later)

    skip_seq, skipped = await door.skip(session)
    assert skipped == (failed,)

    async def answer_to_later() -> dict[str, object] | None:
        for fact in await stack.facts(session):
            if fact.kind == ASSISTANT and later in (fact.data.get("inputSeqs") or ()):
                return dict(fact.data)
        return None

    answer = await eventually(answer_to_later, "the later input's answer")
    # Answered on its own: the failed input was never asked again.
    assert answer["inputSeqs"] == [later]
    facts = await stack.facts(session)
    assert [f.seq for f in facts if f.kind == INPUTS_SKIPPED] == [skip_seq]
    assert not [
        f for f in facts if f.kind == ASSISTANT and failed in (f.data.get("inputSeqs") or ())
    ]
    settled = await door.get_session(session)
    assert settled.status == "idle" and settled.owed_inputs == ()

    # What the model was shown: the failed input, the note, the later input.
    answer_seq = max(f.seq for f in facts if f.kind == ASSISTANT)
    shown = (await door.get_context(session, answer_seq - 1))["messages"]
    texts = [_text(m) for m in shown]
    assert texts[0] == "/fail"
    assert texts[1].startswith("(this message was skipped after the model failed on it:")
    assert shown[1]["role"] == "assistant"
    assert texts[2] == "hello after the failure"


async def test_a_cancel_of_a_parked_session_settles_what_it_names(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    session = await door.create_session()
    failed = (await door.send_input(session, "/fail", "r-fail")).seq
    await _parked(door, session)
    later = (await door.send_input(session, "and this one", "r-later")).seq

    seq, named = await door.cancel_naming(session)
    assert seq is not None and named == (failed, later)

    async def settling() -> dict[str, object] | None:
        for fact in await stack.facts(session):
            if fact.kind == ASSISTANT and fact.data.get("stopReason") == "cancelled":
                return dict(fact.data)
        return None

    # The park does not hold the cancel back: the runner settles exactly the
    # inputs the cancel named, and nothing is owed after it.
    settled = await eventually(settling, "the cancel to be settled")
    assert settled["inputSeqs"] == [failed, later]
    state = await door.get_session(session)
    assert state.status == "idle" and state.owed_inputs == ()


async def test_a_session_that_is_not_parked_has_nothing_to_skip(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    session = await door.create_session()
    with pytest.raises(Refused) as refused:
        await door.skip(session)
    # HTTP says 409 `not_parked`; gRPC FAILED_PRECONDITION with its reason.
    assert (refused.value.outcome, refused.value.reason) in {
        ("conflict", "not_parked"),
        ("failed_precondition", "SESSION_NOT_PARKED"),
    }


def _text(message: dict[str, object]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    assert isinstance(content, list)
    return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))

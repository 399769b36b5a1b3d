"""Fork and edit over HTTP and gRPC, with a real runner.

- a fork at N holds the parent's facts 1..N (same kinds, data and epochs),
  then `forked_from`; what the model saw at any s <= N is the same in both;
  the parent is untouched, and the fork answers its own next input under its
  own epoch 1 (the invariants hold in both);
- a fork of a fork;
- a fork taken while the parent is answering owes that input, and answers it
  on its own;
- an edit is a fork before the input with the edited text, answered there;
- refusals: a seq past the head, an edit of a seq that is not an input.
"""

from __future__ import annotations

import pytest

from services.ledger import CommittedFact
from services.ledger.facts import ASSISTANT, FORKED_FROM, INPUT
from services.runner.server import RunnerServer
from services.session_invariants import check_session
from tests.support.edge_stack import Stack
from tests.support.front_doors import FrontDoor, Refused
from tests.support.polling import eventually


def _same(fact: CommittedFact) -> tuple[int, str, dict[str, object], int]:
    return fact.seq, fact.kind, dict(fact.data), fact.epoch


def _json(facts: list[CommittedFact]) -> list[dict[str, object]]:
    return [{"seq": f.seq, "kind": f.kind, "epoch": f.epoch, "data": dict(f.data)} for f in facts]


async def _answered(stack: Stack, session: str, seq: int) -> CommittedFact:
    async def probe() -> CommittedFact | None:
        for fact in await stack.facts(session):
            if fact.kind == ASSISTANT and seq in (fact.data.get("inputSeqs") or ()):
                return fact
        return None

    found: CommittedFact = await eventually(probe, f"input {seq} of {session} to be answered")
    return found


async def _turn(stack: Stack, door: FrontDoor, session: str, text: str) -> int:
    seq = (await door.send_input(session, text, None)).seq
    return (await _answered(stack, session, seq)).seq


async def test_a_fork_keeps_the_history_and_goes_on_alone(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    parent = await door.create_session()
    first_answer = await _turn(stack, door, parent, "the first question")
    await _turn(stack, door, parent, "the second question")
    parent_facts = await stack.facts(parent)

    fork = await door.fork(parent, first_answer)
    fork_facts = await stack.facts(fork)
    assert [_same(f) for f in fork_facts[:first_answer]] == [
        _same(f) for f in parent_facts[:first_answer]
    ]
    marker = fork_facts[first_answer]
    assert (marker.seq, marker.kind) == (first_answer + 1, FORKED_FROM)
    assert marker.data == {"sessionId": stack.ledger_id(parent), "seq": first_answer}
    for at in range(2, first_answer + 1):
        assert await door.get_context(fork, at) == await door.get_context(parent, at), at

    answer = await _turn(stack, door, fork, "a question only the fork is asked")
    fork_facts = await stack.facts(fork)
    assert fork_facts[answer - 1].epoch == 1  # the fork's own first epoch
    assert await stack.facts(parent) == parent_facts  # untouched
    assert check_session(fork, _json(fork_facts)) == []

    # A fork of the fork.
    grandchild = await door.fork(fork, answer)
    assert [_same(f) for f in (await stack.facts(grandchild))[:answer]] == [
        _same(f) for f in fork_facts[:answer]
    ]
    await _turn(stack, door, grandchild, "and one more")


async def test_a_fork_taken_mid_answer_answers_that_input_itself(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    parent = await door.create_session()
    asked = (await door.send_input(parent, "/slow 3 an answer under way", None)).seq
    fork = await door.fork(parent, asked)
    # Each answers it, once, on its own.
    in_parent = await _answered(stack, parent, asked)
    in_fork = await _answered(stack, fork, asked)
    assert in_fork.seq > asked + 1 and in_parent.seq > asked
    assert check_session(fork, _json(await stack.facts(fork))) == []
    assert check_session(parent, _json(await stack.facts(parent))) == []


async def test_an_edit_is_a_fork_before_the_input_with_the_new_text(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    parent = await door.create_session()
    await _turn(stack, door, parent, "hello")
    question = (await door.send_input(parent, "what is two plus two", None)).seq
    await _answered(stack, parent, question)

    fork, edited = await door.edit(parent, question, "what is three plus three")
    answer = await _answered(stack, fork, edited)
    facts = await stack.facts(fork)
    assert facts[edited - 1].kind == INPUT
    assert facts[edited - 1].data["text"] == "what is three plus three"
    assert answer.data["inputSeqs"] == [edited]
    assert not any(f.data.get("text") == "what is two plus two" for f in facts)


async def test_refusals(stack: Stack, door: FrontDoor) -> None:
    parent = await door.create_session()
    with pytest.raises(Refused) as past:
        await door.fork(parent, 99)
    assert past.value.outcome == "invalid_argument"
    with pytest.raises(Refused) as not_an_input:
        await door.edit(parent, 1, "x")
    assert not_an_input.value.outcome == "invalid_argument"

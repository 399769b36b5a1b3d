"""`GET /v1/sessions/{id}/context?at=`: exactly what the model was shown for
the request built at that point, as the compaction service rebuilds it: an
input committed while an answer streams is not in that answer's request, and
in the final context it comes after that answer."""

from __future__ import annotations

from typing import Any

from services.runner.server import RunnerServer
from tests.support.edge_stack import Stack
from tests.support.http_errors import assert_error
from tests.support.sse import SseReader

PROMPT = "You answer in echoes."


def text_of(message: dict[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


async def test_context_at_an_answers_head_shows_what_that_request_presented(
    stack: Stack, runner: RunnerServer
) -> None:
    revision = await stack.cluster.kernel.put_loadout("default", {"systemPrompt": PROMPT})
    session = await stack.new_session()
    async with SseReader(stack.http, session) as sse:
        first = await stack.post_input(session, "/slow 2 first", "first")
        assert first.status_code == 202, first.text
        # The first answer is streaming: its request has been built.
        await sse.until(lambda e: e.event == "delta")
        second = await stack.post_input(session, "second", "second")
        assert second.status_code == 202, second.text
    await stack.cluster.settled(stack.ledger_id(session))
    # A later loadout does not change what earlier requests were shown.
    await stack.cluster.kernel.put_loadout("default", {"systemPrompt": "Something else."})

    facts = await stack.facts(session)
    first_seq, second_seq = first.json()["seq"], second.json()["seq"]
    answers = [f for f in facts if f.kind == "assistant"]
    [first_answer] = [a for a in answers if first_seq in a.data["inputSeqs"]]
    assert second_seq < first_answer.seq, "the second input arrived while the first streamed"
    head = int(first_answer.data["generationId"].removeprefix("gen-"))
    [epoch] = [f for f in facts if f.kind == "epoch_started" and f.seq < first_answer.seq]

    response = await stack.http.get(f"/v1/sessions/{session}/context", params={"at": head})
    assert response.status_code == 200, response.text
    shown = response.json()
    assert [(m["role"], text_of(m)) for m in shown["messages"]] == [("user", "/slow 2 first")]
    assert shown["at"] == head
    assert shown["systemPrompt"] == PROMPT and shown["loadoutRevision"] == revision
    assert shown["watermark"] == epoch.data["watermark"]
    assert shown["compactionSeq"] == 0 and shown["estimatedTokens"] > 0

    # At the head: each input, then its answer, in the order the model saw them.
    final = (await stack.http.get(f"/v1/sessions/{session}/context")).json()
    view = (await stack.http.get(f"/v1/sessions/{session}")).json()
    assert final["at"] == view["headSeq"]
    roles = [(m["role"], text_of(m)) for m in final["messages"]]
    assert [role for role, _ in roles] == ["user", "assistant", "user", "assistant"], roles
    assert roles[0][1] == "/slow 2 first" and roles[2][1] == "second"

    beyond = await stack.http.get(
        f"/v1/sessions/{session}/context", params={"at": view["headSeq"] + 1}
    )
    assert assert_error(beyond, 400)["code"] == "seq_out_of_range"
    for bad in ("0", "-1", "x"):
        response = await stack.http.get(f"/v1/sessions/{session}/context", params={"at": bad})
        assert_error(response, 400)

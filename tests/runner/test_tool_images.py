"""An image a tool returns is shown to the model, on both wire protocols.

A runner (in process, on the real ledger and kernel) calls a real MCP server
over stdio (a child of the runner) whose `image {}` tool returns a small
PNG; the model is a loopback server speaking the OpenAI or Anthropic wire
protocol that records every request body. The model asks for the tool; the
request that reports the result must carry the PNG's bytes as an image part:

- Anthropic: an image block inside the `tool_result` block;
- OpenAI chat completions (tool messages carry text only): an `image_url`
  part with a base64 data URL in a user message right after the tool message.

GetContext shows the same image in the tool result, and a compaction of the
session (the summary request goes to the same model) summarizes the tool's
text without sending the image.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from compaction.client import CompactionClient
from services.common.config import Settings
from services.common.secrets import SecretPolicy
from services.ledger import CommittedFact
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.mcp_server import server_command, tiny_png
from tests.support.ports import free_port
from tests.support.provider_frames import DONE, chunk, text_answer, tool_delta, tool_use_answer
from tests.support.wire_servers import WireServer, sse_reply

COMMAND = list(server_command())
FILES = {"source": "mcp", "name": "files", "transport": "stdio", "command": COMMAND}
PNG_BASE64 = base64.b64encode(tiny_png()).decode()
# The wire name of `files.image` (tool_names.py: `.` is refused).
WIRE_TOOL = "files_image"
CALL_ID = "call_image_1"
ANSWER = "a single orange pixel"
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}


@dataclass
class Deployment:
    cluster: Cluster
    runner: RunnerServer
    wire: WireServer
    kind: str


@pytest.fixture(params=["openai", "anthropic"])
async def deployment(
    pg_settings: Settings, request: pytest.FixtureRequest
) -> AsyncIterator[Deployment]:
    kind: str = request.param
    port = free_port()
    policy = SecretPolicy().with_command(COMMAND, "default").with_origin(f"http://127.0.0.1:{port}")
    cluster = await start_cluster(pg_settings.with_overrides(secrets=policy))
    runner: RunnerServer | None = None
    try:
        async with WireServer(PATHS[kind], port=port) as wire:
            base_url = f"{wire.url}/v1" if kind == "openai" else wire.url
            model = {"provider": kind, "name": f"{kind}-test", "baseUrl": base_url}
            await cluster.kernel.put_loadout("default", {"model": model, "tools": [FILES]})
            runner = await RunnerServer(
                cluster.settings,
                RunnerConfig(cluster.ledger_server.target, cluster.kernel_server.target),
            ).start()
            yield Deployment(cluster, runner, wire, kind)
    finally:
        if runner is not None:
            await runner.stop(grace=0.2)
        await stop_cluster(cluster)


def openai_tool_call() -> list[str]:
    call = tool_delta(0, "{}", call_id=CALL_ID, name=WIRE_TOOL)
    return [chunk(call), chunk(finish="tool_calls"), DONE]


def openai_text(text: str) -> list[str]:
    return [chunk({"content": text}), chunk(finish="stop"), DONE]


def queue_replies(deployment: Deployment, *texts: str) -> None:
    """The tool call, then a text answer for each of `texts`."""
    if deployment.kind == "openai":
        deployment.wire.queue(sse_reply(openai_tool_call()))
        deployment.wire.queue(*(sse_reply(openai_text(text)) for text in texts))
    else:
        deployment.wire.queue(sse_reply(tool_use_answer([(CALL_ID, WIRE_TOOL, ["{}"])])))
        deployment.wire.queue(*(sse_reply(text_answer(text)) for text in texts))


def shown_images(kind: str, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The images a request shows after the tool call, where the protocol
    puts them (see the module docstring)."""
    messages: Sequence[Mapping[str, Any]] = body["messages"]
    if kind == "anthropic":
        (turn,) = [m for m in messages if any(b["type"] == "tool_result" for b in m["content"])]
        (result,) = [b for b in turn["content"] if b["type"] == "tool_result"]
        assert result["tool_use_id"] == CALL_ID
        texts = [b["text"] for b in result["content"] if b["type"] == "text"]
        assert any("image/png" in text for text in texts), result
        return [b for b in result["content"] if b["type"] == "image"]
    (position,) = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    tool = messages[position]
    assert tool["tool_call_id"] == CALL_ID and "image/png" in tool["content"], tool
    after = messages[position + 1 :]
    if not after or after[0]["role"] != "user":
        return []
    return [part for part in after[0]["content"] if part["type"] == "image_url"]


def expected_image(kind: str) -> dict[str, Any]:
    if kind == "anthropic":
        source = {"type": "base64", "media_type": "image/png", "data": PNG_BASE64}
        return {"type": "image", "source": source}
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_BASE64}"}}


async def ask(cluster: Cluster, session_id: str, text: str) -> list[CommittedFact]:
    await cluster.new_session(session_id)
    await cluster.send(session_id, text, "r1")
    await cluster.settled(session_id)
    return await cluster.facts(session_id)


async def test_a_tools_image_reaches_the_model_and_the_context_view(
    deployment: Deployment,
) -> None:
    cluster, wire, kind = deployment.cluster, deployment.wire, deployment.kind
    session = f"tool-image-{kind}"
    queue_replies(deployment, ANSWER)
    facts = await ask(cluster, session, "what does the image tool show?")

    (result,) = [f.data for f in facts if f.kind == "tool_result"]
    assert not result["isError"] and len(result["blobs"]) == 1, result
    assert facts[-1].kind == "assistant" and facts[-1].data["content"][-1]["text"] == ANSWER

    asked, reported = (received.body for received in wire.received)
    assert PNG_BASE64 not in json.dumps(asked)
    assert shown_images(kind, reported) == [expected_image(kind)]

    # What the model saw, as GetContext tells it: the same image in the result.
    head = int(facts[-1].data["generationId"].removeprefix("gen-"))
    async with CompactionClient(deployment.runner.target, cluster.settings) as client:
        context = await client.get_context(session, head)
    (tool_result,) = [m for m in context.messages if m["role"] == "toolResult"]
    assert tool_result["content"][-1] == {
        "type": "image",
        "data": PNG_BASE64,
        "mimeType": "image/png",
    }
    assert "image/png" in tool_result["content"][0]["text"]


async def test_a_session_with_a_tools_image_compacts(deployment: Deployment) -> None:
    cluster, wire, kind = deployment.cluster, deployment.wire, deployment.kind
    session = f"tool-image-compacted-{kind}"
    # The answer, then the summary a compaction asks for (of the history,
    # or of the turn it splits).
    queue_replies(deployment, ANSWER, "summary of the history")
    facts = await ask(cluster, session, "what does the image tool show?")
    answered = len(wire.received)
    assert answered == 2

    # Keep almost nothing, so the tool's result is summarized.
    loadout = (await cluster.kernel.get_loadout("default", 0)).document
    await cluster.kernel.put_loadout(
        "default", {**loadout, "compaction": {"keepRecentTokens": 1, "reserveTokens": 1}}
    )
    epoch = (await cluster.ledger.get_session(session)).fence_epoch
    async with CompactionClient(deployment.runner.target, cluster.settings) as client:
        compacted = await client.compact(session, epoch)
        assert compacted.compacted, compacted.skipped_reason
        context = await client.get_context(session)

    summaries = [received.body for received in wire.received[answered:]]
    assert summaries, "the summary was asked of the model"
    for body in summaries:
        sent = json.dumps(body)
        # The summary reads the tool's text; no image travels with it.
        assert PNG_BASE64 not in sent and "image_url" not in sent, sent
        assert "stored as blob" in sent, sent
    assert "summary of the history" in compacted.summary
    assert not any(f.kind == "attempt_failed" for f in facts)
    assert context.compaction_seq == compacted.seq

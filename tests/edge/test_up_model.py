"""`keel up --model openai:…` switches the tour to a real model in one flag.

`keel up` runs as a real process with OPENAI_BASE_URL pointing at a local
server speaking the OpenAI wire protocol (tests/support/wire_servers.py) and
OPENAI_API_KEY set: an input posted over HTTP is answered by that server,
streamed back over SSE, and the server saw the key as the bearer token. The
key itself is stored nowhere: the loadout names the variable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.cli.chat_view import SseEvent
from tests.support.keel_up import keel_cli, keel_up
from tests.support.sse import SseReader, parse
from tests.support.wire_servers import WireServer, data_frame, sse_reply

pytestmark = pytest.mark.slow

KEY = "up-model-test-key-0123456789"
PROVIDER_KEY = "sk-test-up-model-0123"
MODEL = "gpt-test"
WORDS = ["Hello", " from", " the", " wire", "!"]


def _frame(choices: list[dict[str, Any]], **extra: Any) -> str:
    body = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    return data_frame({**body, "choices": choices, **extra})


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> str:
    return _frame([{"index": 0, "delta": delta or {}, "finish_reason": finish}])


def _answer_frames() -> list[str]:
    usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    return [
        _chunk({"role": "assistant", "content": ""}),
        *(_chunk({"content": word}) for word in WORDS),
        _chunk(finish="stop"),
        _frame([], usage=usage),
        data_frame("[DONE]"),
    ]


async def test_keel_up_with_an_openai_model_answers_through_it(tmp_path: Path) -> None:
    async with WireServer("/v1/chat/completions") as wire:
        # Slow enough frames that the answer is seen streaming.
        wire.queue(sse_reply(_answer_frames(), frame_delay=0.1))
        env = {"OPENAI_API_KEY": PROVIDER_KEY, "OPENAI_BASE_URL": f"{wire.url}/v1"}
        data_dir = tmp_path / "data"
        with keel_up(data_dir, KEY, "--model", f"openai:{MODEL}", env=env) as up:
            assert any(f"model: openai {MODEL}" in line for line in up.child.lines)
            record = json.loads(up.discovery_file.read_text())
            assert record["url"] == up.url and record["pid"] == up.child.pid

            async with httpx.AsyncClient(
                base_url=up.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
            ) as http:
                loadout = (await http.get("/v1/loadout")).json()
                assert loadout["document"]["model"] == {
                    "provider": "openai",
                    "name": MODEL,
                    "apiKeyEnv": "OPENAI_API_KEY",
                    "baseUrl": f"{wire.url}/v1",
                }
                assert PROVIDER_KEY not in json.dumps(loadout)

                session = (await http.post("/v1/sessions", json={})).json()["id"]
                events: list[SseEvent] = []
                async with SseReader(http, session, after=0) as sse:
                    posted = await http.post(
                        f"/v1/sessions/{session}/inputs", json={"text": "Say hello"}
                    )
                    assert posted.status_code == 202, posted.text
                    answer = await sse.until(lambda e: e.event == "assistant", into=events)

        # Stopped: the discovery file is gone with it.
        assert not up.discovery_file.exists()

    text = "".join(WORDS)
    content = parse(answer)["data"]["content"]
    assert [part["text"] for part in content if part["type"] == "text"] == [text]
    streamed = [parse(e) for e in events if e.event == "delta"]
    assert "".join(d["text"] for d in streamed if d["channel"] == "text") == text

    (received,) = wire.received
    assert received.headers["authorization"] == f"Bearer {PROVIDER_KEY}"
    assert received.body["model"] == MODEL
    assert received.body["messages"][-1] == {"role": "user", "content": "Say hello"}


async def test_keel_up_refuses_a_model_without_its_key(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    missing = await keel_cli("up", "--data-dir", data, "--model", "anthropic:claude-test")
    assert missing.returncode == 2
    assert missing.stderr == (
        "keel: --model anthropic:claude-test: set ANTHROPIC_API_KEY to the anthropic "
        "API key first\n"
    )
    malformed = await keel_cli("up", "--data-dir", data, "--model", "gpt-4.1-mini")
    assert malformed.returncode == 2 and malformed.stderr.startswith("keel: --model ")
    assert "Traceback" not in missing.stderr + malformed.stderr
    # Nothing started, so nothing was announced.
    assert not (tmp_path / "data" / "keel-up.json").exists()

"""`make run` reaches a working page: `keel up` (what `make run` runs once
installed) as a real child process, then pure HTTP: the page, a session, an
input, and its answer over SSE. No browser (test_web_page.py has one)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import httpx

from services.cli.chat_view import SseParser
from tests.support.ports import free_port
from tests.support.processes import ChildProcess

KEY = "make-run-test-key-0123456789abc"


async def test_keel_up_serves_a_working_page(tmp_path: Path) -> None:
    port = free_port()
    env = dict(os.environ, KEEL_DEV_KEY=KEY, PYTHONUNBUFFERED="1")
    env.pop("KEEL_DATABASE_URL", None)  # the default of `make run`: SQLite
    keel = Path(sys.executable).with_name("keel")
    child = ChildProcess(
        [
            *(str(keel), "up", "--data-dir", str(tmp_path / "data")),
            *("--http-port", str(port), "--grpc-port", "0"),
        ],
        env=env,
    )
    try:
        line = await child.line(lambda text: text.startswith("Keel is up: http://"), 60)
        match = re.match(r"Keel is up: (http://[\d.]+:\d+)/#key=(\S+)$", line)
        assert match is not None, line
        base, key = match.groups()
        assert base == f"http://127.0.0.1:{port}" and key == KEY

        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as http:
            page = await http.get("/")
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert "<html" in page.text.lower()
            assert (await http.get("/readyz")).status_code == 200

            created = await http.post("/v1/sessions", json={})
            assert created.status_code == 201, created.text
            session = created.json()["id"]
            posted = await http.post(
                f"/v1/sessions/{session}/inputs",
                json={"text": "hello from make run", "requestId": "mr-1"},
            )
            assert posted.status_code == 202, posted.text
            input_seq = posted.json()["seq"]

            parser = SseParser()
            answer = None
            seqs: list[int] = []
            async with http.stream("GET", f"/v1/sessions/{session}/events") as stream:
                assert stream.status_code == 200
                async for text in stream.aiter_lines():
                    event = parser.feed(text)
                    if event is None:
                        continue
                    if event.id is not None:
                        seqs.append(int(event.id))
                    if event.event == "assistant":
                        data = json.loads(event.data)["data"]
                        if input_seq in (data.get("inputSeqs") or []):
                            answer = data
                            break
            assert answer is not None
            assert seqs == list(range(1, seqs[-1] + 1))
            words = "".join(
                part.get("text", "") for part in answer["content"] if isinstance(part, dict)
            )
            assert "hello from make run" in words, answer
    finally:
        code = child.terminate(timeout=30)
        assert code == 0, child.output()

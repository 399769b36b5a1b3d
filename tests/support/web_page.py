"""The web pages' tests: `keel up` as a child process, and the system's Chromium.

Chromium comes from the system (`apt-get install chromium`), not from
Playwright's download. On a developer machine without it a browser test is
skipped; with CI=true it fails, because CI must never pass by skipping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from kernel import KernelClient
from services.common.config import Settings
from tests.support.internal_auth import token_env, with_token
from tests.support.ports import free_port
from tests.support.processes import ROOT, ChildProcess

CHROMIUM = Path("/usr/bin/chromium")


CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


KEY = "web-page-test-key-0123456789"


# Screenshots a person looks at to judge the page; kept after the run.
ARTIFACTS = ROOT / "test-artifacts"


WAIT_MS = 20_000


# The kernel logs the port of each gRPC service it serves (KEEL_LOG_LEVEL=INFO).
_KERNEL_PORT = re.compile(r"serving keel\.kernel\.v1\.KernelService on port (\d+)")


# A window small enough that a few `/long 300` turns call for a compaction
# (the loadout of tests/compaction/test_runner_compaction.py).
QUICK_COMPACTION_LOADOUT: dict[str, Any] = {
    "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": 2400},
    "compaction": {"enabled": True, "keepRecentTokens": 700, "reserveTokens": 600},
}


@dataclass(frozen=True)
class KeelUp:
    """A running `keel up`: its base URL, the process, and its kernel's address
    (embedded mode only; empty with --processes)."""

    base_url: str
    child: ChildProcess
    kernel_target: str


@contextlib.contextmanager
def keel_up_process(data_dir: Path, key: str = KEY, *, processes: bool = False) -> Iterator[KeelUp]:
    """`keel up` as a real child process, once it is serving."""
    port = free_port()
    env = dict(os.environ, KEEL_DEV_KEY=key, PYTHONUNBUFFERED="1", KEEL_LOG_LEVEL="INFO")
    # A token of the test's choosing (an explicit one wins over the one
    # `keel up` would make), so the test can call the kernel itself.
    env.update(token_env())
    # SQLite under data_dir, whatever the surrounding environment points at.
    env.pop("KEEL_DATABASE_URL", None)
    keel = Path(sys.executable).with_name("keel")
    args = [str(keel), "up", "--data-dir", str(data_dir), "--http-port", str(port)]
    args += ["--grpc-port", "0"]
    child = ChildProcess([*args, "--processes"] if processes else args, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        child.wait_for_line(lambda line: f"{base}/" in line, timeout=60)
        kernel = ""
        if not processes:
            line = child.wait_for_line(lambda text: bool(_KERNEL_PORT.search(text)), timeout=5)
            match = _KERNEL_PORT.search(line)
            assert match is not None
            kernel = f"127.0.0.1:{match.group(1)}"
        yield KeelUp(base, child, kernel)
    finally:
        child.terminate_or_kill(timeout=30)


@contextlib.contextmanager
def keel_up(data_dir: Path, key: str = KEY) -> Iterator[str]:
    """`keel up` as a real child process; yields its base URL once it is serving."""
    with keel_up_process(data_dir, key) as up:
        yield up.base_url


async def use_quick_compaction(kernel_target: str) -> int:
    """Sets tenant "default"'s loadout to one that compacts after a few turns."""
    async with KernelClient(kernel_target, with_token(Settings())) as kernel:
        return await kernel.put_loadout("default", QUICK_COMPACTION_LOADOUT)


async def talk_until_compacted(
    http: httpx.AsyncClient, session_id: str, texts: list[str], deadline_s: float = 90
) -> list[dict[str, Any]]:
    """Sends each text once the previous one is answered, until the session
    holds a compaction and an answer after it; returns its facts."""
    path = f"/v1/sessions/{session_id}"
    async with asyncio.timeout(deadline_s):
        for text in texts:
            posted = await http.post(
                f"{path}/inputs", json={"text": text, "requestId": uuid.uuid4().hex}
            )
            assert posted.status_code == 202, posted.text
            seq = posted.json()["seq"]
            while True:
                page = (await http.get(f"{path}/events?format=json&limit=1000")).json()
                facts: list[dict[str, Any]] = page["facts"]
                compacted = [f["seq"] for f in facts if f["kind"] == "compaction"]
                if compacted and any(
                    f["kind"] == "assistant" and f["seq"] > compacted[0] for f in facts
                ):
                    return facts
                if any(
                    f["kind"] == "assistant" and seq in f["data"].get("inputSeqs", [])
                    for f in facts
                ):
                    break
                await asyncio.sleep(0.1)
    raise AssertionError(f"no compaction after {len(texts)} turns")


def screenshot_path(name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS / name


def require_chromium() -> None:
    if CHROMIUM.exists():
        return
    message = f"{CHROMIUM} is missing (apt-get install chromium)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI=true: the browser test must run)")
    pytest.skip(message)


@contextlib.asynccontextmanager
async def launched_browser() -> AsyncIterator[Browser]:
    """The system's Chromium, headless, through playwright."""
    require_chromium()
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            await launched.close()


@dataclass
class ChatPage:
    """The chat page on a new session of its own, and the page errors seen."""

    page: Page
    session_id: str
    errors: list[str]


async def chat_on_a_new_session(browser: Browser, base_url: str) -> ChatPage:
    """Opens the page with the dev key, makes a session with its button, and
    waits until the page shows it."""
    page = await browser.new_page(viewport={"width": 1100, "height": 720})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    await page.goto(f"{base_url}/#key={KEY}")
    await page.click("#new-session")
    await expect(page.locator('#transcript [data-kind="session_created"]')).to_have_count(1)
    selected = page.locator("#sessions li[aria-selected='true']")
    session_id = await selected.get_attribute("data-session-id")
    assert session_id
    return ChatPage(page, session_id, errors)

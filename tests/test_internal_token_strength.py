"""The internal token opens every internal service, so a service refuses to
start with one weaker than an API key may be (24 characters, 10 of them
different): one line saying why, exit code 2. A real `python -m
services.ledger` process each time, as an operator starts it."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from tests.support.internal_auth import TEST_TOKEN
from tests.support.keel_up import clean_env, run_keel
from tests.support.processes import ChildProcess


def _ledger(token: str, data_dir: Path) -> ChildProcess:
    env = clean_env(KEEL_DATA_DIR=str(data_dir), KEEL_INTERNAL_TOKEN=token)
    return ChildProcess.python("-m", "services.ledger", "--address", "127.0.0.1:0", env=env)


@pytest.mark.parametrize(
    "token",
    [
        "aaaaaaaaaaaaaaaa",  # accepted before: long enough for the old rule
        "ab" * 16,  # long, but two different characters
        "keel-short-token-0123",  # varied, but 21 characters
    ],
    ids=["one-character", "two-characters", "short"],
)
def test_a_service_refuses_a_weak_internal_token_in_one_line(token: str, tmp_path: Path) -> None:
    ledger = _ledger(token, tmp_path / "data")
    code = ledger.proc.wait(timeout=60)
    ledger.kill()
    assert code == 2, ledger.output()
    (line,) = ledger.lines
    assert line.startswith("keel ledger: KEEL_INTERNAL_TOKEN is too weak"), line
    assert "24 characters, 10 of them different" in line
    assert token not in line  # the refused secret is not echoed


@pytest.mark.parametrize("token", [TEST_TOKEN, secrets.token_urlsafe(32)], ids=["tests", "random"])
def test_a_service_starts_with_a_strong_internal_token(token: str, tmp_path: Path) -> None:
    ledger = _ledger(token, tmp_path / "data")
    try:
        assert ledger.wait_listening(60).startswith("127.0.0.1:")
    finally:
        assert ledger.terminate() == 0, ledger.output()


def test_keel_up_refuses_a_weak_internal_token(tmp_path: Path) -> None:
    result = run_keel(
        "up",
        "--data-dir",
        str(tmp_path / "data"),
        env={"KEEL_INTERNAL_TOKEN": "aaaaaaaaaaaaaaaa"},
    )
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("keel up: KEEL_INTERNAL_TOKEN is too weak"), line
    assert "Traceback" not in result.stdout + result.stderr

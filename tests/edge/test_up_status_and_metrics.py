"""`keel status` never cuts an id, and an embedded `keel up`'s edge serves
every service's metrics on its `/metrics`.

One real `keel up` (embedded) for all of it:
- `keel status --json` is the edge's answer, full ids;
- `keel status` into a pipe (with a narrow COLUMNS, which once cut the ids
  there) prints each runtime id whole, on its runtime's line;
- `keel status` in a 40-column terminal (a real pseudo-terminal) prints
  each id whole on a line of its own;
- GET /metrics (operator key) shows the ledger's, kernel's, runner's and
  compaction's series beside the edge's: before, only the edge's were there
  (the others existed only on `--metrics-port`).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import termios
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.keel_up import KEEL, RunningKeel, clean_env, keel_up, run_keel

pytestmark = pytest.mark.slow

KEY = "up-status-test-key-0123456789abc"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningKeel]:
    with keel_up(tmp_path_factory.mktemp("status") / "data", KEY) as running:
        yield running


def client_env(up: RunningKeel, **extra: str) -> dict[str, str]:
    return {"KEEL_DATA_DIR": str(up.data_dir), "KEEL_API_KEY": KEY, **extra}


def status_json(up: RunningKeel) -> dict[str, object]:
    done = run_keel("status", "--json", env=client_env(up))
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    report: dict[str, object] = json.loads(line)
    return report


def runtimes(up: RunningKeel) -> list[tuple[str, str]]:
    """(runtime id, role) of every runtime the edge lists."""
    headers = {"Authorization": f"Bearer {KEY}"}
    listed = httpx.get(f"{up.url}/v1/runtime/status", headers=headers).json()["runtimes"]
    assert listed
    return [(str(r["runtimeId"]), str(r["role"])) for r in listed]


def test_status_json_is_the_edges_answer_with_full_ids(up: RunningKeel) -> None:
    report = status_json(up)
    answer = httpx.get(
        f"{up.url}/v1/runtime/status", headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    assert [r["runtimeId"] for r in report["runtimes"]] == [  # type: ignore[attr-defined]
        r["runtimeId"] for r in answer["runtimes"]
    ]
    assert any(r["role"] == "runner" for r in answer["runtimes"])


def test_status_into_a_pipe_prints_whole_ids(up: RunningKeel) -> None:
    done = run_keel("status", env=client_env(up, COLUMNS="40"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for runtime_id, role in runtimes(up):
        assert any(runtime_id in line and role in line for line in lines), done.stdout


def test_status_in_a_narrow_terminal_prints_whole_ids(up: RunningKeel) -> None:
    ids = [runtime_id for runtime_id, _ in runtimes(up)]
    leader, follower = pty.openpty()
    # 40 columns, 50 rows: the size a terminal reports to what runs in it.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 40, 0, 0))
    env = clean_env(**client_env(up))
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    # (rich takes a "dumb" terminal to be 80 columns wide, whatever it says)
    env["TERM"] = "xterm"
    with subprocess.Popen(
        # Input and output on the terminal, as in a shell (rich asks stdin first).
        [str(KEEL), "status"],
        stdin=follower,
        stdout=follower,
        stderr=subprocess.PIPE,
        env=env,
    ) as child:
        os.close(follower)
        output = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            output += chunk
        assert child.wait(timeout=60) == 0
    os.close(leader)
    text = ANSI_ESCAPE.sub("", output.decode(errors="replace"))
    lines = [line.strip() for line in text.splitlines()]
    for runtime_id in ids:
        assert runtime_id in lines, "\n".join(lines)


def test_the_edges_metrics_show_every_embedded_service(up: RunningKeel) -> None:
    answer = httpx.get(f"{up.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200, answer.text
    names = {family.name for family in text_string_to_metric_families(answer.text)}
    for service in ("edge", "ledger", "kernel", "runner", "compaction"):
        assert any(name.startswith(f"keel_{service}_") for name in names), (service, names)
    # Each family once: the edge's own series are not repeated from the process's.
    assert answer.text.count("# TYPE keel_edge_requests_total ") == 1

"""One `keel up` per data dir: a second one is refused in one line, and the
first keeps serving and stays findable; a SIGKILLed one leaves no lock.

Before the lock, the second `keel up` started beside the first and, on its
way out, deleted the first one's keel-up.json, after which `keel status`
and the rest could no longer find the Keel that was still running.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.keel_up import keel_up, run_keel

pytestmark = pytest.mark.slow

KEY = "up-lock-test-key-0123456789abc"


def second_up(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return run_keel(
        *("up", "--data-dir", str(data_dir), "--http-port", "0", "--grpc-port", "0"),
        env={"KEEL_DEV_KEY": KEY},
    )


def test_a_second_keel_up_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with keel_up(data_dir, KEY) as first:
        announced = json.loads(first.discovery_file.read_text())
        refused = second_up(data_dir)
        assert refused.returncode == 1, refused
        assert refused.stderr == (
            f"keel up: {data_dir} is in use by another keel up (pid {first.child.pid}): "
            "stop it, or give this one another --data-dir\n"
        )
        assert "Keel is up" not in refused.stdout
        # The first one's announcement is intact, and clients still find it.
        assert json.loads(first.discovery_file.read_text()) == announced
        status = run_keel("status", "--data-dir", str(data_dir), env={"KEEL_API_KEY": KEY})
        assert status.returncode == 0, status.stderr
        assert (
            httpx.get(f"{first.url}/readyz", headers={"Authorization": f"Bearer {KEY}"})
        ).status_code == 200

        # SIGKILL: nothing of it runs on to let go, the kernel drops the lock.
        first.child.kill()
        with keel_up(data_dir, KEY) as successor:
            assert successor.child.pid != first.child.pid
            assert json.loads(successor.discovery_file.read_text())["pid"] == successor.child.pid

"""`keel up --grpc-base-port B`: the internal services on B, B+1, … in the
order ledger(s), kernel(s), compaction, runners; a busy one is named in one
line before anything starts, and ports asked for twice are refused.

The base port in use (the runner on B+3, also after it is replaced) is
shown by tests/test_local_drain.py, whose `keel up --processes` runs with one.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support.keel_up import free_port_run, run_keel

pytestmark = pytest.mark.slow

KEY = "up-base-port-test-key-0123456789"


def up(data_dir: Path, *args: str) -> tuple[int, str, str]:
    done = run_keel(
        *("up", "--data-dir", str(data_dir), "--http-port", "0", "--grpc-port", "0", *args),
        env={"KEEL_DEV_KEY": KEY},
    )
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize(
    ("mode", "offset", "service"),
    [(("--processes",), 1, "kernel"), ((), 3, "runner-1")],
    ids=["processes", "embedded"],
)
def test_a_busy_internal_port_is_named_in_one_line(
    tmp_path: Path, mode: tuple[str, ...], offset: int, service: str
) -> None:
    base = free_port_run(4)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + offset))
        holder.listen()
        code, out, err = up(tmp_path / "data", *mode, "--grpc-base-port", str(base))
    assert code == 1, err
    assert err == (
        f"keel up: port {base + offset} (the internal gRPC port of {service}) is in use: "
        "stop what listens there or choose another with --grpc-base-port\n"
    )
    assert "Keel is up" not in out


def test_the_base_port_comes_from_the_environment_and_may_not_overlap(tmp_path: Path) -> None:
    base = free_port_run(4)
    done = run_keel(
        *("up", "--data-dir", str(tmp_path / "data"), "--processes"),
        *("--http-port", str(base + 2), "--grpc-port", "0"),
        env={"KEEL_DEV_KEY": KEY, "KEEL_GRPC_BASE_PORT": str(base)},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"keel up: port {base + 2} would be both the HTTP port and the internal gRPC port "
        "of compaction: change --grpc-base-port or --http-port\n"
    )

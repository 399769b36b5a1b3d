"""`keel up` on a port something else listens on ends at once with one line
naming the port and what it was for, exit 1, in both modes.

Before, embedded `keel up` printed ~110 lines of traceback and "Error in
sys.excepthook", and `keel up --processes` with its gRPC port taken started
everything and then restarted its edge forever.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.keel_up import run_keel

pytestmark = pytest.mark.slow

KEY = "up-busy-port-test-key-0123456789"


@contextmanager
def listening() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def up(data_dir: Path, *args: str) -> tuple[int, str, str]:
    done = run_keel("up", "--data-dir", str(data_dir), *args, env={"KEEL_DEV_KEY": KEY})
    return done.returncode, done.stdout, done.stderr


def test_embedded_keel_up_on_a_busy_http_port_says_so_in_one_line(tmp_path: Path) -> None:
    with listening() as port:
        code, out, err = up(tmp_path / "data", "--http-port", str(port), "--grpc-port", "0")
    assert code == 1, err
    assert err == (
        f"keel up: port {port} (the HTTP port) is in use: stop what listens there "
        "or choose another with --http-port\n"
    )
    assert "Keel is up" not in out


def test_keel_up_processes_on_a_busy_grpc_port_says_so_in_one_line(tmp_path: Path) -> None:
    with listening() as port:
        code, out, err = up(
            tmp_path / "data", "--processes", "--http-port", "0", "--grpc-port", str(port)
        )
    assert code == 1, err
    assert err == (
        f"keel up: port {port} (the gRPC port) is in use: stop what listens there "
        "or choose another with --grpc-port\n"
    )
    # Nothing was started (so nothing restarted in a loop).
    assert "pid" not in out, out

"""`keel up --processes` with its *default* gRPC port (8081) taken ends at
once with one line naming it, exit 1 (issue 24, point 13: it used to start
everything and restart its edge forever). A port given on the command line
is tests/edge/test_up_busy_port.py."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.keel_up import run_keel

pytestmark = pytest.mark.slow

KEY = "up-default-port-key-0123456789"
DEFAULT_GRPC_PORT = 8081


@contextlib.contextmanager
def default_grpc_port_taken() -> Iterator[None]:
    """Port 8081 held by this test, or already held by something else."""
    with socket.socket() as holder:
        # A connection of an earlier test in TIME_WAIT must not keep it free.
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind(("127.0.0.1", DEFAULT_GRPC_PORT))
            holder.listen()
        except OSError:
            pass  # someone else listens there: it is taken all the same
        yield


def test_keel_up_processes_with_its_default_grpc_port_taken_says_so_in_one_line(
    tmp_path: Path,
) -> None:
    with default_grpc_port_taken():
        done = run_keel(
            "up",
            "--processes",
            "--data-dir",
            str(tmp_path / "data"),
            "--http-port",
            "0",
            env={"KEEL_DEV_KEY": KEY},
        )
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        f"keel up: port {DEFAULT_GRPC_PORT} (the gRPC port) is in use: stop what listens "
        "there or choose another with --grpc-port\n"
    )
    assert "pid" not in done.stdout, done.stdout

"""A PostgreSQL cluster of a test's own, which the test may stop and start.

`initdb` into a temporary directory and `pg_ctl` on a free loopback port,
trust authentication, the unix socket in the same directory: the shared
server other tests use is never touched. PostgreSQL refuses to run as root,
so under root the cluster belongs to the `postgres` account and every
command runs as that user (`runuser`).

A cluster that cannot be started skips the test on a developer machine;
with CI=true it fails it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.ports import free_port

PG_BIN = Path(os.environ.get("KEEL_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
# The account a cluster runs as when the tests run as root.
PG_ACCOUNT = "postgres"
PG_CTL_TIMEOUT_S = 60


class ThrowawayPostgres:
    """One cluster in `root` on `port`; `url` names its `postgres` database."""

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.data = root / "data"
        self.log = root / "postgres.log"
        self._as_root = os.geteuid() == 0

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        command = [str(PG_BIN / args[0]), *args[1:]]
        if self._as_root:
            command = ["runuser", "-u", PG_ACCOUNT, "--", *command]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PG_CTL_TIMEOUT_S + 30, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{args[0]} failed ({done.returncode}): {done.stdout}{done.stderr}"
                f"{self._log_tail()}"
            )

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n" + "\n".join(self.log.read_text().splitlines()[-20:])
        return ""

    def init(self) -> None:
        if self._as_root:
            account = pwd.getpwnam(PG_ACCOUNT)
            os.chown(self.root, account.pw_uid, account.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8")

    def start(self) -> None:
        """Starts the server and waits until it takes connections."""
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
            "-c fsync=off -c max_connections=200"
        )
        self._run(
            "pg_ctl",
            *("-D", str(self.data), "-l", str(self.log), "-o", options),
            *("-w", "-t", str(PG_CTL_TIMEOUT_S), "start"),
        )

    def stop(self) -> None:
        """Stops the server at once: clients' connections are cut, as in an
        outage (`fast` rolls back open transactions and closes them)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def reachable(self) -> bool:
        try:
            with psycopg.connect(self.url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    """A started cluster, stopped and removed afterwards."""
    if not (PG_BIN / "initdb").exists():
        _unavailable(f"no initdb in {PG_BIN}")
    # A short path of its own: the unix socket's path must fit in 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="keel-pg-"))
    cluster = ThrowawayPostgres(root, free_port())
    try:
        try:
            cluster.init()
            cluster.start()
        except (RuntimeError, OSError, KeyError, subprocess.TimeoutExpired) as error:
            _unavailable(f"could not start a PostgreSQL cluster: {error}")
        yield cluster
    finally:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            if (cluster.data / "postmaster.pid").exists():
                cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _unavailable(message: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI=true: PostgreSQL tests must run)")
    pytest.skip(message)

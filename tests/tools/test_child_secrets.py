"""An MCP stdio server cannot read its runner's secrets (issue 24, point 3).

A real runner process, the offline model and a real MCP server over stdio
(tests/support/mcp_probe_server.py, standard library only) that reads the
paths it is given: `/proc/<runner>/environ` (the internal token and the
variables granted to every tenant) and the data dir's `internal-token`
(where `keel up` keeps its token). Both reads fail; a file every uid may read
is read, so the failures are the sandbox's doing.

Run as root (as `keel up` may be, here and in CI), the runner starts its
servers as `nobody`, or, for a server `nobody` cannot execute, as root with
no capability in namespaces of its own; run as another user, in namespaces
of their own. The
second test takes the path of a runner that is not root even when the tests
are: the launcher (agent_io/tools/child_launch.py), started by a process of
another uid that holds a secret in its environment, runs the probe in user,
mount and PID namespaces of its own. Where the kernel refuses user
namespaces to a user that is not root, only root's path can be tested.
The third shows that a runner makes itself undumpable at start, which is
what still holds where the kernel gives it no namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_io.tools import child_sandbox
from services.cli.data_dir import TOKEN_FILE, data_dir_token
from services.common.config import Settings
from services.common.secrets import SecretPolicy
from tests.support import mcp_probe_server
from tests.support.cluster import Cluster, running_cluster
from tests.support.processes import ROOT

pytestmark = pytest.mark.slow

OTHER_TENANTS_KEY = "sk-initech-not-for-tool-servers"
# The uid a test runs its stand-in runner as, when the test itself is root.
STAND_IN_UID = child_sandbox.NOBODY
DEADLINE_S = 60.0


def tool_uid() -> int:
    return child_sandbox.NOBODY if os.geteuid() == 0 else os.geteuid()


def interpreter_for(uid: int) -> str:
    """A Python 3 that `uid` may execute: this one, else the system's."""
    for candidate in (sys.executable, shutil.which("python3", path="/usr/bin:/bin")):
        if candidate and child_sandbox.unreachable(candidate, uid, uid) is None:
            return candidate
    raise AssertionError(f"no Python 3 that uid {uid} may execute (the probe server needs one)")


@pytest.fixture
def probe_dir() -> Iterator[Path]:
    """The probe server in a directory every uid may read (a test's tmp_path
    is closed to other uids)."""
    where = Path(tempfile.mkdtemp(prefix="keel-probe-"))
    where.chmod(0o755)
    script = where / mcp_probe_server.SOURCE.name
    shutil.copyfile(mcp_probe_server.SOURCE, script)
    script.chmod(0o644)
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def probe_command(probe_dir: Path) -> list[str]:
    return [interpreter_for(tool_uid()), str(probe_dir / mcp_probe_server.SOURCE.name)]


@pytest.fixture
def runner_tmp() -> Iterator[Path]:
    """The runner's TMPDIR, where it makes its servers' private homes: a
    directory other uids may pass through, removed after the test (the runner
    is killed, so it cannot)."""
    where = Path(tempfile.mkdtemp(prefix="keel-runner-tmp-"))
    where.chmod(0o711)
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
async def cluster(
    sqlite_settings: Settings, probe_command: list[str]
) -> AsyncIterator[tuple[Cluster, SecretPolicy]]:
    policy = SecretPolicy().with_command(probe_command).with_grant("initech", "INITECH_KEY")
    async with running_cluster(sqlite_settings.with_overrides(secrets=policy)) as running:
        yield running, policy


async def probe(cluster: Cluster, session_id: str, path: str) -> dict[str, Any]:
    """What the probe server says when the model asks it to read `path`."""
    await cluster.new_session(session_id)
    await cluster.send(session_id, f'/tool probe.read {{"path": "{path}"}}', "r1")
    await cluster.settled(session_id)
    (result,) = [f.data for f in await cluster.facts(session_id) if f.kind == "tool_result"]
    assert not result["isError"], result
    body: dict[str, Any] = json.loads(result["content"])
    return body


async def test_a_tool_server_reads_neither_the_runners_environment_nor_its_token_file(
    cluster: tuple[Cluster, SecretPolicy],
    probe_command: list[str],
    probe_dir: Path,
    runner_tmp: Path,
) -> None:
    if os.geteuid() != 0 and (refused := user_namespaces_refused(os.geteuid())) is not None:
        pytest.skip(f"this kernel refuses user namespaces: {refused}")
    running, policy = cluster
    data_dir = running.settings.data_dir
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = data_dir_token(data_dir)  # as `keel up` makes it
    tool = {"source": "mcp", "name": "probe", "transport": "stdio", "command": probe_command}
    await running.kernel.put_loadout("default", {"tools": [tool]})
    runner = running.start_runner(
        **policy.to_env(),
        KEEL_TOOL_SANDBOX="auto",  # the default (the tests' own is off)
        INITECH_KEY=OTHER_TENANTS_KEY,
        TMPDIR=str(runner_tmp),
    )
    await running.runner_ready(runner)

    readable = await probe(running, "s-readable", str(probe_dir / mcp_probe_server.SOURCE.name))
    assert readable["ok"], readable

    environ = await probe(running, "s-environ", f"/proc/{runner.pid}/environ")
    assert not environ["ok"], "the tool server read the runner's environment"
    token_file = await probe(running, "s-token", str(data_dir / TOKEN_FILE))
    assert not token_file["ok"], "the tool server read the data dir's internal token"
    for seen in (environ, token_file):
        text = seen.get("text", "")
        assert running.settings.internal_token not in text and token not in text
        assert OTHER_TENANTS_KEY not in text


@pytest.mark.skipif(os.geteuid() != 0, reason="the fallback of a runner that switches uid")
async def test_a_server_the_tool_uid_cannot_run_runs_as_root_without_capabilities(
    sqlite_settings: Settings, probe_dir: Path, runner_tmp: Path
) -> None:
    """A root runner's servers are often installed where `nobody` cannot go
    (a virtualenv under /root, closed to other uids). Such a server runs as
    root with no capability, in namespaces of its own, and still reads none
    of the runner's secrets."""
    command = [sys.executable, str(probe_dir / mcp_probe_server.SOURCE.name)]
    if (
        child_sandbox.unreachable(sys.executable, child_sandbox.NOBODY, child_sandbox.NOBODY)
        is None
    ):
        pytest.skip("this interpreter is open to uid 65534: nothing falls back")
    policy = SecretPolicy().with_command(command).with_grant("initech", "INITECH_KEY")
    async with running_cluster(sqlite_settings.with_overrides(secrets=policy)) as running:
        data_dir = running.settings.data_dir
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        token = data_dir_token(data_dir)
        tool = {"source": "mcp", "name": "probe", "transport": "stdio", "command": command}
        await running.kernel.put_loadout("default", {"tools": [tool]})
        runner = running.start_runner(
            **policy.to_env(),
            KEEL_TOOL_SANDBOX="auto",
            INITECH_KEY=OTHER_TENANTS_KEY,
            TMPDIR=str(runner_tmp),
        )
        await running.runner_ready(runner)

        await running.new_session("s-who")
        await running.send("s-who", "/tool probe.identity {}", "r1")
        await running.settled("s-who")
        (result,) = [f.data for f in await running.facts("s-who") if f.kind == "tool_result"]
        assert not result["isError"], result
        who = json.loads(result["content"])
        environ = await probe(running, "s-environ", f"/proc/{runner.pid}/environ")
        token_file = await probe(running, "s-token", str(data_dir / TOKEN_FILE))
        internal_token = running.settings.internal_token
    assert who["uid"] == 0
    capabilities = who["capabilities"]
    assert capabilities["CapEff"] == capabilities["CapPrm"] == capabilities["CapBnd"] == 0, who
    assert not environ["ok"], "the tool server read the runner's environment"
    assert not token_file["ok"], "the tool server read the data dir's internal token"
    for seen in (environ, token_file):
        text = seen.get("text", "")
        assert internal_token not in text and token not in text
        assert OTHER_TENANTS_KEY not in text


def user_namespaces_refused(uid: int) -> str | None:
    """Why a process of `uid` cannot make a user namespace here, if it cannot."""
    as_uid = [] if uid == os.geteuid() else stand_in_prefix(uid)
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare(1) to try user namespaces with"
    tried = subprocess.run(
        [*as_uid, unshare, "--user", "--mount", "--pid", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    return tried.stderr.strip() or f"exit {tried.returncode}" if tried.returncode else None


def stand_in_prefix(uid: int) -> list[str]:
    setpriv = shutil.which("setpriv")
    assert setpriv is not None, "util-linux's setpriv is needed to run as another uid"
    return [setpriv, "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--"]


# Run by the stand-in runner: holds a secret in its environment (and stays
# dumpable, as a process of another program would), starts the launcher as
# `child_sandbox.launch` said, as its parent, and prints what the probe printed.
STAND_IN = """
import json, os, subprocess, sys
launch = json.loads(sys.argv[1])
args = launch["args"]
if "--parent" in args:
    args[args.index("--parent") + 1] = str(os.getpid())
args = [arg.replace("{stand-in}", str(os.getpid())) for arg in args]
done = subprocess.run([launch["command"], *args], env=launch["env"], cwd=launch["cwd"],
                      capture_output=True, text=True, timeout=60)
print(json.dumps({"stdout": done.stdout, "stderr": done.stderr, "code": done.returncode}))
"""

# The probe of the second test: reads each path as mcp_probe_server's `read`.
READER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from mcp_probe_server import read
print(json.dumps([read(path) for path in sys.argv[2:]]))
"""


def test_without_root_the_launcher_hides_the_data_dir_and_every_other_process(
    probe_dir: Path,
) -> None:
    uid = STAND_IN_UID if os.geteuid() == 0 else os.geteuid()
    refused = user_namespaces_refused(uid)
    if refused is not None:
        pytest.skip(f"this kernel refuses user namespaces to uid {uid}: {refused}")
    python = interpreter_for(uid)
    home = Path(tempfile.mkdtemp(prefix="keel-nonroot-"))
    try:
        data_dir = home / "data"
        data_dir.mkdir(mode=0o700)
        token_file = data_dir / TOKEN_FILE
        token_file.write_text("keel-up-token-of-a-user\n")
        token_file.chmod(0o600)
        for path in (home, data_dir, token_file):
            os.chown(path, uid, uid)
        launcher = child_sandbox.LAUNCHER
        if child_sandbox.unreachable(str(launcher), uid, uid) is not None:
            launcher = Path(shutil.copyfile(launcher, probe_dir / launcher.name))
            launcher.chmod(0o644)
        policy = child_sandbox.SandboxPolicy(
            userns=True, masks=(str(data_dir),), interpreter=python, launcher=str(launcher)
        )
        paths = [
            str(probe_dir / mcp_probe_server.SOURCE.name),
            "/proc/{stand-in}/environ",
            str(token_file),
        ]
        launch = child_sandbox.launch(
            python, ["-c", READER, str(probe_dir), *paths], {"PATH": "/usr/bin:/bin"}, policy
        )
        spec = {"command": launch.command, "args": launch.args, "env": launch.env, "cwd": str(home)}
        as_uid = stand_in_prefix(uid) if uid != os.geteuid() else []
        secret = "stand-in-secret-token"
        done = subprocess.run(
            [*as_uid, python, "-c", STAND_IN, json.dumps(spec)],
            env={"PATH": "/usr/bin:/bin", "KEEL_INTERNAL_TOKEN": secret},
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            check=True,
        )
        ran = json.loads(done.stdout)
        assert ran["code"] == 0, ran
        readable, environ, token = json.loads(ran["stdout"])
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert readable["ok"], (readable, ran["stderr"])
    assert not environ["ok"], "the tool server read its starter's environment"
    assert not token["ok"], "the tool server read the data dir's internal token"
    assert secret not in environ.get("text", "") and "keel-up-token" not in token.get("text", "")


# What a runner does at start, in a process of its own: is it dumpable after?
UNDUMPABLE = """
import ctypes
from pathlib import Path
from services.common.config import Settings
from services.runner.server import protect_secrets_from_tools
PR_GET_DUMPABLE = 3
before = ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
protect_secrets_from_tools(Settings(data_dir=Path("data")))
print(before, ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0))
"""


def test_a_runner_is_not_dumpable_unless_the_sandbox_is_off(tmp_path: Path) -> None:
    """Where namespaces are refused (a container's seccomp profile), this is
    what keeps a server of the runner's uid out of /proc/<runner>/environ."""
    seen: dict[str, list[str]] = {}
    for mode in ("auto", "off"):
        env = {**os.environ, "KEEL_TOOL_SANDBOX": mode, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", UNDUMPABLE],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            check=True,
        )
        seen[mode] = done.stdout.split()
    assert seen == {"auto": ["1", "0"], "off": ["1", "1"]}

"""What an MCP stdio server may read of its runner: nothing of its secrets.

A server a loadout names runs as a child of the runner, and a child with the
runner's uid could read the runner's secrets without asking anyone:
`/proc/<runner>/environ` (the internal token, every tenant's granted keys),
`/proc/<runner>/mem`, the data dir (the internal token `keel up` keeps there,
SQLite files) and every other process of that uid. So:

- The runner is not dumpable (`mark_undumpable`, at start): its /proc files
  belong to root and no process of its uid may read its environment or
  memory or attach to it. The environment a process was started with stays
  in its memory whatever `os.environ` does later, so this, not removing
  variables, is what keeps them.
- Each server starts through `child_launch.py` (see there), which gives it
  a mount and PID namespace of its own: the data dir (and a TLS key file) is
  covered by an empty mount, and its /proc shows no other process.
- A runner that may change uid (root, or CAP_SETUID and CAP_SETGID) starts
  servers as `KEEL_TOOL_UID`/`KEEL_TOOL_GID` (default 65534, `nobody`),
  with a private HOME and working directory of that uid; the data dir (0700)
  and the runner's processes are then closed to them by the kernel's own
  permission checks, whether or not namespaces are available.
- A server that uid cannot execute (a root runner's tools installed under
  /root, closed to other uids: its command or the interpreter its `#!`
  names) runs as root instead, but with no capability at all, in its own
  mount and PID namespaces (required: without them it does not start) and
  with no_new_privs; the runner logs that once per command. Such a server
  still reads neither the runner's environment (undumpable, not in its
  /proc) nor the data dir (covered), but may read what root owns elsewhere:
  install servers where `KEEL_TOOL_UID` can run them to keep them out.
- A runner that may not change uid uses an unprivileged user namespace to
  make the mount and PID namespaces, where the kernel allows it (a container
  under a default seccomp profile does not; the launcher then says so on
  stderr and only the first point holds).

`KEEL_TOOL_SANDBOX=off` starts servers as before (the runner's uid, no
namespaces, the runner dumpable): for debugging and for tests whose servers
share files with the test.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.common import settings_registry as registry
from services.common.setting import int_default, read_int, read_text

__all__ = [
    "ChildLaunch",
    "SandboxPolicy",
    "configure",
    "current_policy",
    "launch",
    "mark_undumpable",
]

SANDBOX_VARIABLE = registry.KEEL_TOOL_SANDBOX.name
UID_VARIABLE = registry.KEEL_TOOL_UID.name
GID_VARIABLE = registry.KEEL_TOOL_GID.name
NOBODY = int_default(registry.KEEL_TOOL_UID)
LAUNCHER = Path(__file__).with_name("child_launch.py")
_PR_SET_DUMPABLE = 4
_log = logging.getLogger(__name__)
_CAP_SETGID = 6
_CAP_SETUID = 7
_CAP_SYS_ADMIN = 21


class SandboxError(Exception):
    """A server cannot be started inside the sandbox (says why and what to change)."""


@dataclass(frozen=True)
class SandboxPolicy:
    """How this runner starts MCP stdio servers."""

    enabled: bool = True
    # The uid/gid servers run as when this process may switch (None: its own).
    uid: int | None = None
    gid: int | None = None
    # New namespaces need a user namespace (no CAP_SYS_ADMIN here).
    userns: bool = False
    # This process may make mount and PID namespaces itself (CAP_SYS_ADMIN).
    may_mount: bool = False
    # Paths covered inside the server's mount namespace.
    masks: tuple[str, ...] = ()
    # The interpreter that runs the launcher, and the launcher.
    interpreter: str = field(default_factory=lambda: sys.executable)
    launcher: str = str(LAUNCHER)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], masks: Sequence[str | os.PathLike[str]] = ()
    ) -> SandboxPolicy:
        """The policy of this process: KEEL_TOOL_SANDBOX (auto|off),
        KEEL_TOOL_UID/KEEL_TOOL_GID, and what the process may do."""
        mode = read_text(env, registry.KEEL_TOOL_SANDBOX).strip().lower() or "auto"
        if mode == "off":
            return cls(enabled=False)
        if mode != "auto":
            raise ValueError(f"{SANDBOX_VARIABLE} must be auto or off, got {mode!r}")
        uid = read_int(env, registry.KEEL_TOOL_UID)
        gid = read_int(env, registry.KEEL_TOOL_GID)
        capabilities = _effective_capabilities()
        switch = bool(capabilities >> _CAP_SETUID & 1 and capabilities >> _CAP_SETGID & 1)
        if switch and uid == 0:
            raise ValueError(
                f"{UID_VARIABLE}=0 would run tool servers as root: choose another uid "
                f"(or {SANDBOX_VARIABLE}=off)"
            )
        switch = switch and uid != os.geteuid()
        may_mount = bool(capabilities >> _CAP_SYS_ADMIN & 1)
        paths = tuple(str(Path(m).resolve()) for m in masks if str(m))
        return cls(
            uid=uid if switch else None,
            gid=gid if switch else None,
            userns=not may_mount and not switch,
            may_mount=may_mount,
            masks=paths,
        )


def _effective_capabilities() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


_policy: SandboxPolicy | None = None


def configure(policy: SandboxPolicy) -> None:
    """Sets how this process starts servers (a runner, at start), and makes
    it undumpable unless the sandbox is off."""
    global _policy
    _policy = policy
    if policy.enabled:
        mark_undumpable()


def current_policy() -> SandboxPolicy:
    """The configured policy, else this process's from its environment (with
    nothing to mask: no runner said where its data dir is)."""
    global _policy
    if _policy is None:
        _policy = SandboxPolicy.from_env(os.environ)
    return _policy


def mark_undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0): /proc/<pid>/environ, mem, fd… of this
    process become root's, and no process of its uid may read or trace it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_DUMPABLE): {os.strerror(error)}")


@dataclass(frozen=True)
class ChildLaunch:
    """How to start one server: command, arguments, environment, directory,
    and the private directory to remove once it has stopped."""

    command: str
    args: list[str]
    env: dict[str, str]
    cwd: str | None = None
    private_dir: str | None = None

    def cleanup(self) -> None:
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)


def launch(
    executable: str,
    args: Sequence[str],
    env: Mapping[str, str],
    policy: SandboxPolicy | None = None,
    parent_pid: int | None = None,
) -> ChildLaunch:
    """How to start `executable ARGS` (an absolute path) with exactly `env`:
    through the launcher (values passed in the environment, names on its
    command line), or with the sandbox off as `env -i NAME=VALUE… executable`.
    `parent_pid`: the process that starts it (this one unless said)."""
    policy = policy or current_policy()
    if not policy.enabled:
        return _unsandboxed(executable, args, env)
    env = dict(env)
    options = ["--parent", str(os.getpid() if parent_pid is None else parent_pid)]
    private_dir: str | None = None
    cwd: str | None = None
    uid = policy.uid
    if uid is not None:
        gid = policy.gid if policy.gid is not None else uid
        refusal = unreachable(executable, uid, gid)
        if refusal is not None and not policy.may_mount:
            raise SandboxError(
                f"{refusal}: tool servers run as uid {uid} ({UID_VARIABLE}); install "
                "the server where that uid can reach it, or choose its uid"
            )
        if refusal is not None:
            _say_once(
                executable,
                f"{refusal}: {executable} runs as root without capabilities, in namespaces "
                f"of its own (install it where uid {uid} can run it to run it as that uid)",
            )
            uid = None
            options.append("--require-namespaces")
    if uid is not None:
        gid = policy.gid if policy.gid is not None else uid
        private_dir = _private_dir(uid, gid)
        cwd = private_dir
        env["HOME"] = private_dir
        options += ["--uid", str(uid), "--gid", str(gid), "--cwd", private_dir]
    if policy.userns:
        options.append("--userns")
    for path in policy.masks:
        options += ["--mask", path]
    for name in env:
        options += ["--env", name]
    argv = ["-I", "-S", policy.launcher, *options, "--", executable, *args]
    return ChildLaunch(policy.interpreter, argv, env, cwd, private_dir)


def _unsandboxed(executable: str, args: Sequence[str], env: Mapping[str, str]) -> ChildLaunch:
    """`[setpriv --pdeathsig KILL --] env -i NAME=VALUE… executable ARGS…`:
    the SDK adds a few of the runner's variables to a child's environment,
    and `env -i` clears them. A runner killed with SIGKILL cannot stop its
    children: with util-linux's setpriv the kernel does (the SDK offers no
    preexec_fn to set the parent-death signal otherwise)."""
    launcher = shutil.which("env") or "/usr/bin/env"
    if "=" in executable:  # `env` would read it as one more variable
        raise SandboxError(f"cannot start a command whose path contains '=': {executable}")
    assignments = [f"{name}={value}" for name, value in env.items()]
    argv = ["-i", *assignments, executable, *args]
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return ChildLaunch(setpriv, ["--pdeathsig", "KILL", "--", launcher, *argv], {})
    return ChildLaunch(launcher, argv, {})


_homes: str | None = None


def _private_dir(uid: int, gid: int) -> str:
    """A new directory of `uid` only, in a parent no one but root may list
    (so servers of one uid cannot find each other's)."""
    global _homes
    if _homes is None or not os.path.isdir(_homes):
        _homes = tempfile.mkdtemp(prefix="keel-tool-homes-")
        os.chmod(_homes, 0o711)
        atexit.register(shutil.rmtree, _homes, ignore_errors=True)
    path = tempfile.mkdtemp(prefix="home-", dir=_homes)
    os.chown(path, uid, gid)
    return path


_said: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        _log.warning(message)


def unreachable(path: str, uid: int, gid: int) -> str | None:
    """Why `uid`/`gid` (no supplementary groups) cannot execute `path`, by
    the mode bits of the file, of the interpreter its `#!` line names, and
    of each directory above them; None if it can."""
    targets = [Path(path), Path(os.path.realpath(path))]
    interpreter = _interpreter_of(path)
    if interpreter is not None:
        targets += [Path(interpreter), Path(os.path.realpath(interpreter))]
    for target in dict.fromkeys(targets):
        refusal = _closed_on_the_way(target, uid, gid)
        if refusal is not None:
            return refusal
    return None


def _interpreter_of(path: str) -> str | None:
    """The absolute interpreter path of a `#!` script (`/usr/bin/env` for
    `#!/usr/bin/env python3`, whose own lookup happens later); None else."""
    try:
        with open(path, "rb") as script:
            head = script.readline(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split()
    return words[0].decode(errors="replace") if words else None


def _closed_on_the_way(target: Path, uid: int, gid: int) -> str | None:
    chain = [*reversed(target.parents), target]
    for index, step in enumerate(chain):
        try:
            info = step.stat()
        except OSError as error:
            return f"{step}: {error.strerror}"
        if info.st_uid == uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid == gid:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            what = "the directory" if index < len(chain) - 1 else "the command"
            return f"{what} {step} is closed to uid {uid}"
    return None

"""Starts one MCP stdio server inside the sandbox the runner chose for it.

    python -I -S child_launch.py --parent PID [--uid U --gid G] [--userns]
        [--require-namespaces] [--mask PATH]... [--cwd DIR] [--env NAME]...
        -- EXECUTABLE ARG...

Run by the runner's own interpreter with nothing but the standard library
(`-I -S`: no site-packages, no PYTHON* variables), between the runner and the
server, and gone once the server runs. Options carry names and paths only:
the values of the variables named by `--env` come from this process's own
environment, so no secret is ever on a command line.

What it does, each step only where the kernel allows it (tried first in a
throwaway child; a step it cannot take is said in one line on stderr, which
the runner logs, and the server starts without it, except the namespaces
under `--require-namespaces`: without them the server does not start):

1. dies with the runner (parent-death signal; `--parent` closes the race
   with a runner that died before that);
2. enters a new mount and PID namespace (with `--userns` also a user
   namespace mapping the runner's uid to itself, for a runner that is not
   root), makes every mount private, and covers each `--mask` path: a
   directory with an empty read-only tmpfs, a file with /dev/null;
3. forks: the server is PID 1 of the new PID namespace and gets a /proc of
   its own, so no other process (the runner, `keel up`'s other processes,
   other tenants' servers) is visible to it; this process waits for it and
   exits with its status;
4. empties the capability bounding set, switches to `--uid`/`--gid` with no
   supplementary groups, sets no_new_privs (a setuid program cannot give the
   server more than it has), and executes the server with exactly the named
   variables, in `--cwd`.

The server cannot undo the masks: it has no capability in the namespace that
owns them, and in any namespace it creates itself they are locked.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
_LAST_CAPABILITY = 63
# What a command that cannot run exits with, as a shell would.
_CANNOT_EXECUTE = 126
_NOT_STARTED = 127

_libc = ctypes.CDLL(None, use_errno=True)


class Options:
    def __init__(self) -> None:
        self.parent = 0
        self.uid: int | None = None
        self.gid: int | None = None
        self.userns = False
        self.require_namespaces = False
        self.masks: list[str] = []
        self.cwd = ""
        self.env: list[str] = []
        self.argv: list[str] = []


def parse(argv: list[str]) -> Options:
    options = Options()
    rest = list(argv)
    while rest:
        word = rest.pop(0)
        if word == "--":
            options.argv = rest
            break
        if word == "--userns":
            options.userns = True
            continue
        if word == "--require-namespaces":
            options.require_namespaces = True
            continue
        if not rest:
            raise SystemExit(f"keel-sandbox: {word} needs a value")
        value = rest.pop(0)
        if word == "--parent":
            options.parent = int(value)
        elif word == "--uid":
            options.uid = int(value)
        elif word == "--gid":
            options.gid = int(value)
        elif word == "--mask":
            options.masks.append(value)
        elif word == "--cwd":
            options.cwd = value
        elif word == "--env":
            options.env.append(value)
        else:
            raise SystemExit(f"keel-sandbox: unknown option {word}")
    if not options.argv:
        raise SystemExit("keel-sandbox: no command after --")
    return options


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount {target}",
    )


def _die_with_runner(runner: int) -> None:
    """The kernel kills this process when the runner dies; a runner already
    gone (we were reparented before asking) ends it now."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if runner and os.getppid() != runner:
        os._exit(_NOT_STARTED)


def _die_with_launcher(lifeline: int) -> None:
    """The same for the server and this launcher, its parent outside its PID
    namespace (where getppid() says 0): the launcher holds the other end of
    the `lifeline` pipe, which reads as ended once it is gone."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    readable, _, _ = select.select([lifeline], [], [], 0)
    if readable:
        os._exit(_NOT_STARTED)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as handle:
        handle.write(text)


def _enter_namespaces(options: Options) -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWUSER if options.userns else 0)
    _check(_libc.unshare(flags), "unshare")
    if options.userns:
        # Only our own ids exist inside; setgroups must be denied before a
        # process without privilege outside may write its gid map.
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    # Nothing mounted from here on reaches the runner's namespace.
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)


def _namespaces_refused(options: Options) -> str | None:
    """Why the kernel refuses the namespaces and masks, tried in a throwaway
    child (a refusal half-way, such as a user namespace without privilege
    under AppArmor's restriction, cannot be undone); None when it allows them.
    """
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        try:
            _enter_namespaces(options)
            for path in options.masks:
                _mask(path)
        except OSError as error:
            why = error.strerror or str(error)
            where = f" ({error.filename})" if error.filename else ""
            os.write(writer, f"{why}{where}".encode(errors="replace"))
            os._exit(1)
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as told:
        why = told.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else why or "refused"


def _mask(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        hidden = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        _mount("keel-hidden", path, "tmpfs", hidden, "size=4k,nr_inodes=1,mode=0555")
    else:
        _mount("/dev/null", path, None, MS_BIND, None)


def _own_proc() -> None:
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def _wait_for(pid: int) -> int:
    """Waits for the server (PID 1 of its namespace) and exits as it did."""
    # Our copies of its stdin and stdout would keep the runner from seeing
    # the server's end of the pipe.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except InterruptedError:
            continue
        return os.waitstatus_to_exitcode(status)


def _same_directory() -> str:
    """The working directory's path, to enter again: through the masks now,
    so a directory inside a masked one is not kept open by its old handle."""
    try:
        return os.getcwd()
    except OSError:
        return "/"


def _drop_privileges(options: Options) -> None:
    for capability in range(_LAST_CAPABILITY + 1):
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(capability), 0, 0, 0) != 0:
            break  # past the last capability this kernel knows, or not permitted
    if options.uid is not None:
        gid = options.gid if options.gid is not None else options.uid
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(options.uid, options.uid, options.uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def main(argv: list[str]) -> int:
    options = parse(argv)
    _die_with_runner(options.parent)
    notes: list[str] = []
    lifeline = -1
    refused = _namespaces_refused(options)
    if refused is not None and options.require_namespaces:
        # Without them a server of the runner's own uid would see the data
        # dir and every process: refuse rather than start it so.
        print(f"keel-sandbox: no namespaces ({refused}): not started", file=sys.stderr)
        return _NOT_STARTED
    if refused is not None:
        seen = "this host's processes"
        if options.uid is None and options.masks:
            seen += " and can read " + ", ".join(options.masks)  # same uid: only masks hid them
        notes.append(f"no namespaces ({refused}): the server sees {seen}")
    else:
        _enter_namespaces(options)
        for path in options.masks:
            _mask(path)
        lifeline, held = os.pipe()
        pid = os.fork()
        if pid:
            os.close(lifeline)
            return _wait_for(pid)
        os.close(held)
        _die_with_launcher(lifeline)
        try:
            _own_proc()
        except OSError as error:
            notes.append(f"no /proc of its own ({error.strerror}): other processes stay visible")
    env = {name: os.environ[name] for name in options.env if name in os.environ}
    _drop_privileges(options)
    # The parent-death signal does not survive a change of uid: set it again.
    if lifeline >= 0:
        _die_with_launcher(lifeline)
        os.close(lifeline)
    else:
        _die_with_runner(options.parent)
    os.chdir(options.cwd or _same_directory())
    for note in notes:
        print(f"keel-sandbox: {note}", file=sys.stderr, flush=True)
    executable = options.argv[0]
    try:
        os.execve(executable, options.argv, env)
    except OSError as error:
        print(f"keel-sandbox: cannot execute {executable}: {error.strerror}", file=sys.stderr)
        return _CANNOT_EXECUTE
    return _NOT_STARTED  # not reached: execve returns only by raising


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except OSError as error:
        print(f"keel-sandbox: {error}", file=sys.stderr, flush=True)
        sys.exit(_NOT_STARTED)

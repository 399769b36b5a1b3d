"""`keel bench profile <benchmark> [its options]`: where a benchmark's CPU goes.

    keel bench profile turns --sessions 1 --turns 100
    keel bench profile turns --sessions 50 --tool cprofile
    keel bench profile ledger --raw /tmp/ledger.raw

`turns` is profiled in its own process and only over its measured part (after
the warm-up, until the runner is idle again): py-spy attaches to this process
when that part starts and is stopped when it ends, so imports, schema creation
and the warm-up are not in the profile. Any other benchmark runs as
`keel bench <benchmark> …` under `py-spy record`, start-up included.

Tools:
- `py-spy` (default): samples every Python thread (the ledger's writer, the
  stores' worker threads, the event loop) with native frames (grpc's Cython
  core, psycopg's C parts, libc), `--gil` by default so only time a thread
  held the GIL — Python's CPU — is counted. grpc's own C++ threads are not
  Python threads and are never sampled: the summary compares the sampled time
  with the process CPU time, and the gap is theirs (and the kernel's, for
  system calls made without the GIL).
- `cprofile`: deterministic, with call counts, timed in CPU time (not
  wall time, which a busy machine inflates), but the event loop's thread
  only (`turns` only).

The summary: the share of samples per component (the innermost frame that
belongs to a known library or to one of Keel's services decides, so a
`json.dumps` called by the runner is `json` and libc under grpc is `grpc`),
and, when the benchmark reports `cpu_ms_per_turn`, those shares in ms per
turn; then the top functions by self and by inclusive samples. `--raw FILE`
keeps py-spy's collapsed stacks (flamegraph.pl, inferno or speedscope read
them as they are).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOOLS = ("py-spy", "cprofile")
# (component, substrings of a frame's file or library), first match wins.
# Frames matching none (the interpreter, libc, generic stdlib helpers) are
# transparent: their time goes to the nearest known frame that called them.
COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("grpc", ("grpc/", "cygrpc", "grpc_health", "grpc_reflection", "libgrpc")),
    ("protobuf", ("google/protobuf", "_message.abi3", "upb")),
    ("psycopg", ("psycopg", "libpq")),
    ("eventsourcing", ("eventsourcing/",)),
    ("json", ("json/", "_json", "orjson", "msgspec")),
    ("asyncio", ("asyncio/", "_asynciomodule", "uvloop", "selectors.py", "selectmodule")),
    ("threads", ("threading.py", "concurrent/futures", "queue.py", "_queuemodule")),
    ("opentelemetry", ("opentelemetry/",)),
    ("logging", ("logging/",)),
    ("runner", ("services/runner/", "agent_io/")),
    ("ledger", ("services/ledger/",)),
    ("kernel", ("kernel/",)),
    ("common", ("services/common/",)),
    ("edge", ("edge/", "starlette", "uvicorn", "httptools", "h11")),
    ("compaction", ("compaction/",)),
    ("bench client", ("bench/",)),
)
FRAME = re.compile(r"^(?P<name>.*?) \((?P<where>[^()]*)\)$")
# py-spy's first frame with --threads: "thread (1234): asyncio_3".
THREAD = re.compile(r"^thread \((?P<id>\w+)\)(?:: (?P<name>.*))?$")
# Frames under every sample of their thread (the event loop, a thread's
# run(), this command) say nothing in the inclusive table.
# Keel's own code: each sample is also put on the innermost of its functions
# on the stack (what of ours asked for the work), or on "no Keel frame".
KEEL = ("services/", "kernel/", "edge/", "compaction/", "agent_io/", "bench/", "keel_client/")
# What runs the event loop: under it, a sample with no coroutine of ours is
# the loop itself or grpc's callbacks.
DRIVERS = ("measure", "profile", "main", "bench_profile", "<module>")
# What part of a turn a sample worked for, by the functions on its stack
# (first match wins; a worker thread's stack starts at the store call it
# runs). Samples with none of them are the event loop and grpc's own
# callbacks and coroutines (Cython, so without frames of ours above them).
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "ledger Subscribe (wake-ups, read-backs, sends)",
        ("LedgerServicer.Subscribe", "LedgerStore.read (", "LedgerStore.exists", "subscribe ("),
    ),
    (
        "ledger appends (servicer, writer thread)",
        ("LedgerServicer.Append", "LedgerStore._write_loop", "LedgerStore.submit", "AppendStream"),
    ),
    ("ledger reads (Read RPC)", ("LedgerServicer.Read", "LedgerStore.read_page")),
    (
        "kernel (servicer, stores, database)",
        (
            "KernelServicer.",
            "LeaseStore.",
            "TenantStore.",
            "Database.",
            "ClaimWaker.",
            "LeaseStream",
        ),
    ),
    (
        "runner (attempts, their client calls)",
        ("Attempt.", "Runtime.", "drive (", "FactCache.", "renew_until_lost", "_cancel_arrives"),
    ),
    ("bench client", ("_run.<locals>.session",)),
    (
        "background (reconciler, heartbeats, sweeps, live tail)",
        ("Reconciler.", "Heartbeats.", "_periodically", "LiveTail.", "ListSessions"),
    ),
)
SCAFFOLD = (
    "typer/",
    "click/",
    "runpy",
    "threading.py",
    "thread_run",
    "asyncio/runners.py",
    "asyncio/base_events.py",
    "asyncio/events.py",
    "concurrent/futures/thread.py",
    "services/cli/main.py",
    "bench/profile.py",
    "clone",
    "start_thread",
    "pythread_wrapper",
)


@dataclass(frozen=True)
class Options:
    tool: str = "py-spy"
    rate: int = 250
    gil: bool = True
    native: bool = True
    top: int = 25
    raw: Path | None = None


def component(where: str) -> str | None:
    for name, needles in COMPONENTS:
        if any(needle in where for needle in needles):
            return name
    return None


def _frame(text: str) -> tuple[str, str]:
    """(function, where) of a collapsed frame, line numbers and addresses cut."""
    match = FRAME.match(text)
    if match is None:
        return text, ""
    where = re.sub(r":\d+$", "", match["where"])
    name = match["name"]
    if name.startswith("0x"):
        name = "<native>"
    return name, where


@dataclass
class Summary:
    samples: int
    components: Counter[str]
    self_time: Counter[str]
    inclusive: Counter[str]
    threads: Counter[str]
    keel: Counter[str]
    phases: Counter[str]


def summarize_raw(lines: Iterator[str]) -> Summary:
    """Reads py-spy's collapsed stacks: `frame;frame;… count` per line."""
    components: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    keel: Counter[str] = Counter()
    phases: Counter[str] = Counter()
    total = 0
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        texts = stack.split(";")
        thread = THREAD.match(texts[0])
        if thread is not None:
            # Pool threads by their pool: asyncio_0, asyncio_1 -> asyncio_N.
            threads[re.sub(r"\d+$", "N", thread["name"] or thread["id"])] += count
            texts = texts[1:]
        frames = [_frame(f) for f in texts]
        owner = next((c for c in (component(where) for _, where in reversed(frames)) if c), "other")
        components[owner] += count
        name, where = frames[-1]
        self_time[f"{name} ({where})"] += count
        ours = next(
            (
                f"{n} ({w})"
                for n, w in reversed(frames)
                if w.startswith(KEEL) and n not in DRIVERS and not any(s in w for s in SCAFFOLD)
            ),
            "(no Keel frame: event loop, grpc's own callbacks)",
        )
        keel[ours] += count
        joined = ";".join(f"{n} ({w})" for n, w in frames)
        phase = next(
            (name for name, needles in PHASES if any(needle in joined for needle in needles)),
            "(none of these: event loop, grpc's own callbacks)",
        )
        phases[phase] += count
        for label in {
            f"{n} ({w})"
            for n, w in frames
            if n != "<native>" and not any(s in w or s in n for s in SCAFFOLD)
        }:
            inclusive[label] += count
    return Summary(total, components, self_time, inclusive, threads, keel, phases)


def summarize_cprofile(profile: cProfile.Profile) -> Summary:
    stats: dict[Any, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    components: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for (filename, line, name), (_, _, tottime, cumtime, _) in stats.items():
        where = f"{filename}:{line}" if line else filename
        label = f"{name} ({_short(where)})"
        micros = int(tottime * 1e6)
        self_time[label] += micros
        inclusive[label] += int(cumtime * 1e6)
        components[component(filename) or "other"] += micros
    total = sum(self_time.values())
    return Summary(total, components, self_time, inclusive, Counter(), Counter(), Counter())


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3.11/", str(Path.cwd()) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def report(summary: Summary, result: dict[str, Any], options: Options) -> str:
    unit = "µs" if options.tool == "cprofile" else "samples"
    out = [json.dumps(result, indent=2), ""]
    total = max(1, summary.samples)
    turn_ms = result.get("cpu_ms_per_turn")
    if options.tool == "py-spy":
        # Wall time a thread held the GIL (or ran, without --gil), slowed by
        # the sampling itself: compare shares, not seconds.
        out.append(
            f"{summary.samples} samples at {options.rate} Hz ({'--gil' if options.gil else 'all'}"
            f"{', native' if options.native else ''}) ≈ {summary.samples / options.rate:.2f} s"
            + (f"; process CPU {result['cpu_s']:.2f} s" if "cpu_s" in result else "")
        )
    out.append("\nby component (innermost known frame)" + (", ms per turn" if turn_ms else ""))
    for name, count in summary.components.most_common():
        share = count / total
        per_turn = f"  {share * turn_ms:6.2f} ms" if turn_ms else ""
        out.append(f"  {name:<14} {share:6.1%}{per_turn}")
    if summary.threads:
        out.append("\nby thread")
        for name, count in summary.threads.most_common():
            out.append(f"  {name:<24} {count / total:6.1%}")
    if summary.phases:
        out.append("\nby part of the turn (functions on the stack)")
        for label, count in summary.phases.most_common():
            per_turn = f"  {count / total * turn_ms:6.2f} ms" if turn_ms else ""
            out.append(f"  {count / total:6.1%}{per_turn}  {label}")
    if summary.keel:
        out.append("\nby Keel function (the innermost of ours on the stack)")
        for label, count in summary.keel.most_common(options.top):
            per_turn = f"  {count / total * turn_ms:6.2f} ms" if turn_ms else ""
            out.append(f"  {count / total:6.1%}{per_turn}  {label}")
    out.append(f"\ntop self ({unit})")
    for label, count in summary.self_time.most_common(options.top):
        out.append(f"  {count / total:6.1%}  {label}")
    out.append(f"\ntop inclusive ({unit}; event loop and thread scaffolding left out)")
    for label, count in summary.inclusive.most_common(options.top):
        out.append(f"  {count / total:6.1%}  {label}")
    return "\n".join(out)


# -- running ------------------------------------------------------------------


def _py_spy() -> str:
    here = Path(sys.executable).with_name("py-spy")
    found = str(here) if here.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    return found


def _spy_flags(options: Options, output: Path) -> list[str]:
    flags = ["--rate", str(options.rate), "--format", "raw", "--output", str(output), "--threads"]
    if options.gil:
        flags.append("--gil")
    if options.native:
        flags.append("--native")
    return flags


@contextlib.contextmanager
def _spying(options: Options, output: Path) -> Iterator[None]:
    """py-spy attached to this very process for the duration of the block."""
    said = output.with_suffix(".log")
    # To a file, never a pipe: py-spy writes while this process is stopped
    # for a sample, and a full pipe nobody reads would stop both for good.
    with said.open("w") as log:
        spy = subprocess.Popen(
            [_py_spy(), "record", "--pid", str(os.getpid()), *_spy_flags(options, output)],
            stderr=log,
            # Not DEVNULL: py-spy then says nothing at all, even on stderr.
            stdout=log,
        )
    deadline = time.monotonic() + 30
    # It says so once it samples; or says why not, and exits.
    while "Sampling process" not in said.read_text():
        if spy.poll() is not None or time.monotonic() > deadline:
            spy.kill()
            raise SystemExit(f"py-spy did not start: {said.read_text()}")
        time.sleep(0.01)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


@contextlib.contextmanager
def _profiling(profile: cProfile.Profile) -> Iterator[None]:
    profile.enable()
    try:
        yield
    finally:
        profile.disable()


def _turns_args(args: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="keel bench profile turns")
    parser.add_argument("--database-url", default=os.environ.get("KEEL_DATABASE_URL"))
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--turns", type=int, default=10)
    return parser.parse_args(list(args))


def profile(benchmark: str, args: Sequence[str], options: Options) -> str:
    """Runs `benchmark` profiled; returns the printed summary."""
    if options.tool not in TOOLS:
        raise SystemExit(f"--tool must be one of {', '.join(TOOLS)}")
    with tempfile.TemporaryDirectory(prefix="keel-profile-") as scratch:
        raw = options.raw or Path(scratch) / "profile.raw"
        if benchmark == "turns":
            from bench.turns import measure

            turns = _turns_args(args)
            if options.tool == "cprofile":
                # CPU time of the event loop's thread, not wall time: on a shared
                # machine a thread waiting for a core would be charged for it.
                cpu = cProfile.Profile(time.thread_time)
                result = measure(
                    turns.database_url, turns.sessions, turns.turns, window=lambda: _profiling(cpu)
                )
                return report(summarize_cprofile(cpu), result, options)
            result = measure(
                turns.database_url,
                turns.sessions,
                turns.turns,
                window=lambda: _spying(options, raw),
            )
        else:
            if options.tool == "cprofile":
                raise SystemExit("--tool cprofile profiles `turns` only")
            command = [sys.executable, "-m", "services.cli.main", "bench", benchmark, "--json"]
            spy = [_py_spy(), "record", *_spy_flags(options, raw), "--", *command, *args]
            run = subprocess.run(spy, stdout=subprocess.PIPE, text=True, check=True)
            # py-spy writes its own lines to the same stdout: the result is
            # the benchmark's one JSON line.
            printed = [line for line in run.stdout.splitlines() if line.startswith("{")]
            if not printed:
                raise SystemExit(f"keel bench {benchmark} printed no result:\n{run.stdout}")
            result = json.loads(printed[-1])
        with raw.open() as lines:
            return report(summarize_raw(lines), result, options)

"""`keel bench peers`: the same turn on LangGraph, DBOS and Keel, in one run.

What a user would pick instead of Keel, on the same PostgreSQL, measured
next to Keel's own `keel bench turns` so the ratios come from one run on one
machine. A turn is a user message made durable, an instant model step and
the answer made durable (bench/peer_programs/peer_turns.py says how each
peer does it; bench/turns.py how Keel does).

Keel does not depend on the peers: they are installed, at pinned versions,
into a scratch venv under a cache dir (`<cache>/keel-bench-peers/venv-…`,
made with `python -m venv` and `pip install` on the first run, reused while
the pins stay the same), and Keel's peer program runs in it as a child
process. Keel is then measured in this process.

Figures per system: one session's p50/p99 (`one_session_turns` turns in
sequence) and turns/s of `sessions` sessions at once (`turns_per_session`
each), and CPU per turn: a peer program's process (PostgreSQL's own not
counted, as for Keel, whose services all run in this process, or with
`layout="split"` in processes of their own, each counted). Every
percentile is taken here, with bench/turns.py's code, from the latencies
each program reports. `keel_vs_best_peer` divides Keel's figure by
the best peer's (the lowest latency or CPU, the highest turns/s): a latency
or CPU ratio ≤ 1 and a throughput ratio ≥ 1 mean Keel is ahead.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cluster import DEFAULT_URL
from bench.turns import percentile

PEERS = ("langgraph", "dbos")
# What the scratch venv installs: the peers at the versions the figures
# were first taken with (issue 25), and the PostgreSQL driver they run on.
PINS = (
    "langgraph==1.2.24",
    "langgraph-checkpoint-postgres==3.2.0",
    "dbos==3.4.0",
    "psycopg[binary,pool]==3.3.9",
    "psycopg-pool==3.3.3",
)
PEER_PROGRAM = Path(__file__).parent / "peer_programs" / "peer_turns.py"
# Written into the venv once pip has installed every pin: a venv without it
# (an interrupted install) is made again.
INSTALLED_MARKER = "keel-bench-peers.json"
INSTALL_TIMEOUT_S = 1800.0
# The peer program reads the database URL from here (bench/peer_programs).
DSN_ENV = "KEEL_BENCH_PEERS_DSN"
PEER_TIMEOUT_S = 900.0


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "keel-bench-peers"


@dataclass(frozen=True)
class PeersOptions:
    database_url: str = DEFAULT_URL
    peers: tuple[str, ...] = PEERS
    cache_dir: Path | None = None
    one_session_turns: int = 100
    sessions: int = 50
    turns_per_session: int = 10
    # Keel's layout (bench/turns.py): "one" process, or "split" over processes.
    layout: str = "one"

    @property
    def venv(self) -> Path:
        """One venv per set of pins and Python version, so a change of
        either makes a new one instead of mixing versions."""
        identity = json.dumps([PINS, sys.version_info[:2]]).encode()
        digest = hashlib.sha256(identity).hexdigest()[:12]
        return (self.cache_dir or default_cache_dir()) / f"venv-{digest}"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def parse_peers(text: str) -> tuple[str, ...]:
    """`langgraph,dbos`, one of them, or `none` (Keel alone, nothing installed)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if names == ("none",):
        return ()
    unknown = [name for name in names if name not in PEERS]
    if unknown or not names:
        raise ValueError(f"unknown peer {', '.join(unknown) or text!r}: {', '.join(PEERS)} or none")
    return tuple(dict.fromkeys(names))


def venv_ready(options: PeersOptions) -> bool:
    marker = options.venv / INSTALLED_MARKER
    try:
        recorded: object = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and recorded.get("pins") == list(PINS)


def install_commands(options: PeersOptions) -> list[list[str]]:
    return [
        [sys.executable, "-m", "venv", "--clear", str(options.venv)],
        [str(options.python), "-m", "pip", "install", "--quiet", *PINS],
    ]


def peer_command(options: PeersOptions, peer: str) -> list[str]:
    return [
        str(options.python),
        str(PEER_PROGRAM),
        f"--peer={peer}",
        f"--turns={options.one_session_turns}",
        f"--sessions={options.sessions}",
        f"--each={options.turns_per_session}",
    ]


def plan(options: PeersOptions) -> dict[str, Any]:
    """What a run would do, without doing any of it (`--dry-run`)."""
    reused = bool(options.peers) and venv_ready(options)
    return {
        "benchmark": "peers",
        "dry_run": True,
        "peers": list(options.peers),
        "venv": str(options.venv) if options.peers else None,
        "venv_reused": reused,
        "install": install_commands(options) if options.peers and not reused else [],
        "peer_runs": [peer_command(options, peer) for peer in options.peers],
        "keel_runs": [
            {"sessions": 1, "turns_per_session": options.one_session_turns},
            {"sessions": options.sessions, "turns_per_session": options.turns_per_session},
        ],
        "keel_layout": options.layout,
    }


def ensure_venv(options: PeersOptions) -> bool:
    """Makes the scratch venv unless a complete one is there; True if reused."""
    if venv_ready(options):
        return True
    options.venv.parent.mkdir(parents=True, exist_ok=True)
    for command in install_commands(options):
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:4])}… failed: {done.stderr[-2000:]}")
    (options.venv / INSTALLED_MARKER).write_text(json.dumps({"pins": list(PINS)}))
    return False


def latency_figures(latencies_ms: Sequence[float]) -> dict[str, float]:
    ordered = list(latencies_ms)
    return {
        "p50_ms": round(percentile(ordered, 0.5), 2),
        "p99_ms": round(percentile(ordered, 0.99), 2),
    }


def cpu_ms_per_turn(line: dict[str, Any]) -> float | None:
    cpu_s = line.get("cpu_s")
    return None if cpu_s is None else round(cpu_s * 1000 / line["turns"], 2)


def peer_figures(lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A peer program's JSON lines as the figures Keel's are compared with."""
    figures: dict[str, Any] = {}
    for line in lines:
        if "error" in line:
            figures["error"] = line["error"]
        elif "version" in line:
            figures["version"] = line["version"]
        elif line.get("mode") == "one_session":
            one = latency_figures(line["latencies_ms"])
            figures["one_session_p50_ms"] = one["p50_ms"]
            figures["one_session_p99_ms"] = one["p99_ms"]
            figures["one_session_cpu_ms_per_turn"] = cpu_ms_per_turn(line)
        elif line.get("mode") == "sessions":
            many = latency_figures(line["latencies_ms"])
            figures["sessions_turns_per_s"] = round(line["turns"] / line["wall_s"], 1)
            figures["sessions_p50_ms"] = many["p50_ms"]
            figures["sessions_p99_ms"] = many["p99_ms"]
            figures["sessions_cpu_ms_per_turn"] = cpu_ms_per_turn(line)
    return figures


def run_peer(options: PeersOptions, peer: str) -> dict[str, Any]:
    # The URL goes in the environment, not on a command line others can list.
    environment = {**os.environ, DSN_ENV: options.database_url}
    try:
        done = subprocess.run(
            peer_command(options, peer),
            env=environment,
            capture_output=True,
            text=True,
            timeout=PEER_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {PEER_TIMEOUT_S:.0f} s"}
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    figures = peer_figures(lines)
    if done.returncode != 0 and "error" not in figures:
        figures["error"] = f"exit {done.returncode}: {done.stderr[-500:]}"
    return figures


def keel_figures(one: dict[str, Any], many: dict[str, Any]) -> dict[str, Any]:
    """Keel's two `keel bench turns` results in the peers' shape."""
    return {
        "one_session_p50_ms": one["latency_p50_ms"],
        "one_session_p99_ms": one["latency_p99_ms"],
        "one_session_cpu_ms_per_turn": one["cpu_ms_per_turn"],
        "sessions_turns_per_s": many["turns_per_s"],
        "sessions_p50_ms": many["latency_p50_ms"],
        "sessions_p99_ms": many["latency_p99_ms"],
        "sessions_cpu_ms_per_turn": many["cpu_ms_per_turn"],
    }


# Figure -> True when higher is better.
COMPARED = {
    "one_session_p50_ms": False,
    "one_session_p99_ms": False,
    "sessions_turns_per_s": True,
    "sessions_cpu_ms_per_turn": False,
}


def compare(keel: dict[str, Any], peers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The best peer per figure and Keel's figure divided by it; a peer
    that failed (or lacks the figure) is left out, and with no peer left
    the ratio is None."""
    best: dict[str, str | None] = {}
    ratios: dict[str, float | None] = {}
    ahead: dict[str, bool | None] = {}
    for figure, higher_is_better in COMPARED.items():
        measured = {name: f[figure] for name, f in peers.items() if f.get(figure)}
        if not measured:
            best[figure], ratios[figure], ahead[figure] = None, None, None
            continue
        pick: Callable[[str], float] = measured.__getitem__
        name = max(measured, key=pick) if higher_is_better else min(measured, key=pick)
        best[figure] = name
        ratios[figure] = round(keel[figure] / measured[name], 2)
        ahead[figure] = (
            keel[figure] >= measured[name] if higher_is_better else keel[figure] <= measured[name]
        )
    return {"best_peer": best, "keel_vs_best_peer": ratios, "keel_ahead": ahead}


def measure(options: PeersOptions) -> dict[str, Any]:
    from bench import turns

    started = time.perf_counter()
    peers: dict[str, dict[str, Any]] = {}
    reused: bool | None = None
    if options.peers:
        reused = ensure_venv(options)
        for peer in options.peers:
            peers[peer] = run_peer(options, peer)
    one = turns.measure(options.database_url, 1, options.one_session_turns, layout=options.layout)
    many = turns.measure(
        options.database_url, options.sessions, options.turns_per_session, layout=options.layout
    )
    keel = keel_figures(one, many)
    return {
        "benchmark": "peers",
        "one_session_turns": options.one_session_turns,
        "sessions": options.sessions,
        "turns_per_session": options.turns_per_session,
        "keel_layout": options.layout,
        "venv": str(options.venv) if options.peers else None,
        "venv_reused": reused,
        "systems": {**peers, "keel": keel},
        **compare(keel, peers),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }

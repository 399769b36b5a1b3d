"""`keel bench peers` (issue 25, point 7): LangGraph, DBOS and Keel in one run.

The peers themselves are never installed here (a scratch venv from PyPI
is minutes and network): the command is driven through its plan
(`--dry-run`, which must create nothing) and with `--peers none`, where it
measures Keel alone on PostgreSQL; the shaping of the peers' figures and
the ratios is checked on figures in the peer program's own format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.peers import (
    INSTALLED_MARKER,
    PEER_PROGRAM,
    PINS,
    PeersOptions,
    compare,
    parse_peers,
    peer_figures,
    plan,
)
from tests.support.keel_up import run_keel


def test_the_dry_run_plans_the_scratch_venv_and_every_run_without_making_any(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    url = "postgresql://bench:secret@127.0.0.1:5432/test"
    done = run_keel(
        "bench", "peers", "--dry-run", "--json", "--cache-dir", str(cache), "--database-url", url
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["benchmark"] == "peers" and result["peers"] == ["langgraph", "dbos"]
    venv = Path(result["venv"])
    assert venv.parent == cache and not result["venv_reused"]
    # The venv is made by `python -m venv`, then pip installs the pinned peers.
    make, install = result["install"]
    assert make[1:4] == ["-m", "venv", "--clear"] and make[-1] == str(venv)
    assert install[0] == str(venv / "bin" / "python") and install[-len(PINS) :] == list(PINS)
    # Each peer runs Keel's own program (shipped in the package) in that venv;
    # the database URL, password and all, is not on any command line.
    assert [run[:2] for run in result["peer_runs"]] == [
        [str(venv / "bin" / "python"), str(PEER_PROGRAM)]
    ] * 2
    assert PEER_PROGRAM.is_file()
    assert "secret" not in json.dumps(result["peer_runs"])
    assert result["keel_runs"] == [
        {"sessions": 1, "turns_per_session": 100},
        {"sessions": 50, "turns_per_session": 10},
    ]
    assert result["keel_layout"] == "one"
    assert not cache.exists(), "a dry run created the cache dir"


def test_keels_layout_is_chosen_and_a_wrong_one_refused() -> None:
    split = run_keel("bench", "peers", "--dry-run", "--json", "--layout", "split")
    assert split.returncode == 0, split.stderr
    assert json.loads(split.stdout)["keel_layout"] == "split"
    wrong = run_keel("bench", "peers", "--dry-run", "--json", "--layout", "sideways")
    assert wrong.returncode == 2 and "one or split" in wrong.stderr


def test_a_complete_venv_is_reused_and_an_interrupted_one_made_again(tmp_path: Path) -> None:
    options = PeersOptions(cache_dir=tmp_path)
    options.venv.mkdir(parents=True)
    assert plan(options)["install"], "a venv without its marker is an interrupted install"
    (options.venv / INSTALLED_MARKER).write_text(json.dumps({"pins": list(PINS)}))
    reused = plan(options)
    assert reused["venv_reused"] and reused["install"] == []
    (options.venv / INSTALLED_MARKER).write_text(json.dumps({"pins": ["langgraph==0.1"]}))
    assert not plan(options)["venv_reused"]


def test_the_peers_option_names_known_peers_or_none() -> None:
    assert parse_peers("langgraph,dbos") == ("langgraph", "dbos")
    assert parse_peers("dbos, dbos") == ("dbos",)
    assert parse_peers("none") == ()
    for wrong in ("", "temporal", "none,dbos"):
        with pytest.raises(ValueError):
            parse_peers(wrong)


def test_an_unknown_peer_is_refused_with_its_name() -> None:
    done = run_keel("bench", "peers", "--peers", "temporal", "--dry-run")
    assert done.returncode == 2 and "temporal" in done.stderr


def program_lines(
    peer: str, one: list[float], many: list[float], wall_s: float, cpu_s: float
) -> list[dict[str, Any]]:
    """What bench/peer_programs/peer_turns.py prints for one peer."""
    return [
        {"peer": peer, "version": "9.9"},
        {"peer": peer, "mode": "one_session", "sessions": 1, "turns": len(one),
         "wall_s": sum(one) / 1000, "cpu_s": 0.003 * len(one), "latencies_ms": one},
        {"peer": peer, "mode": "sessions", "sessions": 5, "turns": len(many),
         "wall_s": wall_s, "cpu_s": cpu_s, "latencies_ms": many},
    ]  # fmt: skip


def test_keel_is_compared_with_the_best_peer_of_each_figure() -> None:
    fast_alone = peer_figures(program_lines("dbos", [5.0, 6.0, 7.0], [30.0] * 100, 1.0, 0.4))
    fast_together = peer_figures(
        program_lines("langgraph", [8.0, 9.0, 10.0], [20.0] * 200, 1.0, 1.0)
    )
    assert fast_alone["version"] == "9.9"
    assert fast_alone["one_session_p50_ms"] == 6.0 and fast_alone["one_session_p99_ms"] == 7.0
    assert fast_alone["one_session_cpu_ms_per_turn"] == 3.0
    assert fast_alone["sessions_cpu_ms_per_turn"] == 4.0
    assert fast_together["sessions_turns_per_s"] == 200.0
    failed = peer_figures([{"peer": "dbos", "error": "RuntimeError('no database')"}])
    assert failed == {"error": "RuntimeError('no database')"}

    keel = {
        "one_session_p50_ms": 3.0,
        "one_session_p99_ms": 14.0,
        "sessions_turns_per_s": 300.0,
        "sessions_cpu_ms_per_turn": 10.0,
    }
    result = compare(keel, {"dbos": fast_alone, "langgraph": fast_together})
    assert result["best_peer"] == {
        "one_session_p50_ms": "dbos",
        "one_session_p99_ms": "dbos",
        "sessions_turns_per_s": "langgraph",
        "sessions_cpu_ms_per_turn": "dbos",
    }
    assert result["keel_vs_best_peer"] == {
        "one_session_p50_ms": 0.5,
        "one_session_p99_ms": 2.0,
        "sessions_turns_per_s": 1.5,
        "sessions_cpu_ms_per_turn": 2.5,
    }
    assert result["keel_ahead"] == {
        "one_session_p50_ms": True,
        "one_session_p99_ms": False,
        "sessions_turns_per_s": True,
        "sessions_cpu_ms_per_turn": False,
    }
    # A peer that failed is no one's best; with none left there is no ratio.
    only_failed = compare(keel, {"dbos": failed})
    assert set(only_failed["keel_vs_best_peer"].values()) == {None}
    assert (
        compare(keel, {"dbos": failed, "langgraph": fast_together})["best_peer"][
            "one_session_p50_ms"
        ]
        == "langgraph"
    )


@pytest.mark.slow
def test_keel_alone_is_measured_without_installing_a_peer(
    postgres_url: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    done = run_keel(
        "bench", "peers", "--peers", "none", "--json", "--cache-dir", str(cache),
        "--database-url", postgres_url,
        "--one-session-turns", "3", "--sessions", "2", "--turns", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["systems"]) == {"keel"} and result["venv"] is None
    keel = result["systems"]["keel"]
    for figure in ("one_session_p50_ms", "one_session_p99_ms", "sessions_turns_per_s"):
        assert keel[figure] > 0, figure
    assert set(result["keel_vs_best_peer"].values()) == {None}
    assert not cache.exists(), "--peers none created the cache dir"

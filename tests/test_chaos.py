"""`keel chaos`: its checks catch each broken rule, and against a real
`keel up --processes` it strikes real runner processes and reports a clean
run, or names the planted bug (a final answer committed twice)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from services.cli.chaos import keel_runner_pid
from services.cli.chaos_report import ChaosReport, RoundResult, render
from services.session_invariants import (
    DUPLICATE_ANSWER,
    DUPLICATE_RULES,
    DUPLICATE_TOOL_RESULT,
    EPOCH_NOT_NEWER,
    MISSING_TOOL_RESULT,
    ORPHAN_TOOL_RESULT,
    RULES,
    SEQ_GAP,
    SKIPPED_ANSWERED,
    STALE_EPOCH,
    UNANSWERED_INPUT,
    UNKNOWN_INPUT,
    check_session,
    duplicates,
)
from tests.support.chaos import (
    answer,
    fact,
    healthy_session,
    ledger_refusals,
    run_chaos,
    started,
)
from tests.support.keel_up import keel_up, run_keel
from tests.support.processes import ChildProcess

KEY = "chaos-test-key-0123456789abcdef"
Facts = list[dict[str, Any]]


def test_a_healthy_session_has_no_violation() -> None:
    assert check_session("s", healthy_session()) == []


def _renumbered(facts: Facts) -> Facts:
    facts[-1]["seq"] = 12
    return facts


BROKEN: dict[str, Callable[[Facts], Facts]] = {
    SEQ_GAP: _renumbered,
    DUPLICATE_ANSWER: lambda f: [*f, answer(11, 3, 8)],
    UNANSWERED_INPUT: lambda f: [*f, fact(11, "input", text="lost", requestId="r3")],
    UNKNOWN_INPUT: lambda f: [*f, answer(11, 3, 42)],
    DUPLICATE_TOOL_RESULT: lambda f: [
        *f,
        fact(11, "tool_result", 3, toolCallId="call-a", content="1", isError=False),
    ],
    MISSING_TOOL_RESULT: lambda f: [*f, answer(11, 3, calls=("call-b",))],
    ORPHAN_TOOL_RESULT: lambda f: [
        *f,
        fact(11, "tool_result", 3, toolCallId="call-z", content="?", isError=False),
    ],
    # A write of the owner of epoch 2 after epoch 3 raised the fence.
    STALE_EPOCH: lambda f: [*f, fact(11, "compaction", 2, summary="late")],
    EPOCH_NOT_NEWER: lambda f: [*f, started(11, 3)],
    # Input 2 was answered at seq 7, then skipped as if it had parked.
    SKIPPED_ANSWERED: lambda f: [*f, fact(11, "inputs_skipped", inputSeqs=[2], reason="x")],
}


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_is_caught_and_named_with_its_session_and_seq(rule: str) -> None:
    found = check_session("s-9", BROKEN[rule](healthy_session()))
    assert [(v.session, v.rule) for v in found] == [("s-9", rule)], found
    assert found[0].seq in (11, 12) and found[0].detail
    assert duplicates(found) == (1 if rule in DUPLICATE_RULES else 0)


def test_a_fork_starts_its_own_epochs_after_the_parents() -> None:
    """A fork of the healthy session (epochs up to 3) at its end: its own
    runner's epoch 1 comes after `forked_from`, and nothing is stale."""
    facts = [
        *healthy_session(),
        fact(11, "forked_from", sessionId="parent", seq=10),
        fact(12, "input", text="in the fork", requestId="r9"),
        started(13, 1),
        answer(14, 1, 12),
    ]
    assert check_session("s", facts) == []
    without = [f for f in facts if f["kind"] != "forked_from"]
    for seq, f in enumerate(without, start=1):
        f["seq"] = seq
    assert EPOCH_NOT_NEWER in [v.rule for v in check_session("s", without)]


def test_a_skipped_input_is_settled_without_an_answer() -> None:
    """The last input (seq 8) failed and parked the session; a skip settles it."""
    facts = [
        *healthy_session()[:8],
        fact(9, "session_parked", 2, reason="failed", inputSeqs=[8]),
        fact(10, "inputs_skipped", inputSeqs=[8], reason="failed"),
    ]
    assert check_session("s", facts) == []
    assert [v.rule for v in check_session("s", facts[:-1])] == [UNANSWERED_INPUT]


@pytest.mark.parametrize("rule", [UNANSWERED_INPUT, MISSING_TOOL_RESULT])
def test_a_session_still_running_owes_without_violating(rule: str) -> None:
    assert check_session("s", BROKEN[rule](healthy_session()), settled=False) == []


def test_only_a_live_keel_runner_process_is_a_target() -> None:
    # The command line is what is judged: one naming the runner module counts.
    runner_like = ChildProcess(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "services.runner"]
    )
    other = ChildProcess([sys.executable, "-c", "import sys; sys.stdin.read()"])
    try:
        assert keel_runner_pid(runner_like.pid)
        assert not keel_runner_pid(other.pid)
        assert not keel_runner_pid(os.getpid())
    finally:
        runner_like.kill()
        other.kill()
    # Gone (and reaped): never a target.
    assert not keel_runner_pid(runner_like.pid)


def test_the_table_names_each_violation() -> None:
    violations = tuple(check_session("s-1", BROKEN[DUPLICATE_ANSWER](healthy_session())))
    report = ChaosReport(
        url="http://edge",
        seed=7,
        scenarios=("crash",),
        rounds=(RoundResult(1, "crash", "rt-1", 4242, 2, 5, True, 1.5, "SIGKILL pid 4242"),),
        sessions=("s-1",),
        inputs=5,
        facts=11,
        violations=violations,
    )
    console = Console(record=True, width=200)
    render(report, console)
    shown = console.export_text()
    assert "SIGKILL pid 4242" in shown
    assert "s-1" in shown and "duplicate_answer" in shown and "1 violation(s)" in shown
    assert report.to_json()["duplicates"] == 1 and not report.to_json()["ok"]


def test_an_unknown_scenario_is_a_usage_error() -> None:
    done = run_keel("chaos", "--url", "http://127.0.0.1:9", "--key", KEY, "--scenarios", "flood")
    assert done.returncode == 2
    assert "--scenarios" in done.stderr


@pytest.mark.slow
def test_chaos_against_keel_up_processes_reports_a_clean_run(tmp_path: Path) -> None:
    with keel_up(tmp_path / "data", KEY, "--processes", "--runners", "2") as up:
        outcome = run_chaos(up, "--rounds", "1", "--sessions", "4", "--seed", "7", "--json")
    assert outcome.code == 0, outcome.stdout + outcome.stderr
    report = outcome.report
    assert report["ok"] and report["violations"] == [] and report["duplicates"] == 0
    assert [r["scenario"] for r in report["rounds"]] == ["crash", "handoff"]
    crash, handoff = report["rounds"]
    # A real runner process of this host was killed, a real runner drained.
    assert crash["note"] == f"SIGKILL pid {crash['pid']}", crash
    assert handoff["note"].startswith("handoff drain"), handoff
    assert all(r["answered"] for r in report["rounds"])
    assert len(report["sessions"]) == 4
    assert report["inputs"] >= 8 and report["facts"] > report["inputs"]


@pytest.mark.slow
def test_chaos_names_a_final_answer_committed_twice(tmp_path: Path) -> None:
    planted = {"KEEL_FAULT_INJECT": "duplicate_reply"}
    with keel_up(tmp_path / "data", KEY, "--processes", env=planted) as up:
        outcome = run_chaos(
            up, "--scenarios", "crash", "--rounds", "1", "--sessions", "2", "--seed", "3", "--json"
        )
    assert outcome.code == 1, outcome.stdout + outcome.stderr
    assert outcome.rules() == {DUPLICATE_ANSWER}
    named = outcome.report["violations"][0]
    assert named["session"] in outcome.report["sessions"] and named["seq"] > 1
    assert "answered again" in named["detail"]
    assert outcome.report["duplicates"] == len(outcome.report["violations"])


@pytest.mark.slow
def test_chaos_stops_a_runner_and_its_stale_writes_are_refused(tmp_path: Path) -> None:
    # A short lease: the stopped runner's sessions are taken over in seconds.
    short_lease = {"KEEL_LEASE_MS": "2000"}
    with keel_up(tmp_path / "data", KEY, "--processes", "--runners", "2", env=short_lease) as up:
        outcome = run_chaos(
            up, "--scenarios", "stale", "--rounds", "1", "--sessions", "3", "--seed", "5", "--json"
        )
        refused = ledger_refusals(up)
    assert outcome.code == 0, outcome.stdout + outcome.stderr
    report = outcome.report
    assert report["ok"] and report["violations"] == []
    (stale,) = report["rounds"]
    assert stale["scenario"] == "stale" and stale["answered"], stale
    assert stale["note"].startswith(f"SIGSTOP pid {stale['pid']} for "), stale
    assert stale["note"].endswith("; SIGCONT"), stale
    # Each session it held was committed to by a successor while it was stopped.
    assert stale["raced"] == stale["held"] >= 1 and report["raced"] == stale["raced"]
    # Resumed, it wrote with its old epoch, and the ledger refused it.
    ours = set(report["sessions"])
    raced = [r for r in refused if r.session.rsplit(":", 1)[-1] in ours]
    assert raced and all(r.fence > r.epoch for r in raced), refused

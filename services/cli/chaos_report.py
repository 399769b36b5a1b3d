"""What `keel chaos` found: each round, the violations, and how they are shown."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from services.session_invariants import Violation, duplicates


@dataclass(frozen=True)
class RoundResult:
    number: int
    scenario: str
    target: str
    pid: int | None
    # How many of the run's sessions the target held when struck.
    held: int
    inputs: int
    answered: bool
    seconds: float
    note: str = ""
    # `stale`: sessions of the stopped runner a successor committed to
    # before it was resumed (each a stale write the fence must refuse).
    raced: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.number,
            "scenario": self.scenario,
            "target": self.target or None,
            "pid": self.pid,
            "held": self.held,
            "inputs": self.inputs,
            "answered": self.answered,
            "seconds": round(self.seconds, 2),
            "note": self.note,
            "raced": self.raced,
        }


@dataclass(frozen=True)
class ChaosReport:
    url: str
    seed: int
    scenarios: tuple[str, ...]
    rounds: tuple[RoundResult, ...]
    sessions: tuple[str, ...]
    inputs: int
    facts: int
    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "seed": self.seed,
            "scenarios": list(self.scenarios),
            "ok": self.ok,
            "sessions": list(self.sessions),
            "inputs": self.inputs,
            "facts": self.facts,
            "duplicates": duplicates(self.violations),
            "raced": sum(r.raced for r in self.rounds),
            "rounds": [r.to_json() for r in self.rounds],
            "violations": [v.to_json() for v in self.violations],
        }


def progress_line(result: RoundResult) -> str:
    outcome = "answered" if result.answered else "NOT all answered"
    return (
        f"round {result.number} {result.scenario}: {result.note} "
        f"({result.target or 'no target'}, {result.held} held); "
        f"{result.inputs} inputs {outcome} in {result.seconds:.1f}s"
    )


def render(report: ChaosReport, console: Console) -> None:
    """The report as tables: the rounds, then any violation."""
    rounds = Table(
        "round", "scenario", "target", "pid", "held", "inputs", "answered", "seconds", "note",
        title=f"keel chaos against {report.url} (seed {report.seed})",
    )  # fmt: skip
    for r in report.rounds:
        rounds.add_row(
            str(r.number),
            r.scenario,
            r.target or "-",
            str(r.pid or "-"),
            str(r.held),
            str(r.inputs),
            "yes" if r.answered else "[red]no[/red]",
            f"{r.seconds:.1f}",
            r.note,
        )
    console.print(rounds)
    if report.violations:
        found = Table("session", "seq", "rule", "detail", title="[red]violations[/red]")
        for v in report.violations:
            found.add_row(v.session, str(v.seq), v.rule, v.detail)
        console.print(found)
        rules = sorted({v.rule for v in report.violations})
        console.print(f"[red]{len(report.violations)} violation(s):[/red] {', '.join(rules)}")
    else:
        console.print(
            f"[green]clean:[/green] {len(report.sessions)} sessions, {report.inputs} inputs, "
            f"{report.facts} facts; every invariant holds"
        )

"""How `keel status` shows the edge's runtime status: ids are never cut.

A runtime id or a session id cut to "rt-01…" cannot be pasted into `keel
drain --runtime-id`, so:

- `--json`: the edge's answer as it is (one line of JSON), for scripts;
- into a pipe or a file: the table at its full width, one line per runtime;
- in a terminal wide enough for the table: the table;
- in a narrower one: one block per runtime (its id on a line of its own,
  then its fields), which the terminal wraps but nothing cuts.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

# Wide enough for any table: outside a terminal nothing is squeezed or cut.
UNBOUNDED_WIDTH = 1_000_000


def status_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The header and one row per runtime (operators also see host and pid)."""
    runtimes = report["runtimes"]
    # Only operators are told where runtimes run and whose sessions they hold.
    operator = any("pid" in runtime for runtime in runtimes)
    columns = ["runtime", "role", "liveness", "drain", "claiming", "in flight", "sessions"]
    header = ["runtime", "role", "host", "pid", *columns[2:]] if operator else columns
    rows = []
    for runtime in runtimes:
        sessions = ", ".join(
            f"{s['tenant']}/{s['id']}" if "tenant" in s else s["id"] for s in runtime["sessions"]
        )
        where = [str(runtime.get("host", "")), str(runtime.get("pid", ""))] if operator else []
        rows.append(
            [
                runtime["runtimeId"],
                runtime["role"],
                *where,
                runtime.get("liveness", ""),
                runtime["drainMode"],
                str(runtime["claiming"]),
                str(runtime["inFlightRuns"]),
                sessions,
            ]
        )
    return header, rows


def _table(header: list[str], rows: list[list[str]]) -> Table:
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    return table


def _blocks(console: Console, header: list[str], rows: list[list[str]]) -> None:
    for row in rows:
        console.print(row[0], style="bold", soft_wrap=True)
        fields = [f"{name}: {value}" for name, value in zip(header[1:-1], row[1:-1], strict=True)]
        console.print("  " + "   ".join(fields), soft_wrap=True, highlight=False)
        console.print(f"  {header[-1]}: {row[-1] or '-'}", soft_wrap=True, highlight=False)


def _natural_width(console: Console, table: Table) -> int:
    """The width `table` needs to show every cell whole (however wide the console)."""
    unbounded = console.options.update_width(UNBOUNDED_WIDTH)
    return Measurement.get(console, unbounded, table).maximum


def print_status(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report), flush=True)
        return
    terminal = sys.stdout.isatty()
    console = Console() if terminal else Console(width=UNBOUNDED_WIDTH)
    header, rows = status_rows(report)
    table = _table(header, rows)
    if terminal and _natural_width(console, table) > console.width:
        _blocks(console, header, rows)
    else:
        console.print(table)
    if report.get("claimingRunners") == 0:
        console.print("no runner claims: inputs are accepted and wait until one does")

"""`keel bench rebuild`: a successor's cold rebuild of a long session.

A runner that takes a session over without a cached copy of its facts reads
the whole session from the ledger (`Read` in packed pages, a few at once,
as `FactCache.load` does) and builds the context its next model request
presents, with the calls the runner makes for it (`Attempt.start`, the turn
loop, the compaction check, the request). That is the time between a claim
and the first model request of a takeover, beyond the commits.

The session is written once, through the ledger, like a coding agent's: a
user input, then assistant steps with tool calls and their results, a final
answer, and a compaction whenever the context grows past what the default
policy would allow; its last fact is an input no answer has read yet, so the
successor has work to do. Each turn is one append (the next input rides in
the previous turn's append, so the inputs carry a runner epoch instead of 0;
nothing read here depends on it).

The ledger runs as its own OS process on PostgreSQL, as deployed; the
successor is this process, with a warm channel (a running runner has one).
Reported per part: `read_ms` (the ledger reads), `context_ms` (building the
request), `total_ms`, as p50 and min over the runs, and this process's CPU
time. `raw_select_ms` is one psycopg SELECT of the session's rows, for scale.

Run: `keel bench rebuild` or `python -m bench.rebuild [DATABASE_URL]`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench.ledger import standalone_ledger
from compaction.policy import (
    CompactionPlan,
    MessageEntry,
    plan_compaction,
    resolve_context_window,
    settings_from_dict,
)
from services.common.config import Settings
from services.ledger import FactToAppend, LedgerClient
from services.ledger.facts import CommittedFact
from services.runner import transcript as T
from services.runner.compacting import DEFAULT_CONTEXT_WINDOW
from services.runner.factcache import FactCache

DEFAULT_FACTS = 10_000
DEFAULT_RUNS = 5
TARGET_TOTAL_MS = 100.0
SESSION = "bench-rebuild"
TENANT = "bench"
SEED = 1515
# A compaction is written when the context since the last one passes this
# many (estimated) tokens, keeping about this many: the default policy's
# limit on a 128k window, and its default kept tail.
COMPACT_AT_TOKENS = DEFAULT_CONTEXT_WINDOW - 16_384
KEEP_RECENT_TOKENS = 20_000
VOCABULARY = (
    "the module reads every fact once and keeps the parsed message for the next turn "
    "so a long session costs what its new facts cost écrit über naïve 数据 模型"
)
WORDS = tuple(VOCABULARY.split())


def _prose(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _tokens(data: Any) -> int:
    return len(json.dumps(data, ensure_ascii=False)) // 4


@dataclass
class _Writer:
    """Builds the session one turn (one append) at a time."""

    rng: random.Random
    head: int = 1  # the session_created fact
    calls: int = 0
    # The context's size since the latest compaction, and every token ever
    # written (where a compaction cuts is measured on the latter).
    context_tokens: int = 0
    written_tokens: int = 0
    compactions: int = 0
    # (seq, tokens written before it) of each input: where a compaction may cut.
    inputs: list[tuple[int, int]] = field(default_factory=list)

    def grew(self, tokens: int) -> None:
        self.context_tokens += tokens
        self.written_tokens += tokens

    def input(self, turn: int) -> dict[str, Any]:
        data = {"text": _prose(self.rng, 8, 60), "requestId": f"req-{turn}"}
        self.grew(_tokens(data))
        return data

    def turn(self, turn: int, input_seq: int) -> list[FactToAppend]:
        """The runner's facts answering `input_seq`, under epoch `turn`."""
        rng = self.rng
        facts = [
            FactToAppend(
                "epoch_started",
                {
                    "epoch": turn,
                    "runtimeId": "runner-bench",
                    "attemptId": uuid.uuid4().hex,
                    "watermark": input_seq,
                    "loadoutRevision": 1,
                },
            )
        ]
        if self.context_tokens > COMPACT_AT_TOKENS:
            facts.append(FactToAppend("compaction", self._compaction()))
        for step in range(rng.randint(0, 3)):
            calls = []
            for _ in range(rng.choice((1, 1, 2))):
                self.calls += 1
                arguments = {"path": f"src/module_{self.calls}.py", "limit": rng.randint(1, 400)}
                calls.append({"id": f"call_{self.calls}", "name": "read", "arguments": arguments})
            facts.append(
                FactToAppend("assistant", self._answer(f"gen-{turn}-{step}", calls, "toolUse"))
            )
            for call in calls:
                result = {
                    "toolCallId": call["id"],
                    "content": _prose(rng, 20, 180),
                    "isError": False,
                    "idempotencyKey": f"{TENANT}:{SESSION}:{call['id']}",
                }
                self.grew(_tokens(result))
                facts.append(FactToAppend("tool_result", result))
        final = self._answer(f"gen-{turn}-final", [], "stop")
        final["inputSeqs"] = [input_seq]
        facts.append(FactToAppend("assistant", final))
        return facts

    def _answer(self, generation: str, calls: list[dict[str, Any]], stop: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": _prose(self.rng, 5, 80)}]
        if self.rng.random() < 0.2:
            content.insert(0, {"type": "thinking", "thinking": _prose(self.rng, 10, 60)})
        output = _tokens(content) + _tokens(calls)
        data = {
            "generationId": generation,
            "content": content,
            "toolCalls": calls,
            "usage": {
                "input": self.context_tokens,
                "output": output,
                "cacheRead": 0,
                "cacheWrite": 0,
                "totalTokens": self.context_tokens + output,
            },
            "model": "bench-model",
            "stopReason": stop,
        }
        self.grew(output)
        return data

    def _compaction(self) -> dict[str, Any]:
        # Keep the most recent inputs worth about KEEP_RECENT_TOKENS.
        first_kept = next(
            (seq for seq, at in self.inputs if self.written_tokens - at <= KEEP_RECENT_TOKENS),
            self.inputs[-1][0],
        )
        self.compactions += 1
        summary = _prose(self.rng, 300, 500)
        self.inputs = [(seq, at) for seq, at in self.inputs if seq >= first_kept]
        self.context_tokens = self.written_tokens - self.inputs[0][1] + _tokens(summary)
        return {"summary": summary, "firstKept": first_kept}


async def write_session(client: LedgerClient, facts: int) -> dict[str, int]:
    """The session, `facts` facts long, its last an unanswered input."""
    await client.create_session(SESSION, TENANT)
    writer = _Writer(random.Random(SEED))
    first = await client.append_one(SESSION, "input", writer.input(1))
    input_seq, head, turn = first.seq, first.seq, 1
    while True:
        writer.inputs.append((input_seq, writer.written_tokens))
        batch = writer.turn(turn, input_seq)
        if head + len(batch) + 1 > facts:
            break
        batch.append(FactToAppend("input", writer.input(turn + 1)))
        appended = await client.append(SESSION, batch, epoch=turn)
        head = input_seq = appended[-1].seq
        turn += 1
    # Pad with inputs up to the exact length (the last turns stay unanswered).
    while head < facts:
        head = (await client.append_one(SESSION, "input", writer.input(turn + head))).seq
    return {"facts": head, "turns": turn, "compactions": writer.compactions}


@dataclass(frozen=True)
class Rebuild:
    read_ms: float
    context_ms: float
    cpu_ms: float
    ledger_cpu_ms: float
    facts: int
    messages: int
    context_tokens: int


def successor_context(
    facts: Sequence[CommittedFact], history_parsed: dict[int, MessageEntry]
) -> tuple[T.Owed, CompactionPlan, tuple[dict[str, Any], ...], int]:
    """What a successor computes before its first model request, call for
    call (`Attempt.start`, the turn span's owed inputs, `run_turns`,
    `Attempt.context`, the compaction check, `presented_request`)."""
    watermark = T.read_through(facts)
    if T.owed(facts, watermark).nothing:
        raise RuntimeError("the bench session owes no work")
    T.owed(facts, T.read_through(facts))  # Attempt.turn_traceparents
    owed = T.owed(facts, watermark)  # run_turns
    entries = T.windowed_context(facts, watermark, history_parsed, blob_parts=None)
    plan = plan_compaction(
        entries, settings_from_dict({}), resolve_context_window(None, DEFAULT_CONTEXT_WINDOW)
    )
    messages, tokens = T.presented_request(entries)
    return owed, plan, messages, tokens


def process_cpu_ms(pid: int) -> float:
    """CPU time (user + system) a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


async def rebuild_once(client: LedgerClient, ledger_pid: int) -> Rebuild:
    cache = FactCache(client, max_facts=1_000_000)  # empty: a cold successor
    ledger_cpu = process_cpu_ms(ledger_pid)
    cpu = time.process_time()
    started = time.perf_counter()
    history = await cache.load(SESSION)
    read = time.perf_counter()
    _, plan, messages, _ = successor_context(history.facts, history.parsed)
    done = time.perf_counter()
    return Rebuild(
        read_ms=(read - started) * 1000,
        context_ms=(done - read) * 1000,
        cpu_ms=(time.process_time() - cpu) * 1000,
        ledger_cpu_ms=process_cpu_ms(ledger_pid) - ledger_cpu,
        facts=len(history.facts),
        messages=len(messages),
        context_tokens=plan.context_tokens,
    )


def raw_select_ms(url: str, schema: str) -> float:
    query = sql.SQL(
        "SELECT originator_version, topic, state FROM {} WHERE originator_id = %s "
        "ORDER BY originator_version"
    ).format(sql.Identifier(schema, "ledger_events"))
    with psycopg.connect(url) as conn:
        conn.execute(query, (SESSION,)).fetchall()  # warm: plan, cache
        started = time.perf_counter()
        conn.execute(query, (SESSION,)).fetchall()
        return (time.perf_counter() - started) * 1000


def _figures(values: Sequence[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values), 1), "min": round(min(values), 1)}


async def _run(
    target: str, ledger_pid: int, settings: Settings, facts: int, runs: int
) -> dict[str, Any]:
    async with LedgerClient(target, settings) as client:
        written = await write_session(client, facts)
        await rebuild_once(client, ledger_pid)  # warm-up: imports, pools, prepared paths
        results = [await rebuild_once(client, ledger_pid) for _ in range(runs)]
    last = results[-1]
    return {
        "session": written,
        "rebuilt_facts": last.facts,
        "presented_messages": last.messages,
        "context_tokens": last.context_tokens,
        "read_ms": _figures([r.read_ms for r in results]),
        "context_ms": _figures([r.context_ms for r in results]),
        "total_ms": _figures([r.read_ms + r.context_ms for r in results]),
        # CPU time of both processes: steadier than wall time on a busy machine.
        "successor_cpu_ms": _figures([r.cpu_ms for r in results]),
        "ledger_cpu_ms": _figures([r.ledger_cpu_ms for r in results]),
    }


def measure(
    database_url: str | None = None, facts: int = DEFAULT_FACTS, runs: int = DEFAULT_RUNS
) -> dict[str, Any]:
    with standalone_ledger(database_url) as ledger:
        figures = asyncio.run(_run(ledger.target, ledger.pid, ledger.client_settings, facts, runs))
        raw = raw_select_ms(ledger.url, ledger.schema)
    return {
        "benchmark": "rebuild",
        "database": "postgresql",
        "runs": runs,
        **figures,
        "raw_select_ms": round(raw, 1),
        "targets": {"total_ms": TARGET_TOTAL_MS},
        "meets_target": figures["total_ms"]["p50"] <= TARGET_TOTAL_MS,
    }


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else None), indent=2))

"""Benchmark of the compaction policy's plan path on synthetic sessions.

The plan path is what the runner does before a model request: size the
context, apply the trigger, choose the cut and prepare the ranges
(`plan_compaction`). Sessions are parsed once beforehand, as the runner
keeps its entries parsed; parsing is reported separately.

Run: `python -m bench.compaction_policy`.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Mapping
from functools import partial

from compaction.policy import (
    CompactionSettings,
    ContextEntry,
    build_context,
    plan_compaction,
    to_entries,
)

CONTEXT_WINDOW = 200_000
RUNS = 15
SEED = 7201


def _text(rng: random.Random, low: int, high: int) -> str:
    # Token counts drawn per message; 4 characters per token.
    return "x" * (4 * rng.randint(low, high))


def _approximate_tokens(message: Mapping[str, object]) -> int:
    return len(json.dumps(message)) // 4


def _tool_call(number: int, rng: random.Random) -> dict[str, object]:
    arguments = {"path": f"/src/module_{number}.py", "limit": rng.randint(1, 500)}
    return {"type": "toolCall", "id": f"call_{number}", "name": "read", "arguments": arguments}


def synthetic_session(message_count: int, seed: int = SEED) -> list[dict[str, object]]:
    """Turns of a coding-agent session in the context-entry JSON shape: a user
    request, then assistant steps with 0 to 3 tool calls each followed by their
    results; some thinking, some oversized tool output, and on each assistant
    message the usage a provider would report for the context so far.
    Nothing is compacted yet, so the whole session is in the cut range (the
    worst case for the policy)."""
    rng = random.Random(seed)
    raw: list[dict[str, object]] = []
    call_number = 0
    context_so_far = 0
    while len(raw) < message_count:
        request: dict[str, object] = {"role": "user", "content": _text(rng, 5, 300)}
        context_so_far += _approximate_tokens(request)
        raw.append({"type": "message", "message": request})
        for _step in range(rng.randint(1, 6)):
            content: list[dict[str, object]] = []
            if rng.random() < 0.3:
                content.append({"type": "thinking", "thinking": _text(rng, 10, 200)})
            content.append({"type": "text", "text": _text(rng, 0, 250)})
            call_ids: list[str] = []
            for _ in range(rng.choice((0, 1, 1, 1, 2, 3))):
                call_number += 1
                call_ids.append(f"call_{call_number}")
                content.append(_tool_call(call_number, rng))
            output_tokens = _approximate_tokens({"content": content})
            assistant: dict[str, object] = {
                "role": "assistant",
                "content": content,
                "usage": {"input": context_so_far, "output": output_tokens},
                "stopReason": "stop",
            }
            context_so_far += output_tokens
            raw.append({"type": "message", "message": assistant})
            for call_id in call_ids:
                result: dict[str, object] = {
                    "role": "toolResult",
                    "toolCallId": call_id,
                    "content": [{"type": "text", "text": _text(rng, 20, 3000)}],
                }
                context_so_far += _approximate_tokens(result)
                raw.append({"type": "message", "message": result})
    return raw[:message_count]


def _median_ms(action: Callable[[], object], runs: int = RUNS) -> float:
    durations = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        durations.append(time.perf_counter() - started)
    return statistics.median(durations) * 1000


def _plan(entries: tuple[ContextEntry, ...], settings: CompactionSettings) -> None:
    plan = plan_compaction(entries, settings, CONTEXT_WINDOW)
    # A synthetic session of this size is far over the limit; if the plan
    # ever came back empty the bench would be timing a shortcut.
    if not plan.should_compact or plan.preparation is None:
        raise RuntimeError("benchmark session did not produce a compaction plan")


def measure() -> dict[str, float]:
    """Median milliseconds per operation on 1k- and 10k-message sessions."""
    settings = CompactionSettings()
    results: dict[str, float] = {}
    for label, count in (("1k", 1_000), ("10k", 10_000)):
        raw = synthetic_session(count)
        entries = to_entries(raw)
        results[f"plan_{label}_ms"] = _median_ms(partial(_plan, entries, settings))
        results[f"build_context_{label}_ms"] = _median_ms(partial(build_context, entries))
        results[f"parse_{label}_ms"] = _median_ms(partial(to_entries, raw), runs=5)
    return results


if __name__ == "__main__":
    print(json.dumps({name: round(value, 3) for name, value in measure().items()}, indent=2))

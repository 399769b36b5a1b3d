"""CPU per fact of the ledger's fact validation (`facts.parse_fact`), and
per request body of the edge's body decoding (`edge.bodies.decode`).

    .venv/bin/python -m bench.fact_decode [--compare path/to/facts.py]

Times `parse_fact` on the shapes a turn writes (an input, an assistant
answer with tool calls, a tool result) in process CPU time, best of several
rounds, so a noisy neighbour inflates nothing but the worst round. With
`--compare`, another version of the module (a copy of an older facts.py) is
timed in the same process, round for round, for an A/B on one machine state.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

ROUNDS = 7
CALLS_PER_ROUND = 20_000
MAX_BYTES = 1 << 20

SAMPLES: dict[str, tuple[str, dict[str, Any]]] = {
    "input": (
        "input",
        {
            "text": "Summarise the attached report and list the three biggest risks. " * 3,
            "requestId": "req-7f3a9c2e-0b1d-4e55-9a7e-3c1f2b8d9e10",
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        },
    ),
    "assistant_tool_calls": (
        "assistant",
        {
            "generationId": "gen-0c5e1f7a9b3d",
            "content": [{"type": "text", "text": "Let me look that up in two places."}],
            "toolCalls": [
                {
                    "id": "call_9f2c1b7e4a",
                    "name": "search",
                    "arguments": {"query": "quarterly risk register", "limit": 5},
                },
                {
                    "id": "call_1d8e3f6a0c",
                    "name": "read_file",
                    "arguments": {"path": "reports/q3.md", "offset": 0, "length": 4096},
                },
            ],
            "usage": {"inputTokens": 1834, "outputTokens": 92},
            "model": "scripted",
            "stopReason": "tool_use",
        },
    ),
    "assistant_final": (
        "assistant",
        {
            "generationId": "gen-4a1b",
            "content": [{"type": "text", "text": "The three biggest risks are ... " * 8}],
            "toolCalls": [],
            "usage": {"inputTokens": 2200, "outputTokens": 310},
            "model": "scripted",
            "stopReason": "end_turn",
            "inputSeqs": [12],
        },
    ),
    "tool_result": (
        "tool_result",
        {
            "toolCallId": "call_9f2c1b7e4a",
            "content": "1. Supplier concentration ... " * 30,
            "isError": False,
            "idempotencyKey": "s1:call_9f2c1b7e4a",
        },
    ),
}


def load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cpu_us_per_call(parse: Callable[[str, str, int], Any], kind: str, text: str) -> float:
    started = time.process_time()
    for _ in range(CALLS_PER_ROUND):
        parse(kind, text, MAX_BYTES)
    return (time.process_time() - started) / CALLS_PER_ROUND * 1e6


def measure(modules: dict[str, ModuleType]) -> dict[str, dict[str, float]]:
    best: dict[str, dict[str, float]] = {name: {} for name in modules}
    for _ in range(ROUNDS):
        for sample, (kind, data) in SAMPLES.items():
            text = json.dumps(data, ensure_ascii=False)
            for name, module in modules.items():
                took = cpu_us_per_call(module.parse_fact, kind, text)
                previous = best[name].get(sample, float("inf"))
                best[name][sample] = round(min(previous, took), 2)
    return best


def bodies_us_per_call() -> dict[str, float]:
    from edge import bodies

    samples: dict[str, tuple[type[bodies.Body], bytes]] = {
        "input": (
            bodies.InputBody,
            json.dumps({"text": SAMPLES["input"][1]["text"], "requestId": "req-1"}).encode(),
        ),
        "retry": (bodies.RetryBody, b'{"seq": 12, "requestId": "retry-12-a"}'),
        "approval": (
            bodies.DecisionBody,
            b'{"toolCallId": "call_9f2c1b7e4a", "approve": true, "note": "fine by me"}',
        ),
        "blob": (bodies.CreateBlobBody, b'{"length": 204800, "contentType": "image/png"}'),
        "drain": (bodies.DrainBody, b'{"mode": "handoff", "deadlineMs": 30000}'),
    }
    best: dict[str, float] = {}
    for _ in range(ROUNDS):
        for name, (schema, raw) in samples.items():
            started = time.process_time()
            for _ in range(CALLS_PER_ROUND):
                bodies.decode(raw, schema)
            took = (time.process_time() - started) / CALLS_PER_ROUND * 1e6
            best[name] = round(min(best.get(name, float("inf")), took), 2)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--compare", help="another facts.py to time alongside")
    args = parser.parse_args()
    from services.ledger import facts

    modules = {"current": facts}
    if args.compare:
        modules["compare"] = load(args.compare, "facts_compared")
    report = {"us_per_fact_cpu": measure(modules), "us_per_body_cpu": bodies_us_per_call()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

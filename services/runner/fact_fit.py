"""A runner's fact, cut to fit the ledger's fact limit before it is appended.

The ledger refuses a fact over `KEEL_MAX_FACT_BYTES` (FACT_TOO_LARGE). For a
client's input that is the right answer; for a model's answer or a tool's
result it is not: the attempt would fail, be retried, get the same answer,
and park the session again after every new input. So the runner cuts what
it writes first:

1. the longest texts (answer text, thinking, a tool's output, an error),
   each ending with a note saying how much was cut;
2. then, if that is not enough, the arguments of tool calls: a call whose
   arguments were cut is never run with other arguments than the model's;
   it keeps a note as `argumentsText` and is refused to the model, as a call
   whose arguments are not a JSON object is (services/runner/transcript.py).

Ids, names and short strings are never touched. A fact that still does not
fit is left to the ledger's refusal.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

# Strings up to this long are ids, names, reasons: never cut.
MIN_CUT_CHARS = 256
# Opaque strings a provider checks when they are sent back: cutting one
# would make the whole conversation unusable.
_OPAQUE_KEYS = frozenset({"signature", "data", "arguments"})
_MAX_ROUNDS = 64


def fact_bytes(data: Mapping[str, Any]) -> int:
    """The size the ledger measures: the fact's JSON as the client sends it."""
    return len(json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def fit_fact(data: Mapping[str, Any], max_bytes: int) -> Mapping[str, Any]:
    """`data`, or a copy cut to at most `max_bytes` (see the module doc)."""
    size = fact_bytes(data)
    if size <= max_bytes:
        return data
    fitted: dict[str, Any] = copy.deepcopy(dict(data))
    for _ in range(_MAX_ROUNDS):
        leaves = _cuttable(fitted)
        if not leaves:
            break
        holder, key, text = max(leaves, key=lambda leaf: len(leaf[2]))
        holder[key] = _cut(text, size - max_bytes, max_bytes)
        size = fact_bytes(fitted)
        if size <= max_bytes:
            return fitted
    for call in fitted.get("toolCalls") or ():
        if isinstance(call, dict) and "arguments" in call:
            arguments = call.pop("arguments")
            call["argumentsText"] = (
                f"[arguments of {fact_bytes({'a': arguments})} bytes not kept: "
                f"the answer was over the limit of {max_bytes} bytes]"
            )
            if fact_bytes(fitted) <= max_bytes:
                break
    return fitted


def _cut(text: str, excess: int, limit: int) -> str:
    note = f"\n[cut: {excess} bytes over the fact limit of {limit} bytes]"
    encoded = text.encode("utf-8", "surrogatepass")
    # JSON escapes make a string larger on the wire than its UTF-8: cut
    # twice the excess, plus room for the note.
    keep = max(0, len(encoded) - 2 * excess - 2 * len(note.encode()))
    return encoded[:keep].decode("utf-8", "ignore") + note


def _cuttable(value: Any) -> list[tuple[Any, Any, str]]:
    """(container, key, text) of every long string outside opaque fields."""
    found: list[tuple[Any, Any, str]] = []
    items: Any
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items() if k not in _OPAQUE_KEYS]
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return found
    for key, item in items:
        if isinstance(item, str):
            if len(item) > MIN_CUT_CHARS and not item.endswith(" bytes]"):
                found.append((value, key, item))
        else:
            found.extend(_cuttable(item))
    return found

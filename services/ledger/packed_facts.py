"""Packed pages: many facts of one session in one bytes field.

A packed page (`ReadResponse.packed_facts`, asked for with
`ReadRequest.packed`) is one UTF-8 JSON array with an element per fact,
`[seq, kind, data, timestamp_ms, epoch]`, `data` the fact's JSON as
`Fact.data_json` carries it. A cold rebuild reads thousands of facts: as
`Fact` messages each costs a protobuf message on both sides and a JSON parse
of its own on the reader's; packed, the ledger copies each row's stored JSON
into the page unparsed, and the reader decodes the page in one call.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import msgspec

from services.ledger.fact_json import StoredData
from services.ledger.facts import INPUT, CommittedFact

# A packed page may hold this many facts; its bytes bound it too.
MAX_PACKED_READ_LIMIT: Final = 10_000
# What a packed fact adds to its data and kind: brackets, commas, quotes and
# three integers of at most 20 characters each.
PACKED_FACT_OVERHEAD: Final = 72


# Not tracked by the garbage collector: a page makes thousands of them and
# they hold no reference cycles.
class PackedFact(msgspec.Struct, array_like=True, gc=False):
    """One element of a packed page."""

    seq: int
    kind: str
    # Written as JSON text (msgspec.Raw); read back as any JSON value, as
    # `fact_json.decode_data` reads a `data_json`.
    data: Any
    timestamp_ms: int
    epoch: int


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(list[PackedFact])


def data_utf8(data: Mapping[str, Any]) -> bytes:
    if isinstance(data, StoredData):
        return data.utf8
    # Not the stored text (a row read through the mapper): ASCII escapes,
    # so even a lone surrogate travels, as the escape json.loads reads.
    return json.dumps(data, separators=(",", ":")).encode()


def fact_element(fact: CommittedFact) -> tuple[PackedFact, int]:
    """A fact as a page element, and an upper bound of its packed bytes."""
    data = data_utf8(fact.data)
    # A kind is short, but bound its escapes too (six bytes a character).
    size = len(data) + 6 * len(fact.kind) + PACKED_FACT_OVERHEAD
    return PackedFact(fact.seq, fact.kind, msgspec.Raw(data), fact.timestamp_ms, fact.epoch), size


def pack(elements: Sequence[PackedFact]) -> bytes:
    return _ENCODER.encode(elements)


def pack_facts(facts: Iterable[CommittedFact]) -> bytes:
    """Committed facts as a packed page."""
    return pack([fact_element(f)[0] for f in facts])


def pack_input(session_id: str, seq: int, data: Mapping[str, Any]) -> bytes:
    """The page of one input its writer has just committed as `seq` (with no
    epoch, as every client fact): what a Read would return but for the
    timestamp, taken here, which no reader of a fresh input needs."""
    fact = CommittedFact(session_id, seq, INPUT, dict(data), int(time.time() * 1000), 0)
    return pack_facts([fact])


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No garbage collection while a page is decoded: it makes a dict or a
    list for every JSON object and array, thousands of them, which set off
    collections that find nothing (the decode holds the GIL throughout and
    makes no cycles). A fifth of a page's decoding time."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def facts_from_packed(session_id: str, packed: bytes) -> list[CommittedFact]:
    """The facts of a packed page, equal to what `codec.fact_from_pb` makes
    of the same facts sent one message each.

    One decode for the whole page. What msgspec refuses and Python's json
    reads (NaN, an escaped lone surrogate: see `decode_data`) is read by the
    latter; on any other JSON text the two read the same values."""
    try:
        with _collector_paused():
            elements = _DECODER.decode(packed)
        return [
            CommittedFact(session_id, f.seq, f.kind, f.data, f.timestamp_ms, f.epoch)
            for f in elements
        ]
    except msgspec.MsgspecError:
        page = json.loads(packed)
    return [
        CommittedFact(session_id, int(seq), str(kind), data, int(stamp), int(epoch))
        for seq, kind, data, stamp, epoch in page
    ]

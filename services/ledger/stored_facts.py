"""Committed facts straight from the rows the event store wrote.

Reading through the eventsourcing mapper parses every row's JSON into a
domain event, and the Read RPC then encodes each fact's data back into the
JSON it was stored as. Here a row is decoded once, by msgspec, into what a
fact needs (kind, epoch, timestamp), and its data stays the stored JSON text
(`StoredData`): the servicer sends that text as `data_json` unchanged, and
nothing on the ledger's side pays for a dict it never looks at.

The stored form is the mapper's (`JSONTranscoder`: compact separators, no
ASCII escaping, a datetime as `{"_type_": "datetime_iso", "_data_": iso}`),
and the data is written with the very encoder `fact_to_pb` would use, so the
text passed on is the text `fact_to_pb` would have produced. A row this
module does not recognise (another topic, an unexpected field, JSON msgspec
refuses, such as NaN) returns None and the caller reads it through the mapper.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

import msgspec
from eventsourcing.persistence import DatetimeAsISO, JSONTranscoder, Mapper, StoredEvent
from eventsourcing.utils import get_topic

from services.ledger import facts as F
from services.ledger.domain import SessionStream, timestamp_ms, to_committed
from services.ledger.fact_json import StoredData
from services.ledger.packed_facts import PACKED_FACT_OVERHEAD, PackedFact, data_utf8, fact_element

RECORDED_TOPIC = get_topic(SessionStream.Recorded)
CREATED_TOPIC = get_topic(SessionStream.Created)
# The name the mapper's transcoder writes a datetime under.
DATETIME_TRANSCODING = "datetime_iso"


_STAMP_FIELDS = {"name": "_type_", "moment": "_data_"}


# Not tracked by the garbage collector (`gc=False`): decoded rows hold no
# reference cycles, and a page makes thousands of them.
class _Stamp(msgspec.Struct, forbid_unknown_fields=True, rename=_STAMP_FIELDS, gc=False):
    name: str
    # Parsed by msgspec as the transcoding's `datetime.fromisoformat` would.
    moment: datetime


class _Recorded(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    timestamp: _Stamp
    kind: str
    data: msgspec.Raw
    epoch: int


class _Created(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    timestamp: _Stamp
    originator_topic: str
    session_id: str
    tenant_id: str


# A stored row's state, by topic (also read by services.ledger.packed_facts).
RECORDED_STATE = msgspec.json.Decoder(_Recorded)
CREATED_STATE = msgspec.json.Decoder(_Created)


def stored_fact(session_id: str, seq: int, topic: str, state: bytes) -> F.CommittedFact | None:
    """The fact a stored row holds, or None when the mapper must read it."""
    try:
        if topic == RECORDED_TOPIC:
            recorded = RECORDED_STATE.decode(state)
            stamp = recorded.timestamp
            if stamp.name != DATETIME_TRANSCODING:
                return None
            data = StoredData(bytes(recorded.data))
            moment = timestamp_ms(stamp.moment)
            return F.CommittedFact(session_id, seq, recorded.kind, data, moment, recorded.epoch)
        if topic == CREATED_TOPIC:
            created = CREATED_STATE.decode(state)
            stamp = created.timestamp
            if stamp.name != DATETIME_TRANSCODING:
                return None
            tenant = {"tenantId": created.tenant_id}
            moment = timestamp_ms(stamp.moment)
            return F.CommittedFact(session_id, seq, F.SESSION_CREATED, tenant, moment, 0)
    except msgspec.MsgspecError:
        return None
    return None


class FactReader:
    """Stored rows to facts: decoded here when they are the mapper's plain
    JSON, through the mapper when they are not (a cipher or a compressor
    configured in the environment, a row of an unknown shape)."""

    def __init__(self, mapper: Mapper[str]) -> None:
        self._mapper = mapper
        transcoder = mapper.transcoder
        self.plain = (
            mapper.cipher is None
            and mapper.compressor is None
            and isinstance(transcoder, JSONTranscoder)
            and isinstance(transcoder.names.get(DATETIME_TRANSCODING), DatetimeAsISO)
        )

    def facts(
        self, session_id: str, rows: Iterable[tuple[int, str, bytes]]
    ) -> list[F.CommittedFact]:
        out: list[F.CommittedFact] = []
        for seq, topic, state in rows:
            fact = stored_fact(session_id, seq, topic, state) if self.plain else None
            if fact is None:
                event = self._mapper.to_domain_event(StoredEvent(session_id, seq, topic, state))
                fact = to_committed(session_id, event)
            out.append(fact)
        return out


def _stored_element(seq: int, topic: str, state: bytes) -> PackedFact | None:
    """The element of a stored row in the mapper's plain JSON, its data
    the stored text itself (see `stored_fact`); None when the
    row must be read through the mapper."""
    try:
        if topic == RECORDED_TOPIC:
            recorded = RECORDED_STATE.decode(state)
            stamp = recorded.timestamp
            if stamp.name != DATETIME_TRANSCODING:
                return None
            moment = timestamp_ms(stamp.moment)
            return PackedFact(seq, recorded.kind, recorded.data, moment, recorded.epoch)
        if topic == CREATED_TOPIC:
            created = CREATED_STATE.decode(state)
            stamp = created.timestamp
            if stamp.name != DATETIME_TRANSCODING:
                return None
            tenant = data_utf8({"tenantId": created.tenant_id})
            moment = timestamp_ms(stamp.moment)
            return PackedFact(seq, F.SESSION_CREATED, msgspec.Raw(tenant), moment, 0)
    except msgspec.MsgspecError:
        return None
    return None


def pack_rows(
    reader: FactReader,
    session_id: str,
    rows: Iterable[tuple[int, str, bytes]],
    room: int,
    into: list[PackedFact],
) -> int:
    """Appends the rows' elements to `into` while they fit in `room` bytes
    (the first always does), and returns the room left (negative: full)."""
    for seq, topic, state in rows:
        element = _stored_element(seq, topic, state) if reader.plain else None
        if element is None:
            element, size = fact_element(reader.facts(session_id, [(seq, topic, state)])[0])
        else:
            # The stored state holds the kind and the data, and more.
            size = len(state) + PACKED_FACT_OVERHEAD
        if size > room and into:
            return -1
        into.append(element)
        room -= size
    return room

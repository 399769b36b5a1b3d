"""A committed fact's data as JSON text: read on the wire and from the store.

`StoredData` keeps the text a row was stored as, so the ledger passes it on
without parsing it; `decode_data` reads any fact's `data_json`. Apart from the
event store's row decoding (`stored_facts`), so a ledger client reads facts
without loading eventsourcing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec


class StoredData(Mapping[str, Any]):
    """A committed fact's data as the UTF-8 JSON it was stored as, parsed on
    first use only (the ledger itself rarely looks inside)."""

    __slots__ = ("_decoded", "utf8")

    def __init__(self, utf8: bytes) -> None:
        self.utf8 = utf8
        self._decoded: dict[str, Any] | None = None

    def _value(self) -> dict[str, Any]:
        if self._decoded is None:
            value = decode_data(self.utf8)
            if not isinstance(value, dict):
                raise ValueError("a fact's data must be a JSON object")
            self._decoded = value
        return self._decoded

    def __getitem__(self, key: str) -> Any:
        return self._value()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._value())

    def __len__(self) -> int:
        return len(self._value())

    def __repr__(self) -> str:
        return repr(self._value())


_JSON = msgspec.json.Decoder()


def decode_data(data_json: str | bytes) -> Any:
    """A fact's data from its JSON text, as `json.loads` would read it.

    msgspec first (several times faster); what it refuses and Python's json
    reads (NaN, a number past a float's range, an escaped lone surrogate)
    is read by the latter, so no committed fact becomes unreadable."""
    try:
        return _JSON.decode(data_json or "{}")
    except msgspec.MsgspecError:
        return json.loads(data_json or "{}")

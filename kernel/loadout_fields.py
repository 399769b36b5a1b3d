"""The field checks the loadout schema (kernel/loadout.py) is built from.

Each check takes a value and its path in the document and raises an
`InvalidLoadout` naming that path: strings, booleans, bounded integers,
choices, URLs, lists and maps of checked elements, and objects whose
unknown fields are refused. They say nothing of what a loadout holds;
kernel/loadout.py composes them into the schema, so what the schema allows
reads apart from how a value is checked.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from kernel.errors import InvalidLoadout

_SHOWN_CHARS = 60
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
# An HTTP header name (RFC 9110 token).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Counts are stored in 32-bit columns (admission slots) or sent to SDKs.
MAX_INTEGER = 2**31 - 1

Check = Callable[[Any, str], None]


def member_path(field: str, name: Any) -> str:
    """The path of an object's member: `model.name`, or `env["odd.name"]`
    when the name would make a dotted path ambiguous."""
    if isinstance(name, str) and _PLAIN_NAME.fullmatch(name):
        return f"{field}.{name}" if field else name
    return f"{field}[{json.dumps(str(name))}]"


def refuse(field: str, message: str) -> InvalidLoadout:
    return InvalidLoadout(f"{field}: {message}", field=field)


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…"


def kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def string(value: Any, field: str) -> None:
    if not isinstance(value, str):
        raise refuse(field, f"must be a string, got {kind_of(value)}")


def non_empty_string(value: Any, field: str) -> None:
    string(value, field)
    if not value.strip():
        raise refuse(field, "must not be empty")


def boolean(value: Any, field: str) -> None:
    if not isinstance(value, bool):
        raise refuse(field, f"must be true or false, got {kind_of(value)}")


def integer(minimum: int, maximum: int = MAX_INTEGER) -> Check:
    def check(value: Any, field: str) -> None:
        # bool is an int subclass; `true` is not a count.
        if isinstance(value, bool) or not isinstance(value, int):
            raise refuse(field, f"must be an integer, got {kind_of(value)}")
        if not minimum <= value <= maximum:
            raise refuse(field, f"must be from {minimum} to {maximum}, got {shown(value)}")

    return check


positive = integer(1)
non_negative = integer(0)


def threshold(value: Any, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise refuse(field, f"must be a number, got {kind_of(value)}")
    if isinstance(value, int):
        integer(0)(value, field)
    elif not math.isfinite(value) or value < 0:
        raise refuse(
            field, f"must be a finite number >= 0 (a fraction of the window or tokens), got {value}"
        )


def one_of(choices: tuple[str, ...]) -> Check:
    def check(value: Any, field: str) -> None:
        if value not in choices:
            raise refuse(field, f"must be one of {', '.join(choices)}, got {shown(value)}")

    return check


def http_url(value: Any, field: str) -> None:
    string(value, field)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise refuse(field, f"is not a valid URL: {shown(value)}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise refuse(field, f"must be an http(s) URL, got {shown(value)}")


def grpc_target(value: Any, field: str) -> None:
    non_empty_string(value, field)
    if any(c.isspace() for c in value):
        raise refuse(field, f"must be a gRPC target such as host:port, got {shown(value)}")


def list_of(item: Check, *, non_empty: bool = False) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, list):
            raise refuse(field, f"must be a list, got {kind_of(value)}")
        if non_empty and not value:
            raise refuse(field, "must not be empty")
        for index, element in enumerate(value):
            item(element, f"{field}[{index}]")

    return check


def map_of(key: Check, value_check: Check) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise refuse(field, f"must be an object, got {kind_of(value)}")
        for name, element in value.items():
            key(name, member_path(field, name))
            value_check(element, member_path(field, name))

    return check


def header_name(value: Any, field: str) -> None:
    if not isinstance(value, str) or not _HEADER_NAME.fullmatch(value):
        raise refuse(field, "is not a valid HTTP header name")


def object_of(
    value: Any,
    field: str,
    fields: Mapping[str, Check],
    required: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Checks an object's known fields; refuses unknown ones and missing required ones."""
    if not isinstance(value, dict):
        raise refuse(field, f"must be an object, got {kind_of(value)}")
    for name, element in value.items():
        path = member_path(field, name)
        check = fields.get(name)
        if check is None:
            known = ", ".join(fields)
            raise refuse(path, f"unknown field (known here: {known})")
        if element is not None:
            check(element, path)
    for name in required:
        if value.get(name) is None:
            raise refuse(member_path(field, name), "is required")
    return value

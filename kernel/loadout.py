"""The loadout schema (SPEC §10): what a tenant may write, checked field by field.

Every field is optional and an unknown field is refused, not ignored: a typo
such as `systemPromt` would otherwise silently run the tenant on defaults. A
refusal is an `InvalidLoadout` whose `field` is the path of the offending
value (`model.provider`, `tools[1].transport`, `compaction.threshold`), so an
editor or a CLI can point at it.

Tools come from sources (`tools`): the runner's built-ins (plain names, or
`{source: builtin, names: [...]}`), MCP servers (`source: mcp`, over `stdio`
or streamable `http`) and gRPC ToolServices (`source: grpc`). The model sees
an MCP or gRPC source's tools as `<name>.<tool>` (`files.read`), so a source
name has no dot, is unique in the document and is not a built-in's name; every
source may set `timeoutMs` (per call, at most an hour), `maxResultBytes` and
`requireApproval` (its tools' own names, without the prefix). Which commands
and targets a source may use is the operator's policy (kernel.loadout_secrets).

Secrets never appear in a loadout: it names the environment variable of the
runner that holds them (`apiKeyEnv`, `headersEnv`, an MCP child's `env`).
Such a name is `[A-Z_][A-Z0-9_]*` and never starts with `KEEL_`, so a
loadout cannot make a runner hand its own configuration (internal tokens,
database URLs) to a model provider or a tool server. Which of the other
names a tenant may use, and where its model may be called, is the
operator's policy: a second step the kernel applies with the tenant's id
(kernel.loadout_secrets), while this schema is the same for every tenant.

`null` counts as absent for optional fields, as the runner's and the
compaction service's readers of the same fields treat it; the shapes here are
exactly what those readers accept (see provider_from_loadout and
compaction.policy.trigger.settings_from_dict), so a document accepted here
never fails later when an attempt builds its provider or its settings.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from kernel.errors import InvalidLoadout

PROVIDERS = ("openai", "anthropic", "scripted")
# The runner's built-in tools (agent_io.tools.builtin_tools).
BUILTIN_TOOLS = ("clock", "sleep", "counter")
MCP_TRANSPORTS = ("stdio", "http")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_RESERVED_ENV_PREFIX = "KEEL_"
# An HTTP header name (RFC 9110 token).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# No dot: the dot separates a source's name from its tools' names.
_TOOL_SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,31}")
_SHOWN_CHARS = 60
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
# Counts are stored in 32-bit columns (admission slots) or sent to SDKs.
MAX_INTEGER = 2**31 - 1
# The longest per-call tool timeout a loadout may set: an hour.
MAX_TOOL_TIMEOUT_MS = 3_600_000

Check = Callable[[Any, str], None]


def member_path(field: str, name: Any) -> str:
    """The path of an object's member: `model.name`, or `env["odd.name"]`
    when the name would make a dotted path ambiguous."""
    if isinstance(name, str) and _PLAIN_NAME.fullmatch(name):
        return f"{field}.{name}" if field else name
    return f"{field}[{json.dumps(str(name))}]"


def _refuse(field: str, message: str) -> InvalidLoadout:
    return InvalidLoadout(f"{field}: {message}", field=field)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…"


def _kind(value: Any) -> str:
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


# -- leaves --


def _string(value: Any, field: str) -> None:
    if not isinstance(value, str):
        raise _refuse(field, f"must be a string, got {_kind(value)}")


def _non_empty_string(value: Any, field: str) -> None:
    _string(value, field)
    if not value.strip():
        raise _refuse(field, "must not be empty")


def _boolean(value: Any, field: str) -> None:
    if not isinstance(value, bool):
        raise _refuse(field, f"must be true or false, got {_kind(value)}")


def _integer(minimum: int, maximum: int = MAX_INTEGER) -> Check:
    def check(value: Any, field: str) -> None:
        # bool is an int subclass; `true` is not a count.
        if isinstance(value, bool) or not isinstance(value, int):
            raise _refuse(field, f"must be an integer, got {_kind(value)}")
        if not minimum <= value <= maximum:
            raise _refuse(field, f"must be from {minimum} to {maximum}, got {_shown(value)}")

    return check


_positive = _integer(1)
_non_negative = _integer(0)


def _threshold(value: Any, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _refuse(field, f"must be a number, got {_kind(value)}")
    if isinstance(value, int):
        _integer(0)(value, field)
    elif not math.isfinite(value) or value < 0:
        raise _refuse(
            field, f"must be a finite number >= 0 (a fraction of the window or tokens), got {value}"
        )


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(value: Any, field: str) -> None:
        if value not in choices:
            raise _refuse(field, f"must be one of {', '.join(choices)}, got {_shown(value)}")

    return check


def _env_name(value: Any, field: str) -> None:
    """The name of a runner environment variable that holds a secret."""
    _string(value, field)
    if not _ENV_NAME.fullmatch(value):
        raise _refuse(
            field,
            "must name an environment variable (capitals, digits and '_', e.g. "
            f"OPENAI_API_KEY), got {_shown(value)}; a loadout never holds the secret itself",
        )
    if value.startswith(_RESERVED_ENV_PREFIX):
        raise _refuse(field, f"{value} is Keel's own configuration, not a variable for a loadout")


def _http_url(value: Any, field: str) -> None:
    _string(value, field)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise _refuse(field, f"is not a valid URL: {_shown(value)}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _refuse(field, f"must be an http(s) URL, got {_shown(value)}")


def _target(value: Any, field: str) -> None:
    _non_empty_string(value, field)
    if any(c.isspace() for c in value):
        raise _refuse(field, f"must be a gRPC target such as host:port, got {_shown(value)}")


def _list_of(item: Check, *, non_empty: bool = False) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, list):
            raise _refuse(field, f"must be a list, got {_kind(value)}")
        if non_empty and not value:
            raise _refuse(field, "must not be empty")
        for index, element in enumerate(value):
            item(element, f"{field}[{index}]")

    return check


def _map_of(key: Check, value_check: Check) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise _refuse(field, f"must be an object, got {_kind(value)}")
        for name, element in value.items():
            key(name, member_path(field, name))
            value_check(element, member_path(field, name))

    return check


def _header_name(value: Any, field: str) -> None:
    if not isinstance(value, str) or not _HEADER_NAME.fullmatch(value):
        raise _refuse(field, "is not a valid HTTP header name")


def _tool_source_name(value: Any, field: str) -> None:
    _string(value, field)
    if not _TOOL_SOURCE_NAME.fullmatch(value):
        raise _refuse(
            field,
            "must be 1-32 letters, digits, '_' or '-', starting with a letter or digit "
            f"(no '.': tools are named <source>.<tool>); got {_shown(value)}",
        )
    if value in BUILTIN_TOOLS:
        raise _refuse(field, f"{value} is the name of a built-in tool; choose another name")


def _builtin_name(value: Any, field: str) -> None:
    _string(value, field)
    if value not in BUILTIN_TOOLS:
        raise _refuse(
            field, f"no built-in tool {_shown(value)}; built-ins are {', '.join(BUILTIN_TOOLS)}"
        )


# -- objects --


def _object(
    value: Any,
    field: str,
    fields: Mapping[str, Check],
    required: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Checks an object's known fields; refuses unknown ones and missing required ones."""
    if not isinstance(value, dict):
        raise _refuse(field, f"must be an object, got {_kind(value)}")
    for name, element in value.items():
        path = member_path(field, name)
        check = fields.get(name)
        if check is None:
            known = ", ".join(fields)
            raise _refuse(path, f"unknown field (known here: {known})")
        if element is not None:
            check(element, path)
    for name in required:
        if value.get(name) is None:
            raise _refuse(member_path(field, name), "is required")
    return value


def _thinking(value: Any, field: str) -> None:
    """Anthropic's thinking config, passed to the API as written."""
    _object(
        value,
        field,
        {"type": _non_empty_string, "budget_tokens": _positive, "display": _string},
        required=("type",),
    )


_PROVIDER_FIELDS: dict[str, dict[str, Check]] = {
    "scripted": {"tokenDelayMs": _non_negative},
    "openai": {"baseUrl": _http_url, "apiKeyEnv": _env_name},
    "anthropic": {
        "baseUrl": _http_url,
        "apiKeyEnv": _env_name,
        "thinking": _thinking,
    },
}
_COMMON_MODEL_FIELDS: dict[str, Check] = {
    "provider": _one_of(PROVIDERS),
    "name": _string,
    "contextWindow": _positive,
    "maxOutputTokens": _positive,
}


def _model(value: Any, field: str) -> None:
    if not isinstance(value, dict):
        raise _refuse(field, f"must be an object, got {_kind(value)}")
    provider = value.get("provider")
    if "provider" in value:
        # Unlike other fields, an explicit null is refused: the provider
        # factory reads only a missing provider as the scripted model.
        _one_of(PROVIDERS)(provider, f"{field}.provider")
    kind = provider or "scripted"
    fields = {**_COMMON_MODEL_FIELDS, **_PROVIDER_FIELDS[kind]}
    for name in value:
        if name not in fields and any(name in extra for extra in _PROVIDER_FIELDS.values()):
            raise _refuse(f"{field}.{name}", f"does not apply to the {kind} model")
    _object(value, field, fields)
    if kind != "scripted":
        # The provider cannot be built without one (provider_from_loadout).
        name = value.get("name")
        if name is None or not name.strip():
            raise _refuse(f"{field}.name", f"a {kind} model needs a name")


def _compaction(value: Any, field: str) -> None:
    _object(
        value,
        field,
        {
            "enabled": _boolean,
            "threshold": _threshold,
            "keepRecentTokens": _non_negative,
            "reserveTokens": _non_negative,
        },
    )


def _admission(value: Any, field: str) -> None:
    _object(value, field, {"maxConcurrentRuns": _positive})


_APPROVALS = _list_of(_non_empty_string)
# What every source may set, whatever its kind.
_SOURCE_LIMITS: dict[str, Check] = {
    "requireApproval": _APPROVALS,
    "timeoutMs": _integer(1, MAX_TOOL_TIMEOUT_MS),
    "maxResultBytes": _positive,
}


def _unprefixed_approvals(value: dict[str, Any], field: str) -> None:
    """`requireApproval` names a source's tools as the source knows them."""
    name = value.get("name")
    for index, tool in enumerate(value.get("requireApproval") or ()):
        if isinstance(name, str) and tool.startswith(f"{name}."):
            raise _refuse(
                f"{field}.requireApproval[{index}]",
                f"names tools without the source's prefix: {tool[len(name) + 1 :]!r}, not {tool!r}",
            )


def _mcp_source(value: dict[str, Any], field: str) -> None:
    transport = value.get("transport")
    if transport is None:
        raise _refuse(f"{field}.transport", "is required (stdio or http)")
    _one_of(MCP_TRANSPORTS)(transport, f"{field}.transport")
    common: dict[str, Check] = {
        "source": _string,
        "name": _tool_source_name,
        "transport": _string,
        **_SOURCE_LIMITS,
    }
    if transport == "stdio":
        fields = {
            **common,
            "command": _list_of(_non_empty_string, non_empty=True),
            # The child's variable -> the runner's variable whose value it gets.
            "env": _map_of(_env_name, _env_name),
        }
        required: tuple[str, ...] = ("name", "command")
    else:
        fields = {**common, "url": _http_url, "headersEnv": _map_of(_header_name, _env_name)}
        required = ("name", "url")
    for name in value:
        if name not in fields and name in ("command", "env", "url", "headersEnv"):
            raise _refuse(f"{field}.{name}", f"does not apply to the {transport} transport")
    _object(value, field, fields, required)
    _unprefixed_approvals(value, field)


def _grpc_source(value: dict[str, Any], field: str) -> None:
    _object(
        value,
        field,
        {
            "source": _string,
            "name": _tool_source_name,
            "target": _target,
            **_SOURCE_LIMITS,
        },
        required=("name", "target"),
    )
    _unprefixed_approvals(value, field)


def _builtin_source(value: dict[str, Any], field: str) -> None:
    _object(
        value,
        field,
        {"source": _string, "names": _list_of(_builtin_name), **_SOURCE_LIMITS},
        ("names",),
    )
    for index, name in enumerate(value.get("requireApproval") or ()):
        if name not in value["names"]:
            raise _refuse(
                f"{field}.requireApproval[{index}]",
                f"{_shown(name)} is not one of this item's names",
            )


def _tool(value: Any, field: str) -> None:
    # A plain string is a built-in's name (documents older than tool sources).
    if isinstance(value, str):
        _builtin_name(value, field)
        return
    if not isinstance(value, dict):
        raise _refuse(field, f"must be a tool source object or a built-in name, got {_kind(value)}")
    source = value.get("source")
    if source is None:
        raise _refuse(f"{field}.source", "is required (builtin, mcp or grpc)")
    if source == "builtin":
        _builtin_source(value, field)
    elif source == "mcp":
        _mcp_source(value, field)
    elif source == "grpc":
        _grpc_source(value, field)
    else:
        raise _refuse(f"{field}.source", f"must be builtin, mcp or grpc, got {_shown(source)}")


def _tools(value: Any, field: str) -> None:
    """Every item, then the names the model will see: no two sources of one
    name, no built-in enabled twice."""
    _list_of(_tool)(value, field)
    sources: dict[str, int] = {}
    builtins: dict[str, int] = {}
    for index, item in enumerate(value):
        path = f"{field}[{index}]"
        if isinstance(item, str):
            named: list[tuple[str, str]] = [(item, path)]
        elif item.get("source") == "builtin":
            named = [(n, f"{path}.names[{i}]") for i, n in enumerate(item["names"])]
        else:
            named = []
            name = item["name"]
            if name in sources:
                raise _refuse(
                    f"{path}.name",
                    f"{_shown(name)} is already the name of {field}[{sources[name]}]",
                )
            sources[name] = index
        for builtin, where in named:
            if builtin in builtins:
                raise _refuse(
                    where,
                    f"the built-in {builtin} is already enabled by {field}[{builtins[builtin]}]",
                )
            builtins[builtin] = index


_TOP_LEVEL: dict[str, Check] = {
    "systemPrompt": _string,
    "model": _model,
    "compaction": _compaction,
    "admission": _admission,
    "tools": _tools,
    # Older documents set the admission limit at the top level.
    "maxConcurrentRuns": _positive,
}


def validate_loadout(document: Any) -> dict[str, Any]:
    """The document if the schema accepts it; else `InvalidLoadout` naming the field."""
    if not isinstance(document, dict):
        raise InvalidLoadout(
            f"a loadout must be a JSON object, got {_kind(document)}", field="document"
        )
    _object(document, "", _TOP_LEVEL)
    top = document.get("maxConcurrentRuns")
    admission = document.get("admission") or {}
    nested = admission.get("maxConcurrentRuns")
    if top is not None and nested is not None and top != nested:
        raise _refuse(
            "admission.maxConcurrentRuns",
            f"differs from the top-level maxConcurrentRuns ({top}); set only one",
        )
    return document

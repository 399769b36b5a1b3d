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

The generic field checks the schema is composed of (strings, bounded
integers, lists, objects refusing unknown fields) are kernel/loadout_fields.py.

`null` counts as absent for optional fields, as the runner's and the
compaction service's readers of the same fields treat it; the shapes here are
exactly what those readers accept (see provider_from_loadout and
compaction.policy.trigger.settings_from_dict), so a document accepted here
never fails later when an attempt builds its provider or its settings.
"""

from __future__ import annotations

import re
from typing import Any

from kernel.errors import InvalidLoadout
from kernel.loadout_fields import (
    Check,
    boolean,
    grpc_target,
    header_name,
    http_url,
    integer,
    kind_of,
    list_of,
    map_of,
    non_empty_string,
    non_negative,
    object_of,
    one_of,
    positive,
    refuse,
    shown,
    string,
    threshold,
)
from services.ledger.facts import MULTITASK_MODES

PROVIDERS = ("openai", "anthropic", "scripted")
# The runner's built-in tools (agent_io.tools.builtin_tools).
BUILTIN_TOOLS = ("clock", "sleep", "counter")
MCP_TRANSPORTS = ("stdio", "http")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_RESERVED_ENV_PREFIX = "KEEL_"
# No dot: the dot separates a source's name from its tools' names.
_TOOL_SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,31}")
# The longest per-call tool timeout a loadout may set: an hour.
MAX_TOOL_TIMEOUT_MS = 3_600_000


# -- leaves --


def _env_name(value: Any, field: str) -> None:
    """The name of a runner environment variable that holds a secret."""
    string(value, field)
    if not _ENV_NAME.fullmatch(value):
        raise refuse(
            field,
            "must name an environment variable (capitals, digits and '_', e.g. "
            f"OPENAI_API_KEY), got {shown(value)}; a loadout never holds the secret itself",
        )
    if value.startswith(_RESERVED_ENV_PREFIX):
        raise refuse(field, f"{value} is Keel's own configuration, not a variable for a loadout")


def _tool_source_name(value: Any, field: str) -> None:
    string(value, field)
    if not _TOOL_SOURCE_NAME.fullmatch(value):
        raise refuse(
            field,
            "must be 1-32 letters, digits, '_' or '-', starting with a letter or digit "
            f"(no '.': tools are named <source>.<tool>); got {shown(value)}",
        )
    if value in BUILTIN_TOOLS:
        raise refuse(field, f"{value} is the name of a built-in tool; choose another name")


def _builtin_name(value: Any, field: str) -> None:
    string(value, field)
    if value not in BUILTIN_TOOLS:
        raise refuse(
            field, f"no built-in tool {shown(value)}; built-ins are {', '.join(BUILTIN_TOOLS)}"
        )


# -- objects --


def _thinking(value: Any, field: str) -> None:
    """Anthropic's thinking config, passed to the API as written."""
    object_of(
        value,
        field,
        {"type": non_empty_string, "budget_tokens": positive, "display": string},
        required=("type",),
    )


_PROVIDER_FIELDS: dict[str, dict[str, Check]] = {
    "scripted": {"tokenDelayMs": non_negative},
    "openai": {"baseUrl": http_url, "apiKeyEnv": _env_name},
    "anthropic": {
        "baseUrl": http_url,
        "apiKeyEnv": _env_name,
        "thinking": _thinking,
    },
}
_COMMON_MODEL_FIELDS: dict[str, Check] = {
    "provider": one_of(PROVIDERS),
    "name": string,
    "contextWindow": positive,
    "maxOutputTokens": positive,
}


def _model(value: Any, field: str) -> None:
    if not isinstance(value, dict):
        raise refuse(field, f"must be an object, got {kind_of(value)}")
    provider = value.get("provider")
    if "provider" in value:
        # Unlike other fields, an explicit null is refused: the provider
        # factory reads only a missing provider as the scripted model.
        one_of(PROVIDERS)(provider, f"{field}.provider")
    kind = provider or "scripted"
    fields = {**_COMMON_MODEL_FIELDS, **_PROVIDER_FIELDS[kind]}
    for name in value:
        if name not in fields and any(name in extra for extra in _PROVIDER_FIELDS.values()):
            raise refuse(f"{field}.{name}", f"does not apply to the {kind} model")
    object_of(value, field, fields)
    if kind != "scripted":
        # The provider cannot be built without one (provider_from_loadout).
        name = value.get("name")
        if name is None or not name.strip():
            raise refuse(f"{field}.name", f"a {kind} model needs a name")


def _compaction(value: Any, field: str) -> None:
    object_of(
        value,
        field,
        {
            "enabled": boolean,
            "threshold": threshold,
            "keepRecentTokens": non_negative,
            "reserveTokens": non_negative,
        },
    )


def _admission(value: Any, field: str) -> None:
    object_of(value, field, {"maxConcurrentRuns": positive})


_APPROVALS = list_of(non_empty_string)
# What every source may set, whatever its kind.
_SOURCE_LIMITS: dict[str, Check] = {
    "requireApproval": _APPROVALS,
    "timeoutMs": integer(1, MAX_TOOL_TIMEOUT_MS),
    "maxResultBytes": positive,
}


def _unprefixed_approvals(value: dict[str, Any], field: str) -> None:
    """`requireApproval` names a source's tools as the source knows them."""
    name = value.get("name")
    for index, tool in enumerate(value.get("requireApproval") or ()):
        if isinstance(name, str) and tool.startswith(f"{name}."):
            raise refuse(
                f"{field}.requireApproval[{index}]",
                f"names tools without the source's prefix: {tool[len(name) + 1 :]!r}, not {tool!r}",
            )


def _mcp_source(value: dict[str, Any], field: str) -> None:
    transport = value.get("transport")
    if transport is None:
        raise refuse(f"{field}.transport", "is required (stdio or http)")
    one_of(MCP_TRANSPORTS)(transport, f"{field}.transport")
    common: dict[str, Check] = {
        "source": string,
        "name": _tool_source_name,
        "transport": string,
        **_SOURCE_LIMITS,
    }
    if transport == "stdio":
        fields = {
            **common,
            "command": list_of(non_empty_string, non_empty=True),
            # The child's variable -> the runner's variable whose value it gets.
            "env": map_of(_env_name, _env_name),
        }
        required: tuple[str, ...] = ("name", "command")
    else:
        fields = {**common, "url": http_url, "headersEnv": map_of(header_name, _env_name)}
        required = ("name", "url")
    for name in value:
        if name not in fields and name in ("command", "env", "url", "headersEnv"):
            raise refuse(f"{field}.{name}", f"does not apply to the {transport} transport")
    object_of(value, field, fields, required)
    _unprefixed_approvals(value, field)


def _grpc_source(value: dict[str, Any], field: str) -> None:
    object_of(
        value,
        field,
        {
            "source": string,
            "name": _tool_source_name,
            "target": grpc_target,
            **_SOURCE_LIMITS,
        },
        required=("name", "target"),
    )
    _unprefixed_approvals(value, field)


def _builtin_source(value: dict[str, Any], field: str) -> None:
    object_of(
        value,
        field,
        {"source": string, "names": list_of(_builtin_name), **_SOURCE_LIMITS},
        ("names",),
    )
    for index, name in enumerate(value.get("requireApproval") or ()):
        if name not in value["names"]:
            raise refuse(
                f"{field}.requireApproval[{index}]",
                f"{shown(name)} is not one of this item's names",
            )


def _tool(value: Any, field: str) -> None:
    # A plain string is a built-in's name (documents older than tool sources).
    if isinstance(value, str):
        _builtin_name(value, field)
        return
    if not isinstance(value, dict):
        raise refuse(
            field, f"must be a tool source object or a built-in name, got {kind_of(value)}"
        )
    source = value.get("source")
    if source is None:
        raise refuse(f"{field}.source", "is required (builtin, mcp or grpc)")
    if source == "builtin":
        _builtin_source(value, field)
    elif source == "mcp":
        _mcp_source(value, field)
    elif source == "grpc":
        _grpc_source(value, field)
    else:
        raise refuse(f"{field}.source", f"must be builtin, mcp or grpc, got {shown(source)}")


def _tools(value: Any, field: str) -> None:
    """Every item, then the names the model will see: no two sources of one
    name, no built-in enabled twice."""
    list_of(_tool)(value, field)
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
                raise refuse(
                    f"{path}.name",
                    f"{shown(name)} is already the name of {field}[{sources[name]}]",
                )
            sources[name] = index
        for builtin, where in named:
            if builtin in builtins:
                raise refuse(
                    where,
                    f"the built-in {builtin} is already enabled by {field}[{builtins[builtin]}]",
                )
            builtins[builtin] = index


_TOP_LEVEL: dict[str, Check] = {
    "systemPrompt": string,
    "model": _model,
    "compaction": _compaction,
    "admission": _admission,
    "tools": _tools,
    # Older documents set the admission limit at the top level.
    "maxConcurrentRuns": positive,
    # The tenant's double-texting strategy for inputs that name none.
    "multitask": one_of(MULTITASK_MODES),
}


def validate_loadout(document: Any) -> dict[str, Any]:
    """The document if the schema accepts it; else `InvalidLoadout` naming the field."""
    if not isinstance(document, dict):
        raise InvalidLoadout(
            f"a loadout must be a JSON object, got {kind_of(document)}", field="document"
        )
    object_of(document, "", _TOP_LEVEL)
    top = document.get("maxConcurrentRuns")
    admission = document.get("admission") or {}
    nested = admission.get("maxConcurrentRuns")
    if top is not None and nested is not None and top != nested:
        raise refuse(
            "admission.maxConcurrentRuns",
            f"differs from the top-level maxConcurrentRuns ({top}); set only one",
        )
    return document

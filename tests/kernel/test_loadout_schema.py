"""The loadout schema (SPEC §10): what it accepts, and that every refusal
names the field; and that what it accepts the runner and the compaction
service can really use."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_io.loadout import BUILTIN_SOURCE, Loadout, ToolSourceItem
from agent_io.providers import provider_from_loadout
from agent_io.tools import CounterStore, builtin_tools
from agent_io.tools.factory import SourceFactory
from compaction.policy.trigger import settings_from_dict
from kernel import DEFAULT_LOADOUT, InvalidArgument, InvalidLoadout, validate_loadout
from kernel.loadout import BUILTIN_TOOLS
from kernel.loadout_secrets import check_loadout_secrets
from kernel.tenancy import parse_document
from services.common.secrets import SecretPolicy

# What an operator allows the tenant these documents are written for: the
# schema is the same for everyone, the policy is this tenant's.
TENANT = "acme"
POLICY = (
    SecretPolicy()
    .with_grant(TENANT, "OPENAI_API_KEY")
    .with_grant(TENANT, "ANTHROPIC_API_KEY")
    .with_origin("http://127.0.0.1:9999")
    .with_origin("http://127.0.0.1:1")
    .with_grant(TENANT, "FILES_TOKEN")
    .with_grant(TENANT, "SEARCH_TOKEN")
    .with_command(["python", "-m", "my_mcp_server"])
    .with_tool_target("http://search.internal")
    .with_tool_target("billing.internal:7000")
)

FULL: dict[str, Any] = {
    "systemPrompt": "You are terse.",
    "model": {
        "provider": "openai",
        "name": "gpt-4.1-mini",
        "baseUrl": "http://127.0.0.1:9999/v1",
        "apiKeyEnv": "OPENAI_API_KEY",
        "contextWindow": 128000,
        "maxOutputTokens": 4096,
    },
    "compaction": {
        "enabled": True,
        "threshold": 0.8,
        "keepRecentTokens": 20000,
        "reserveTokens": 16384,
    },
    "admission": {"maxConcurrentRuns": 8},
    "tools": [{"source": "builtin", "names": ["clock", "counter"]}, "sleep"],
}


def refused(document: Any) -> InvalidLoadout:
    with pytest.raises(InvalidLoadout) as caught:
        validate_loadout(document)
    return caught.value


def with_(path: str, value: Any, base: dict[str, Any] = FULL) -> dict[str, Any]:
    """A copy of `base` with the value at a dotted path set (or removed for ...)."""
    document = copy.deepcopy(base)
    *parents, last = path.split(".")
    target: Any = document
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if value is ...:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return document


def test_a_full_document_is_accepted_as_written() -> None:
    assert validate_loadout(copy.deepcopy(FULL)) == FULL
    assert validate_loadout({}) == {}
    assert validate_loadout(copy.deepcopy(DEFAULT_LOADOUT)) == DEFAULT_LOADOUT


def test_every_model_provider_with_its_own_fields_is_accepted() -> None:
    scripted = {"provider": "scripted", "name": "s", "contextWindow": 4096, "tokenDelayMs": 0}
    anthropic = {
        "provider": "anthropic",
        "name": "claude-sonnet-4-5",
        "apiKeyEnv": "ANTHROPIC_API_KEY",
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    for model in (scripted, anthropic, {"name": "no provider means scripted"}):
        assert validate_loadout({"model": model})["model"] == model


@pytest.mark.parametrize(
    ("document", "field"),
    [
        # unknown fields, at every level
        (with_("systemPromt", "typo"), "systemPromt"),
        (with_("model.apiKey", "sk-secret"), "model.apiKey"),
        (with_("compaction.ratio", 0.5), "compaction.ratio"),
        (with_("admission.maxRuns", 3), "admission.maxRuns"),
        (with_("tools.0.extra", True), "tools[0].extra"),
        # wrong types
        (with_("systemPrompt", 42), "systemPrompt"),
        (with_("model", "gpt"), "model"),
        (with_("model.contextWindow", "128k"), "model.contextWindow"),
        (with_("model.maxOutputTokens", True), "model.maxOutputTokens"),
        (with_("compaction.enabled", "yes"), "compaction.enabled"),
        (with_("compaction.threshold", "high"), "compaction.threshold"),
        (with_("tools", {"source": "builtin"}), "tools"),
        (with_("tools.1", 7), "tools[1]"),
        (with_("tools.0.names", "clock"), "tools[0].names"),
        # values out of range
        (with_("model.provider", "gemini"), "model.provider"),
        (with_("model.provider", None), "model.provider"),
        (with_("model.contextWindow", 0), "model.contextWindow"),
        (with_("compaction.threshold", -0.5), "compaction.threshold"),
        (with_("compaction.threshold", float("nan")), "compaction.threshold"),
        (with_("compaction.keepRecentTokens", -1), "compaction.keepRecentTokens"),
        (with_("admission.maxConcurrentRuns", 0), "admission.maxConcurrentRuns"),
        (with_("maxConcurrentRuns", 2**40), "maxConcurrentRuns"),
        (with_("maxConcurrentRuns", 3), "admission.maxConcurrentRuns"),
        (with_("model.baseUrl", "ftp://host/v1"), "model.baseUrl"),
        (with_("model.baseUrl", "not a url"), "model.baseUrl"),
        (with_("model.name", ...), "model.name"),
        (with_("tools.0.names.1", "rm_rf"), "tools[0].names[1]"),
        (with_("tools.1", "shell"), "tools[1]"),
        (with_("tools.0.source", "plugin"), "tools[0].source"),
        (with_("tools.0.source", ...), "tools[0].source"),
        # fields of another provider
        (with_("model.tokenDelayMs", 5), "model.tokenDelayMs"),
        (with_("model.thinking", {"type": "enabled"}), "model.thinking"),
    ],
)
def test_a_refusal_names_the_field(document: dict[str, Any], field: str) -> None:
    error = refused(document)
    assert error.metadata["field"] == field
    assert error.reason == "INVALID_LOADOUT"
    assert isinstance(error, InvalidArgument)
    assert field in error.message


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("sk-live-abcdef", "must name an environment variable"),
        ("openai_api_key", "must name an environment variable"),
        ("1KEY", "must name an environment variable"),
        ("KEEL_INTERNAL_TOKEN", "Keel's own configuration"),
    ],
)
def test_secrets_are_named_by_environment_variable_only(name: str, why: str) -> None:
    error = refused(with_("model.apiKeyEnv", name))
    assert error.metadata["field"] == "model.apiKeyEnv" and why in error.message
    http = {
        "source": "mcp",
        "name": "search",
        "transport": "http",
        "url": "https://search.internal/mcp",
        "headersEnv": {"Authorization": name},
    }
    error = refused({"tools": [http]})
    assert error.metadata["field"] == "tools[0].headersEnv.Authorization"


MCP_STDIO = {
    "source": "mcp",
    "name": "files",
    "transport": "stdio",
    "command": ["python", "-m", "my_mcp_server"],
    "env": {"FILES_TOKEN": "FILES_TOKEN"},
    "requireApproval": ["delete_file"],
}
MCP_HTTP = {
    "source": "mcp",
    "name": "search",
    "transport": "http",
    "url": "http://search.internal/mcp",
    "headersEnv": {"Authorization": "SEARCH_TOKEN"},
}
GRPC = {"source": "grpc", "name": "billing", "target": "billing.internal:7000"}


def test_mcp_and_grpc_sources_are_accepted_with_their_limits() -> None:
    limits = {"timeoutMs": 3_600_000, "maxResultBytes": 1, "requireApproval": ["charge"]}
    document = {
        "tools": [
            {"source": "builtin", "names": ["counter"], "requireApproval": ["counter"]},
            "clock",
            MCP_STDIO,
            MCP_HTTP,
            {**GRPC, **limits},
            {**GRPC, "name": "billing-2_B", "target": "grpcs://billing.internal:7000"},
        ]
    }
    assert validate_loadout(copy.deepcopy(document)) == document
    check_loadout_secrets(document, TENANT, POLICY)
    sources = Loadout.from_document(4, document).tool_sources
    assert [(s.source, s.name) for s in sources] == [
        ("builtin", BUILTIN_SOURCE),
        ("builtin", BUILTIN_SOURCE),
        ("mcp", "files"),
        ("mcp", "search"),
        ("grpc", "billing"),
        ("grpc", "billing-2_B"),
    ]
    assert sources[0].require_approval == {"counter"}
    assert sources[2].command == ("python", "-m", "my_mcp_server")
    assert sources[2].env == {"FILES_TOKEN": "FILES_TOKEN"}
    assert sources[3].headers_env == {"Authorization": "SEARCH_TOKEN"}
    assert (sources[4].timeout_ms, sources[4].max_result_bytes) == (3_600_000, 1)
    assert sources[4].require_approval == {"charge"}


@pytest.mark.parametrize(
    ("source", "field"),
    [
        ({**MCP_STDIO, "transport": "websocket"}, "tools[0].transport"),
        ({k: v for k, v in MCP_STDIO.items() if k != "transport"}, "tools[0].transport"),
        ({k: v for k, v in MCP_STDIO.items() if k != "command"}, "tools[0].command"),
        ({**MCP_STDIO, "command": []}, "tools[0].command"),
        ({**MCP_STDIO, "env": {"TOKEN": "abc123-secret"}}, "tools[0].env.TOKEN"),
        ({**MCP_STDIO, "url": "http://x/mcp"}, "tools[0].url"),
        ({**MCP_HTTP, "url": "file:///etc/passwd"}, "tools[0].url"),
        ({**MCP_HTTP, "headers": {"Authorization": "Bearer abc"}}, "tools[0].headers"),
        ({**MCP_HTTP, "command": ["x"]}, "tools[0].command"),
        ({**MCP_HTTP, "requireApproval": "deploy"}, "tools[0].requireApproval"),
        ({**MCP_HTTP, "name": ""}, "tools[0].name"),
        ({k: v for k, v in GRPC.items() if k != "target"}, "tools[0].target"),
        ({**GRPC, "target": "has space:1"}, "tools[0].target"),
        ({**GRPC, "transport": "stdio"}, "tools[0].transport"),
        # names: no dot (it separates source and tool), not a built-in's
        ({**GRPC, "name": "bill.ing"}, "tools[0].name"),
        ({**GRPC, "name": "-billing"}, "tools[0].name"),
        ({**GRPC, "name": "b" * 33}, "tools[0].name"),
        ({**MCP_STDIO, "name": "counter"}, "tools[0].name"),
        # limits, on every kind of source
        ({**GRPC, "timeoutMs": 0}, "tools[0].timeoutMs"),
        ({**GRPC, "timeoutMs": 3_600_001}, "tools[0].timeoutMs"),
        ({**MCP_HTTP, "timeoutMs": 1.5}, "tools[0].timeoutMs"),
        ({**MCP_STDIO, "maxResultBytes": 0}, "tools[0].maxResultBytes"),
        ({**GRPC, "maxResultBytes": "64k"}, "tools[0].maxResultBytes"),
        ({"source": "builtin", "names": ["clock"], "timeoutMs": -1}, "tools[0].timeoutMs"),
        # approvals name a source's own tools
        ({**GRPC, "requireApproval": ["billing.charge"]}, "tools[0].requireApproval[0]"),
        ({**MCP_STDIO, "requireApproval": [""]}, "tools[0].requireApproval[0]"),
        (
            {"source": "builtin", "names": ["clock"], "requireApproval": ["counter"]},
            "tools[0].requireApproval[0]",
        ),
    ],
)
def test_mcp_and_grpc_sources_are_checked_in_full(source: dict[str, Any], field: str) -> None:
    assert refused({"tools": [source]}).metadata["field"] == field


@pytest.mark.parametrize(
    ("tools", "field", "says"),
    [
        ([GRPC, {**MCP_HTTP, "name": "billing"}], "tools[1].name", "already the name of tools[0]"),
        (["clock", MCP_STDIO, MCP_STDIO], "tools[2].name", "already the name of tools[1]"),
        (["clock", {"source": "builtin", "names": ["clock"]}], "tools[1].names[0]", "clock"),
        (["sleep", "sleep"], "tools[1]", "already enabled by tools[0]"),
        ([{**GRPC, "name": "clock"}], "tools[0].name", "built-in tool"),
    ],
)
def test_names_the_model_would_see_twice_are_refused(
    tools: list[Any], field: str, says: str
) -> None:
    error = refused({"tools": tools})
    assert error.metadata["field"] == field and says in error.message


def test_the_document_itself_must_be_an_object() -> None:
    assert refused(["model"]).metadata["field"] == "document"
    with pytest.raises(InvalidArgument) as caught:
        parse_document("[" * 100_000)
    assert caught.value.metadata["field"] == "document"
    assert refused_text('{"tools": ["clock", "nope"]}').metadata["field"] == "tools[1]"


def refused_text(text: str) -> InvalidLoadout:
    with pytest.raises(InvalidLoadout) as caught:
        parse_document(text)
    return caught.value


def test_the_schema_knows_exactly_the_runners_builtin_tools(tmp_path: Path) -> None:
    assert set(BUILTIN_TOOLS) == set(builtin_tools(CounterStore(tmp_path / "counters.sqlite3")))


def test_the_runner_reads_tools_of_both_shapes() -> None:
    loadout = Loadout.from_document(3, FULL)
    assert loadout.tool_sources == (
        ToolSourceItem.builtins(("clock", "counter")),
        ToolSourceItem.builtins(("sleep",)),
    )
    assert Loadout.from_document(1, {"tools": []}).tool_sources == ()
    assert Loadout.from_document(1, {}).tool_sources == (
        ToolSourceItem.builtins(("clock", "sleep", "counter")),
    )


@pytest.mark.parametrize(
    "model",
    [
        FULL["model"],
        {
            "provider": "anthropic",
            "name": "claude",
            "baseUrl": "http://127.0.0.1:1/",
            "thinking": {"type": "adaptive"},
        },
        {"provider": "scripted", "tokenDelayMs": 3, "contextWindow": 500, "maxOutputTokens": 10},
        {"name": None, "contextWindow": None},
    ],
)
def test_an_accepted_model_builds_its_provider(model: dict[str, Any]) -> None:
    validate_loadout({"model": model})
    check_loadout_secrets({"model": model}, TENANT, POLICY)
    provider = provider_from_loadout(model, tenant_id=TENANT, secrets=POLICY, env={})
    assert provider.model


# -- any JSON at all --

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
# Known field names, so random documents often get past the first level.
names = st.sampled_from(
    [
        "systemPrompt",
        "model",
        "compaction",
        "admission",
        "tools",
        "maxConcurrentRuns",
        "provider",
        "name",
        "baseUrl",
        "apiKeyEnv",
        "contextWindow",
        "maxOutputTokens",
        "tokenDelayMs",
        "thinking",
        "type",
        "budget_tokens",
        "enabled",
        "threshold",
        "keepRecentTokens",
        "reserveTokens",
        "source",
        "names",
        "transport",
        "command",
        "env",
        "url",
        "headersEnv",
        "target",
        "requireApproval",
        "timeoutMs",
        "maxResultBytes",
    ]
)
shaped = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 2**32)
    | st.floats(-2, 2)
    | st.sampled_from(
        [
            "openai",
            "anthropic",
            "scripted",
            "builtin",
            "mcp",
            "grpc",
            "stdio",
            "http",
            "clock",
            "OPENAI_API_KEY",
            "KEEL_X",
            "http://h/v1",
            "h:1",
            "",
        ]
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=5),
    max_leaves=25,
)


def _accepted_or_refused(document: Any) -> None:
    try:
        accepted = validate_loadout(document)
    except InvalidLoadout as error:
        assert error.metadata.get("field")
        return
    # What the schema accepts, the runner and the compaction service can use.
    loadout = Loadout.from_document(1, accepted)
    settings_from_dict(loadout.compaction)
    slots = SourceFactory({}, POLICY, {}).slots(TENANT, loadout)
    assert [slot.name for slot in slots] == [item.name for item in loadout.tool_sources]
    model = dict(loadout.model)
    if model.get("provider", "scripted") != "scripted":
        model["baseUrl"] = "http://127.0.0.1:1/v1"  # so no API key is needed
    # ... and what the operator's policy accepts too.
    try:
        check_loadout_secrets({**accepted, "model": model}, TENANT, POLICY)
    except InvalidLoadout as error:
        assert error.metadata.get("field")
        return
    provider_from_loadout(model, tenant_id=TENANT, secrets=POLICY, env={})


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=12), json_values, max_size=6))
def test_any_json_object_is_accepted_or_refused_with_a_field(document: dict[str, Any]) -> None:
    _accepted_or_refused(document)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(names, shaped, max_size=6))
def test_any_loadout_shaped_object_is_accepted_or_refused_with_a_field(
    document: dict[str, Any],
) -> None:
    # Through JSON, as the kernel receives it.
    _accepted_or_refused(json.loads(json.dumps(document)))

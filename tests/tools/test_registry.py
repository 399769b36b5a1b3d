"""The registry of one tenant's loadout revision, and the catalog that keeps
one per tenant and revision.

The sources here are small ToolSources defined in this file (they count what
is asked of them), beside the real built-ins; the real MCP and gRPC sources
are exercised in test_tool_policy.py and tests/runner/test_tool_sessions.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from agent_io.loadout import DEFAULT_BUILTINS, Loadout
from agent_io.tools import (
    BUILTIN_NAMES,
    BuiltinSource,
    CounterStore,
    SourceRefused,
    SourceSettings,
    SourceSlot,
    ToolCall,
    ToolCatalog,
    ToolOutcome,
    ToolRegistry,
    ToolSource,
    ToolSpec,
    builtin_tools,
    idempotency_key,
)
from agent_io.tools.factory import ToolDefaults, settings_of
from tests.support.polling import eventually

Behaviour = Callable[[ToolCall, float], Awaitable[ToolOutcome]]
OBJECT = {"type": "object"}


async def echo(call: ToolCall, timeout_s: float) -> ToolOutcome:
    return ToolOutcome(json.dumps({"name": call.name, "arguments": dict(call.arguments)}))


class CountingSource:
    """A ToolSource that records every list, call and close."""

    def __init__(
        self,
        name: str,
        tools: Mapping[str, Behaviour] | None = None,
        schemas: Mapping[str, Mapping[str, Any]] | None = None,
        listing_error: Exception | None = None,
    ) -> None:
        self._name = name
        self._tools = dict(tools or {"read": echo, "echo": echo})
        self._schemas = dict(schemas or {})
        self._listing_error = listing_error
        self.lists = 0
        self.calls: list[tuple[ToolCall, float]] = []
        self.closed = False

    @property
    def name(self) -> str:
        return self._name

    async def list_tools(self) -> Sequence[ToolSpec]:
        self.lists += 1
        if self._listing_error is not None:
            raise self._listing_error
        return [
            ToolSpec(tool, f"{tool} of {self._name}", self._schemas.get(tool, OBJECT))
            for tool in self._tools
        ]

    async def call(self, call: ToolCall, timeout_s: float) -> ToolOutcome:
        self.calls.append((call, timeout_s))
        return await self._tools[call.name](call, timeout_s)

    async def aclose(self) -> None:
        self.closed = True


def call(name: str, arguments: Mapping[str, Any] | None = None, call_id: str = "c1") -> ToolCall:
    key = idempotency_key("acme", "s1", call_id)
    return ToolCall(call_id, name, arguments or {}, key, session_id="s1", tenant_id="acme")


def slot(
    source: ToolSource, settings: SourceSettings | None = None, *, prefixed: bool = True
) -> SourceSlot:
    return SourceSlot(source.name, lambda: source, settings or SourceSettings(), prefixed=prefixed)


@pytest.fixture
def builtins(tmp_path: Path) -> BuiltinSource:
    return BuiltinSource(builtin_tools(CounterStore(tmp_path / "counter.sqlite3")), BUILTIN_NAMES)


def test_a_loadout_without_tools_gets_exactly_the_builtins(tmp_path: Path) -> None:
    tools = builtin_tools(CounterStore(tmp_path / "counter.sqlite3"))
    assert tuple(tools) == BUILTIN_NAMES == DEFAULT_BUILTINS


# -- naming and routing --


async def test_tools_of_a_source_are_named_by_it_and_routed_back(builtins: BuiltinSource) -> None:
    files = CountingSource("files")
    registry = ToolRegistry([slot(builtins, prefixed=False), slot(files)])
    await registry.prepare()
    assert [spec.name for spec in registry.specs] == [
        "clock",
        "sleep",
        "counter",
        "files.read",
        "files.echo",
    ]
    assert registry.specs[3].description == "read of files"

    outcome = await registry.run(call("files.read", {"path": "a.txt"}))
    assert not outcome.is_error
    assert json.loads(outcome.content) == {"name": "read", "arguments": {"path": "a.txt"}}
    sent, timeout_s = files.calls[0]
    # The source gets its own name for the tool, and the call's scoped key.
    assert sent.name == "read" and sent.tool_call_id == "c1"
    assert sent.idempotency_key == idempotency_key("acme", "s1", "c1")
    assert timeout_s == SourceSettings().timeout_s

    counted = await registry.run(call("counter", {"key": "k"}))
    assert json.loads(counted.content) == {"key": "k", "value": 1}


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("nope", "unknown tool 'nope'"),
        ("files.nope", "files has no tool 'nope'"),
        ("other.read", "unknown tool 'other.read'"),
        ("read", "unknown tool 'read'"),
        (".read", "unknown tool '.read'"),
    ],
)
async def test_an_unknown_tool_is_an_error_result(
    builtins: BuiltinSource, name: str, says: str
) -> None:
    files = CountingSource("files")
    registry = ToolRegistry([slot(builtins, prefixed=False), slot(files)])
    outcome = await registry.run(call(name))
    assert outcome.is_error and says in outcome.content
    assert files.calls == []


async def test_the_first_source_to_offer_a_name_keeps_it(tmp_path: Path) -> None:
    tools = builtin_tools(CounterStore(tmp_path / "counter.sqlite3"))
    first = BuiltinSource(tools, ["clock"])
    again = BuiltinSource(tools, ["clock", "sleep"])
    slow = SourceSettings(timeout_s=0.01)
    registry = ToolRegistry([slot(first, prefixed=False), slot(again, slow, prefixed=False)])
    await registry.prepare()
    assert [spec.name for spec in registry.specs] == ["clock", "sleep"]
    # `sleep` is the second item's, with its settings.
    outcome = await registry.run(call("sleep", {"seconds": 5}))
    assert outcome.is_error and "timed out after 0.01 s" in outcome.content


# -- what a call may do --


async def test_arguments_that_do_not_match_the_schema_are_refused_unrun(
    builtins: BuiltinSource, tmp_path: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer", "minimum": 1}},
        "required": ["path"],
        "additionalProperties": False,
    }
    files = CountingSource("files", schemas={"read": schema})
    registry = ToolRegistry([slot(builtins, prefixed=False), slot(files)])
    for arguments, problem in (
        ({}, "'path' is a required property"),
        ({"path": 7}, "7 is not of type 'string' (at path)"),
        ({"path": "a", "lines": 0}, "0 is less than the minimum of 1 (at lines)"),
        ({"path": "a", "mode": "w"}, "Additional properties are not allowed"),
    ):
        outcome = await registry.run(call("files.read", arguments))
        assert outcome.is_error, arguments
        assert "files.read was not run" in outcome.content and problem in outcome.content
    assert files.calls == []
    # The built-ins' schemas too: the counter is not touched.
    outcome = await registry.run(call("counter", {"key": 5}))
    assert outcome.is_error and "5 is not of type 'string'" in outcome.content
    assert CounterStore(tmp_path / "counter.sqlite3").executions("5") == 0
    assert not (await registry.run(call("files.read", {"path": "a", "lines": 2}))).is_error


async def test_a_tool_with_an_invalid_schema_is_offered_and_run_unchecked() -> None:
    files = CountingSource("files", schemas={"read": {"type": "no-such-type"}})
    registry = ToolRegistry([slot(files)])
    await registry.prepare()
    assert [spec.name for spec in registry.specs] == ["files.read", "files.echo"]
    assert not (await registry.run(call("files.read", {"x": 1}))).is_error


async def test_a_call_past_its_timeout_is_an_error_result() -> None:
    never = asyncio.Event()

    async def hangs(call: ToolCall, timeout_s: float) -> ToolOutcome:
        await never.wait()  # a source that ignores the timeout it was given
        raise AssertionError("unreachable")

    files = CountingSource("files", {"hang": hangs, "read": echo})
    registry = ToolRegistry([slot(files, SourceSettings(timeout_s=0.05))])
    outcome = await registry.run(call("files.hang"))
    assert outcome.is_error and outcome.content == "files.hang timed out after 0.05 s"
    assert files.calls[0][1] == 0.05
    # The session goes on: the next call works.
    assert not (await registry.run(call("files.read"))).is_error


async def test_a_result_over_the_limit_is_cut_with_a_note() -> None:
    async def big(call: ToolCall, timeout_s: float) -> ToolOutcome:
        return ToolOutcome("é" * 1000, structured={"size": 2000})

    files = CountingSource("files", {"big": big})
    registry = ToolRegistry([slot(files, SourceSettings(max_result_bytes=101))])
    outcome = await registry.run(call("files.big"))
    kept, note = outcome.content.split("\n")
    assert kept == "é" * 50  # never half a character
    assert note == "[result truncated: 2000 bytes, the limit is 101]"
    # Part of an answer is not the answer: the model is told it is an error.
    assert outcome.is_error and outcome.structured == {"size": 2000}


async def test_a_sources_exception_is_an_error_result() -> None:
    async def broken(call: ToolCall, timeout_s: float) -> ToolOutcome:
        raise RuntimeError("disk on fire")

    registry = ToolRegistry([slot(CountingSource("files", {"read": broken}))])
    outcome = await registry.run(call("files.read"))
    assert outcome.is_error and outcome.content == "files.read failed: disk on fire"


async def test_cancellation_still_propagates() -> None:
    started = asyncio.Event()

    async def waits(call: ToolCall, timeout_s: float) -> ToolOutcome:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    registry = ToolRegistry([slot(CountingSource("files", {"wait": waits}))])
    running = asyncio.create_task(registry.run(call("files.wait")))
    await started.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


# -- sources that fail --


async def test_a_source_whose_listing_fails_has_no_tools_and_says_why(
    builtins: BuiltinSource,
) -> None:
    down = CountingSource("search", listing_error=ConnectionError("connection refused"))
    files = CountingSource("files")
    registry = ToolRegistry([slot(builtins, prefixed=False), slot(down), slot(files)])
    await registry.prepare()
    assert "search.read" not in [spec.name for spec in registry.specs]
    assert "files.read" in [spec.name for spec in registry.specs]
    outcome = await registry.run(call("search.read"))
    assert outcome.is_error
    assert outcome.content == (
        "tool source 'search' is unavailable: listing its tools failed: connection refused"
    )
    # Not listed again at once: a later attempt tries again.
    await registry.prepare()
    assert down.lists == 1
    assert not (await registry.run(call("files.read"))).is_error


async def test_a_source_the_policy_refuses_is_never_opened() -> None:
    def refused() -> ToolSource:
        raise SourceRefused("not allowed (operators allow it with KEEL_SOMETHING)")

    registry = ToolRegistry([SourceSlot("files", refused, SourceSettings())])
    await registry.prepare()
    assert registry.specs == ()
    outcome = await registry.run(call("files.read"))
    assert outcome.is_error and "KEEL_SOMETHING" in outcome.content


async def test_sources_open_only_when_tools_are_needed() -> None:
    opened: list[str] = []
    files = CountingSource("files")

    def opener() -> ToolSource:
        opened.append("files")
        return files

    registry = ToolRegistry([SourceSlot("files", opener, SourceSettings())])
    assert opened == [] and registry.specs == ()
    assert not registry.requires_approval("files.read")
    assert opened == []
    await registry.run(call("files.read"))
    await registry.prepare()
    assert opened == ["files"] and files.lists == 1


def test_approval_is_asked_by_each_sources_own_tool_names(builtins: BuiltinSource) -> None:
    files = CountingSource("files")
    registry = ToolRegistry(
        [
            slot(builtins, SourceSettings(require_approval=frozenset({"counter"})), prefixed=False),
            slot(files, SourceSettings(require_approval=frozenset({"read"}))),
        ]
    )
    assert registry.requires_approval("counter")
    assert registry.requires_approval("files.read")
    assert not registry.requires_approval("clock")
    assert not registry.requires_approval("files.echo")
    assert not registry.requires_approval("read")
    assert not registry.requires_approval("other.read")


def test_a_loadout_items_settings_and_the_runners_ceiling() -> None:
    document = {
        "tools": [
            {"source": "grpc", "name": "a", "target": "h:1", "timeoutMs": 1500},
            {"source": "grpc", "name": "b", "target": "h:1", "maxResultBytes": 10},
            {"source": "grpc", "name": "c", "target": "h:1", "maxResultBytes": 10**9},
        ]
    }
    items = Loadout.from_document(1, document).tool_sources
    defaults = ToolDefaults(timeout_s=60.0, max_result_bytes=1000)
    assert settings_of(items[0], defaults) == SourceSettings(1.5, 1000)
    assert settings_of(items[1], defaults) == SourceSettings(60.0, 10)
    # A source may lower the runner's limit, never raise it.
    assert settings_of(items[2], defaults) == SourceSettings(60.0, 1000)


# -- the catalog: one registry per tenant and revision --


class Sources:
    """Builds every source of a loadout as a new CountingSource, and keeps them."""

    def __init__(self) -> None:
        self.built: list[tuple[str, int, CountingSource]] = []

    def slots(self, tenant_id: str, loadout: Loadout) -> list[SourceSlot]:
        made: list[SourceSlot] = []
        for item in loadout.tool_sources:
            source = CountingSource(item.name)
            self.built.append((tenant_id, loadout.revision, source))
            made.append(slot(source))
        return made

    def of(self, tenant_id: str, revision: int) -> list[CountingSource]:
        return [s for t, r, s in self.built if (t, r) == (tenant_id, revision)]


def loadout(revision: int) -> Loadout:
    document = {"tools": [{"source": "grpc", "name": "files", "target": "files:1"}]}
    return Loadout.from_document(revision, document)


async def test_tools_are_listed_once_per_revision() -> None:
    sources = Sources()
    catalog = ToolCatalog(sources.slots)
    for _ in range(3):  # three attempts, one after the other
        async with catalog.registry("acme", loadout(1)) as registry:
            await registry.prepare()
            await registry.run(call("files.read"))
    async with (
        catalog.registry("acme", loadout(1)) as first,
        catalog.registry("acme", loadout(1)) as second,
    ):
        assert first is second
        await asyncio.gather(first.prepare(), second.prepare())
    assert [s.lists for s in sources.of("acme", 1)] == [1]
    # A new revision is a new source, listed once.
    async with catalog.registry("acme", loadout(2)) as registry:
        await registry.prepare()
    assert [s.lists for s in sources.of("acme", 2)] == [1]
    await catalog.aclose()


async def test_tenants_never_share_a_registry_or_a_source() -> None:
    sources = Sources()
    catalog = ToolCatalog(sources.slots)
    async with (
        catalog.registry("acme", loadout(1)) as acme,
        catalog.registry("globex", loadout(1)) as globex,
    ):
        assert acme is not globex
        await acme.run(call("files.read"))
        await globex.prepare()
    (acme_files,), (globex_files,) = sources.of("acme", 1), sources.of("globex", 1)
    assert acme_files is not globex_files
    assert len(acme_files.calls) == 1 and globex_files.calls == []
    assert acme_files.lists == globex_files.lists == 1
    # A tenant's newer revision retires nothing of another tenant.
    async with catalog.registry("acme", loadout(2)):
        pass
    await eventually(lambda: acme_files.closed, "acme's revision 1 to close")
    assert not globex_files.closed
    assert catalog.revisions("globex") == (1,)
    await catalog.aclose()


async def test_an_older_revision_closes_once_no_attempt_uses_it() -> None:
    sources = Sources()
    catalog = ToolCatalog(sources.slots)
    held = catalog.registry("acme", loadout(1))
    old = await held.__aenter__()
    await old.prepare()
    (old_files,) = sources.of("acme", 1)
    async with catalog.registry("acme", loadout(2)) as new:
        await new.prepare()
        # The attempt on revision 1 still runs: its source stays open.
        assert not old_files.closed
        assert not (await old.run(call("files.read"))).is_error
    await held.__aexit__(None, None, None)
    await eventually(lambda: old_files.closed, "revision 1 to close")
    assert catalog.revisions("acme") == (2,)
    (new_files,) = sources.of("acme", 2)
    assert not new_files.closed
    await catalog.aclose()
    assert new_files.closed


async def test_an_idle_older_revision_closes_when_a_newer_one_is_used() -> None:
    sources = Sources()
    catalog = ToolCatalog(sources.slots)
    async with catalog.registry("acme", loadout(1)) as registry:
        await registry.prepare()
    (old_files,) = sources.of("acme", 1)
    assert not old_files.closed  # kept for the next attempt on revision 1
    async with catalog.registry("acme", loadout(3)):
        await eventually(lambda: old_files.closed, "revision 1 to close")
    # A read that raced a write (an older revision after a newer one): served,
    # then closed when its attempt ends, and revision 3 stays.
    async with catalog.registry("acme", loadout(2)) as stale:
        await stale.prepare()
    (stale_files,) = sources.of("acme", 2)
    await eventually(lambda: stale_files.closed, "the stale revision to close")
    assert catalog.revisions("acme") == (3,)
    await catalog.aclose()


async def test_closing_the_catalog_closes_every_source_and_later_use_reopens() -> None:
    sources = Sources()
    catalog = ToolCatalog(sources.slots)
    for tenant in ("acme", "globex"):
        async with catalog.registry(tenant, loadout(1)) as registry:
            await registry.prepare()
    await catalog.aclose()
    assert all(source.closed for _, _, source in sources.built)
    assert catalog.revisions("acme") == ()
    async with catalog.registry("acme", loadout(1)) as registry:
        assert not (await registry.run(call("files.read"))).is_error
    assert len(sources.of("acme", 1)) == 2
    await catalog.aclose()


async def test_a_closed_registry_answers_with_an_error() -> None:
    files = CountingSource("files")
    registry = ToolRegistry([slot(files)])
    await registry.prepare()
    await registry.slots[0].aclose()
    outcome = await registry.run(call("files.read"))
    assert outcome.is_error and "closed" in outcome.content
    assert files.closed and files.calls == []


async def test_a_close_cut_short_by_a_cancel_is_waited_for_by_the_next() -> None:
    release = asyncio.Event()

    class SlowToClose(CountingSource):
        async def aclose(self) -> None:
            await release.wait()  # an MCP child taking its time to exit
            self.closed = True

    files = SlowToClose("files")
    catalog = ToolCatalog(lambda tenant, loadout: [slot(files)])
    async with catalog.registry("acme", loadout(1)) as registry:
        await registry.prepare()
    first = asyncio.create_task(catalog.aclose())
    await eventually(lambda: catalog.revisions("acme") == (), "the close to begin")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    second = asyncio.create_task(catalog.aclose())
    release.set()
    await second
    assert files.closed

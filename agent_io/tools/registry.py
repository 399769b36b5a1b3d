"""The tools of one tenant's loadout revision, as the model and the attempt see them.

A registry is a view over `SourceSlot`s: one per tool source of the loadout,
shared by every attempt that uses the same tenant and revision (see
agent_io.tools.catalog). A slot opens its source on first use and lists its
tools once; the registry names them for the model (`files.read` for the tool
`read` of the source `files`; built-ins unprefixed), routes a call back to
its source, and makes every failure a result:

- an unknown tool, or one of a source that could not be listed or that the
  operator's policy refused: an error outcome naming why (the session goes on);
- arguments that do not match the tool's JSON schema (checked with
  `jsonschema`): an error outcome naming the problem, and the tool is not run;
- the per-call timeout (`timeoutMs` of the source): an error outcome;
- a result over the size limit (`maxResultBytes`): cut, with a note;
- any exception of a source: an error outcome. Only cancellation propagates.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import jsonschema  # type: ignore[import-untyped]
from jsonschema.exceptions import best_match  # type: ignore[import-untyped]

from agent_io.tools.base import (
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_TOOL_TIMEOUT_S,
    ToolCall,
    ToolOutcome,
    ToolSource,
    ToolSpec,
    limit_result,
)

__all__ = ["SourceRefused", "SourceSettings", "SourceSlot", "ToolRegistry"]

log = logging.getLogger(__name__)

# A source enforces the call's timeout itself (and may clean up after it);
# the registry's own deadline, this much later, catches one that does not.
TIMEOUT_GRACE_S = 0.5
# Listing may start a server (an MCP child) and each source has its own
# connect and list timeouts; this bounds a source that has none. It is not
# the per-call `timeoutMs`: a source of quick calls may be slow to start.
LIST_DEADLINE_S = 60.0
# A source whose listing failed is tried again by a later attempt, but not
# sooner than this: an unreachable server must not slow every turn down.
LIST_RETRY_S = 30.0
_SHOWN_CHARS = 300


class SourceRefused(Exception):
    """The operator's policy does not allow this source (the message names
    the setting to change); it is never opened."""


@dataclass(frozen=True)
class SourceSettings:
    """What a loadout item sets for every tool of its source."""

    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    # Tools (their own names, no prefix) a person must approve first.
    require_approval: frozenset[str] = frozenset()


def _shorten(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…"


@dataclass(frozen=True)
class _Listed:
    """One tool of a listed source: its spec and its argument check."""

    spec: ToolSpec
    validator: Any  # a jsonschema validator, or None when there is nothing to check

    @classmethod
    def of(cls, spec: ToolSpec, source: str) -> _Listed:
        schema = spec.parameters
        if not isinstance(schema, Mapping) or not schema:
            return cls(spec, None)
        try:
            validator_class = jsonschema.validators.validator_for(
                schema, default=jsonschema.Draft202012Validator
            )
            validator_class.check_schema(schema)
        except jsonschema.SchemaError as error:
            # The source checks its own arguments; the model still sees it.
            log.warning("tool %s of %s has an invalid schema: %s", spec.name, source, error.message)
            return cls(spec, None)
        return cls(spec, validator_class(schema))

    def problem(self, arguments: Mapping[str, Any]) -> str | None:
        """Why `arguments` do not match the tool's schema; None when they do."""
        if self.validator is None:
            return None
        try:
            error = best_match(self.validator.iter_errors(dict(arguments)))
        except jsonschema.exceptions.JsonSchemaException as failure:
            return f"its schema cannot be checked: {failure}"
        if error is None:
            return None
        where = "/".join(str(part) for part in error.absolute_path)
        return _shorten(error.message + (f" (at {where})" if where else ""))


class SourceSlot:
    """One source of a tenant's loadout revision: opened on first use, its
    tools listed once, closed when the revision is no longer used.

    `opener` builds the source (and applies the operator's policy: it raises
    SourceRefused); it is called at most once, and never before a session
    needs tools.
    """

    def __init__(
        self,
        name: str,
        opener: Callable[[], ToolSource],
        settings: SourceSettings,
        *,
        prefixed: bool = True,
    ) -> None:
        self.name = name
        self.settings = settings
        self.prefix = f"{name}." if prefixed else ""
        self._opener = opener
        self._source: ToolSource | None = None
        self._tools: dict[str, _Listed] | None = None
        self.error: str | None = None
        self._failed_at = -math.inf
        self._lock = asyncio.Lock()
        self.closed = False

    @property
    def opened(self) -> bool:
        return self._source is not None

    @property
    def tools(self) -> Mapping[str, _Listed]:
        return self._tools or {}

    async def ensure_listed(self) -> None:
        """Lists the source's tools unless done (or failed moments ago)."""
        if self._tools is not None or self.closed:
            return
        async with self._lock:
            if self._tools is not None or self.closed:
                return
            if time.monotonic() - self._failed_at < LIST_RETRY_S:
                return
            try:
                if self._source is None:
                    self._source = self._opener()
                specs = await asyncio.wait_for(self._source.list_tools(), LIST_DEADLINE_S)
                listed = {spec.name: _Listed.of(spec, self.name) for spec in specs}
            except SourceRefused as refused:
                self._fail(str(refused), retry=False)
            except TimeoutError:
                self._fail(f"listing its tools timed out after {LIST_DEADLINE_S:g} s")
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a server's fault is the model's information
                self._fail(f"listing its tools failed: {_shorten(str(error) or repr(error))}")
            else:
                self._tools, self.error = listed, None

    def _fail(self, error: str, *, retry: bool = True) -> None:
        log.warning("tool source %s: %s", self.name, error)
        self.error = error
        self._failed_at = time.monotonic() if retry else math.inf

    async def call(self, call: ToolCall, timeout_s: float) -> ToolOutcome:
        if self._source is None:
            return _error(f"tool source {self.name!r} is closed: the runner is shutting down")
        return await self._source.call(call, timeout_s)

    async def aclose(self) -> None:
        """Closes the source if it was opened; a failure to close is logged."""
        self.closed = True
        source, self._source = self._source, None
        if source is None:
            return
        try:
            await source.aclose()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("closing tool source %s failed", self.name)


def _error(text: str) -> ToolOutcome:
    return ToolOutcome(text, is_error=True)


class ToolRegistry:
    """The tools of one loadout revision of one tenant, over its source slots."""

    def __init__(self, slots: Iterable[SourceSlot]) -> None:
        self._slots = tuple(slots)
        self._by_name = {slot.name: slot for slot in self._slots if slot.prefix}

    @property
    def slots(self) -> tuple[SourceSlot, ...]:
        return self._slots

    async def prepare(self) -> None:
        """Lists every source not listed yet (at once), so `specs` is complete."""
        await asyncio.gather(*(slot.ensure_listed() for slot in self._slots))

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """The tools the model is offered, named as it must call them."""
        specs: dict[str, ToolSpec] = {}
        for slot in self._slots:
            for own, listed in slot.tools.items():
                exposed = slot.prefix + own
                if exposed not in specs:
                    specs[exposed] = replace(listed.spec, name=exposed)
        return tuple(specs.values())

    def _resolve(self, name: str) -> tuple[SourceSlot, str] | None:
        """The slot that serves `name` and the tool's own name there."""
        for slot in self._slots:
            if not slot.prefix and name in slot.tools:
                return slot, name
        prefix, dot, own = name.partition(".")
        owner = self._by_name.get(prefix) if dot else None
        return (owner, own) if owner is not None else None

    def requires_approval(self, name: str) -> bool:
        """Whether a person must approve a call of `name` before it runs."""
        for slot in self._slots:
            # Built-ins are known by their settings even before they are listed.
            if not slot.prefix and name in slot.settings.require_approval:
                return True
        resolved = self._resolve(name)
        return resolved is not None and resolved[1] in resolved[0].settings.require_approval

    async def run(self, call: ToolCall) -> ToolOutcome:
        """Runs one call (`call.name` as the model named it); every failure
        becomes an error outcome, never an exception."""
        await asyncio.gather(*(s.ensure_listed() for s in self._slots if not s.prefix))
        resolved = self._resolve(call.name)
        if resolved is None:
            return _error(f"unknown tool {call.name!r}")
        slot, own = resolved
        await slot.ensure_listed()
        if slot.closed:
            return _error(f"tool source {slot.name!r} is closed: the runner is shutting down")
        if slot.error is not None:
            return _error(f"tool source {slot.name!r} is unavailable: {slot.error}")
        listed = slot.tools.get(own)
        if listed is None:
            return _error(f"unknown tool {call.name!r}: {slot.name} has no tool {own!r}")
        problem = listed.problem(call.arguments)
        if problem is not None:
            return _error(
                f"{call.name} was not run: its arguments do not match its schema: {problem}"
            )
        timeout_s = slot.settings.timeout_s
        try:
            outcome = await asyncio.wait_for(
                slot.call(replace(call, name=own), timeout_s), timeout_s + TIMEOUT_GRACE_S
            )
        except TimeoutError:
            return _error(f"{call.name} timed out after {timeout_s:g} s")
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a tool's bug is the agent's information, not our crash
            return _error(f"{call.name} failed: {_shorten(str(error) or repr(error))}")
        return limit_result(outcome, slot.settings.max_result_bytes)

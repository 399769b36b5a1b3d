"""What the edge does for each request, behind the HTTP routes.

The edge owns nothing durable about sessions: inputs are committed to the
ledger first (idempotent by requestId), then the kernel is woken. It finds a
session's owner through the kernel to attach to the runner's partial hub.

Session ids are per tenant, as workflow ids are per namespace in Temporal:
the id a client sees is `<id>`, the ledger's is `<tenant>:<id>`. Two tenants
may use the same id, and creating one never reveals that another tenant
has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

from compaction.client import CompactionClient
from compaction.errors import SeqOutOfRange as CompactionSeqOutOfRange
from edge.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    Unauthorized,
    Unavailable,
    from_service_error,
    shown,
)
from edge.fanout import FanoutHub
from kernel import InvalidApiKey, KernelClient, RuntimeInfo
from services.blobs import BlobStore
from services.common.config import Settings
from services.common.errors import KeelError
from services.ledger import LedgerClient, SessionView
from services.ledger.facts import check_id
from services.runner.client import RunnerClient
from services.runner.hub import StatusChange

log = logging.getLogger("keel.edge")

AUTH_CACHE_S = 30.0
# How long GET /v1/sessions/{id} waits for the owner runner's state.
RUNNER_STATE_TIMEOUT_S = 2.0
MAX_TEXT_CHARS = 256 * 1024
DEFAULT_SESSION_PAGE = 100
MAX_SESSION_PAGE = 1000
# No ':' in a client's session id, so `<tenant>:<id>` splits one way only.
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
# What the ledger accepts as a requestId, checked here first so that a refusal
# quotes no more of a client's value than `shown` allows.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")


@dataclass(frozen=True)
class Committed:
    """An input in the ledger, as the client is told of it."""

    seq: int
    # The requestId had committed this input already (the answer is 200).
    duplicate: bool
    request_id: str
    # False when the edge made the requestId: the client has no id to send
    # again, so resending the request would commit a second input.
    retry_safe: bool

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "requestId": self.request_id, "retrySafe": self.retry_safe}


def _request_id(body: Mapping[str, Any], idempotency_key: str | None) -> tuple[str, bool]:
    """The input's requestId (body or Idempotency-Key header, else a new one)
    and whether the client chose it."""
    given = body.get("requestId")
    if given is not None and not isinstance(given, str):
        raise BadRequest("requestId must be a string")
    if given is not None and idempotency_key is not None and given != idempotency_key:
        raise BadRequest("requestId and the Idempotency-Key header differ; send one of them")
    chosen = given if given is not None else idempotency_key
    if chosen is None:
        return f"edge-{uuid.uuid4().hex}", False
    if not _REQUEST_ID.match(chosen):
        raise BadRequest(
            "a requestId (or Idempotency-Key) is 1-128 characters of letters, digits, "
            f"'_.:-', got {shown(chosen)}"
        )
    return chosen, True


class SeqOutOfRange(BadRequest):
    """A seq past the session's head: that point does not exist yet."""

    code = "seq_out_of_range"


@dataclass(frozen=True)
class Caller:
    """Who sent a request: acting for `tenant_id`; an admin manages that
    tenant, an operator runs the deployment (every tenant's runtimes)."""

    tenant_id: str
    admin: bool
    operator: bool = False


@dataclass(frozen=True)
class EdgeConfig:
    ledger_target: str
    kernel_target: str
    # The compaction service answers /context; without one that route is a 503.
    compaction_target: str = ""
    # How long SSE clients of a draining edge wait before reconnecting.
    drain_retry_after_ms: int = 1000
    keepalive_s: float = 15.0


class Gateway:
    def __init__(self, config: EdgeConfig, settings: Settings, blobs: BlobStore) -> None:
        self.config = config
        self.settings = settings
        self.blobs = blobs
        self.ledger = LedgerClient(config.ledger_target, settings)
        self.kernel = KernelClient(config.kernel_target, settings)
        self.compaction = (
            CompactionClient(config.compaction_target, settings)
            if config.compaction_target
            else None
        )
        self.fanout = FanoutHub(self.ledger, self._owner_runner, self.runner)
        self.edge_id = f"edge-{uuid.uuid4().hex[:12]}"
        self.draining = asyncio.Event()
        self.drain_mode = "none"
        self._keys: dict[str, tuple[float, Caller]] = {}
        self._runners: dict[str, RunnerClient] = {}
        self._addresses: dict[str, str] = {}
        self._tenants: dict[str, str] = {}
        # Runners living in this process (keel up): drained with the edge.
        self.local_runtime_ids: set[str] = set()

    def start_draining(self, mode: str = "shutdown") -> None:
        """Stop serving streams: every SSE client gets `drain` and reconnects.
        Inputs are still accepted until the listener closes."""
        self.drain_mode = mode
        self.draining.set()
        self.fanout.drain()

    async def close(self) -> None:
        for client in self._runners.values():
            await client.close()
        await self.ledger.close()
        await self.kernel.close()
        if self.compaction is not None:
            await self.compaction.close()

    # -- auth and ownership --

    async def authenticate(self, key: str) -> Caller:
        if not key:
            raise Unauthorized("missing API key: send Authorization: Bearer <key>")
        cached = self._keys.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        try:
            grant = await self.kernel.authenticate(key)
        except InvalidApiKey:
            raise Unauthorized("unknown API key") from None
        except KeelError as error:
            raise from_service_error(error) from None
        caller = Caller(grant.tenant_id, grant.admin, grant.operator)
        self._keys[key] = (time.monotonic() + AUTH_CACHE_S, caller)
        return caller

    @staticmethod
    def require_admin(caller: Caller) -> None:
        if not caller.admin:
            raise Forbidden("this endpoint needs an admin key")

    @staticmethod
    def require_operator(caller: Caller) -> None:
        # A tenant's admin must not stop runtimes every other tenant runs on.
        if not caller.operator:
            raise Forbidden("this endpoint needs an operator key")

    async def session(self, caller: Caller, session_id: str) -> SessionView:
        """The session if it is the caller's; another tenant's is a 404."""
        try:
            check_id(session_id, "session id")
            view = await self.ledger.get_session(session_id)
        except KeelError as error:
            raise from_service_error(error) from None
        if view.tenant_id != caller.tenant_id:
            raise NotFound("no such session")
        return view

    async def check_owner(self, caller: Caller, session_id: str) -> None:
        """Like `session()`, without reading the session's state: a session's
        tenant never changes, so it is remembered after the first look."""
        tenant = self._tenants.get(session_id)
        if tenant is None:
            tenant = (await self.session(caller, session_id)).tenant_id
            if len(self._tenants) > 100_000:
                self._tenants.clear()
            self._tenants[session_id] = tenant
        if tenant != caller.tenant_id:
            raise NotFound("no such session")

    # -- sessions and inputs --

    @staticmethod
    def ledger_session_id(caller: Caller, session_id: str) -> str:
        """The ledger's id of the caller's session `session_id`."""
        if not _SESSION_ID.match(session_id):
            raise BadRequest(
                "a session id is 1-64 characters of letters, digits, '_.-', "
                f"got {shown(session_id)}"
            )
        ledger_id = f"{caller.tenant_id}:{session_id}"
        if len(ledger_id) > 128:
            raise BadRequest("this session id is too long for this tenant's id")
        return ledger_id

    @staticmethod
    def public_session_id(ledger_id: str) -> str:
        return ledger_id.rpartition(":")[2]

    async def create_session(self, caller: Caller, session_id: str | None) -> str:
        """Creates the caller's session (`session_id` or a new one); its public id."""
        session_id = session_id or f"s-{uuid.uuid4().hex[:16]}"
        ledger_id = self.ledger_session_id(caller, session_id)
        if not await self.ledger.create_session(ledger_id, caller.tenant_id):
            raise Conflict("you have a session with this id already")
        return session_id

    async def list_sessions(
        self, caller: Caller, after: str | None = None, limit: int = DEFAULT_SESSION_PAGE
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the caller's sessions, ascending by id, after `after`,
        and the id to continue after (None on the last page).

        A tenant's sessions are one range of the ledger's ids, `<tenant>:…`.
        """
        limit = max(1, min(limit, MAX_SESSION_PAGE))
        prefix = f"{caller.tenant_id}:"
        cursor = self.ledger_session_id(caller, after) if after else prefix
        found: list[dict[str, Any]] = []
        # One more than asked: whether it exists says if there is a next page.
        while cursor and len(found) <= limit:
            page = await self.ledger.list_sessions(cursor, limit + 1 - len(found))
            cursor = page.next_after
            for summary in page.sessions:
                if not summary.session_id.startswith(prefix):
                    cursor = ""
                    break
                if summary.tenant_id == caller.tenant_id:
                    found.append(
                        {
                            "id": self.public_session_id(summary.session_id),
                            "headSeq": summary.head_seq,
                        }
                    )
        if len(found) > limit:
            return found[:limit], found[limit - 1]["id"]
        return found, None

    async def commit_input(
        self,
        caller: Caller,
        session_id: str,
        body: Mapping[str, Any],
        idempotency_key: str | None = None,
    ) -> Committed:
        """Commits an input (`text`, `requestId`?, `blobs`?) then wakes the kernel."""
        await self.check_owner(caller, session_id)
        text = body.get("text")
        if not isinstance(text, str):
            raise BadRequest("an input needs text (string)")
        if len(text) > MAX_TEXT_CHARS:
            raise BadRequest(f"text is longer than {MAX_TEXT_CHARS} characters")
        request_id, retry_safe = _request_id(body, idempotency_key)
        data: dict[str, Any] = {"text": text, "requestId": request_id}
        blobs = body.get("blobs")
        if blobs is not None:
            if not isinstance(blobs, list) or not all(isinstance(b, str) for b in blobs):
                raise BadRequest("blobs must be a list of blob ids")
            for blob_id in blobs:
                info = await asyncio.to_thread(self.blobs.get, caller.tenant_id, blob_id)
                if not info.complete:
                    raise BadRequest(f"blob {info.id} is not completely uploaded")
            data["blobs"] = blobs
        return await self._append_input(caller, session_id, data, retry_safe)

    async def retry(
        self,
        caller: Caller,
        session_id: str,
        body: Mapping[str, Any],
        idempotency_key: str | None = None,
    ) -> Committed:
        """Asks input `seq` again: a new input with its text and blobs, and
        `retryOf`. Deduplicated like any input, so one requestId re-asks once,
        and a requestId used to retry another seq is a conflict."""
        await self.check_owner(caller, session_id)
        seq = body.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq < 1 << 63:
            raise BadRequest("retry needs the seq (positive integer) of an input")
        request_id, retry_safe = _request_id(body, idempotency_key)
        facts, _ = await self.ledger.read(session_id, seq - 1, 1)
        if not facts or facts[0].seq != seq or facts[0].kind != "input":
            raise BadRequest(f"seq {seq} is not an input of this session")
        original = facts[0].data
        data: dict[str, Any] = {"text": original["text"], "requestId": request_id, "retryOf": seq}
        if original.get("blobs"):
            data["blobs"] = list(original["blobs"])
        return await self._append_input(caller, session_id, data, retry_safe)

    async def _append_input(
        self, caller: Caller, session_id: str, data: dict[str, Any], retry_safe: bool
    ) -> Committed:
        appended = await self.ledger.append_one(session_id, "input", data)
        # A duplicate still enqueues: the first attempt to wake may be the
        # one that was lost, and a spare wake-up is harmless.
        await self.kernel.enqueue(session_id, caller.tenant_id, appended.seq, unpark=True)
        return Committed(appended.seq, appended.duplicate, data["requestId"], retry_safe)

    async def cancel(self, caller: Caller, session_id: str) -> int | None:
        """Commits a cancel and returns its seq; None when there is nothing to
        cancel (no owed input, no open tool call, nobody holding the session),
        so an idle session's history gains no empty cancel."""
        view = await self.session(caller, session_id)
        # The lease is asked directly, not through owner(): an unreachable
        # kernel must be a 503, not a claim that nothing runs.
        if (
            not view.owed_input_seqs
            and not view.open_tool_calls
            and (await self.kernel.get_lease(session_id)).lease is None
        ):
            return None
        appended = await self.ledger.append_one(session_id, "cancelled", {"reason": "client"})
        await self.kernel.enqueue(session_id, caller.tenant_id)
        return appended.seq

    # -- runners --

    async def runtimes(self) -> list[RuntimeInfo]:
        runtimes = await self.kernel.list_runtimes()
        for runtime in runtimes:
            if runtime.address:
                self._addresses[runtime.runtime_id] = runtime.address
        return runtimes

    async def runner(self, runtime_id: str) -> RunnerClient | None:
        address = self._addresses.get(runtime_id)
        if address is None:
            await self.runtimes()
            address = self._addresses.get(runtime_id)
        if not address:
            return None
        client = self._runners.get(address)
        if client is None:
            client = RunnerClient(address, self.settings)
            self._runners[address] = client
        return client

    async def owner(self, session_id: str) -> str | None:
        with contextlib.suppress(KeelError):
            info = await self.kernel.get_lease(session_id)
            if info.lease is not None:
                return info.lease.runtime_id
        return None

    async def _owner_runner(self, session_id: str) -> RunnerClient | None:
        owner = await self.owner(session_id)
        return await self.runner(owner) if owner else None

    async def status_of(self, view: SessionView) -> str:
        """idle, running, compacting or parked. The kernel knows whether an
        attempt holds the session; only its runner knows whether that attempt
        is compacting right now."""
        if view.parked:
            return "parked"
        owner = await self.owner(view.session_id)
        if owner is None:
            return "idle"
        runner = await self.runner(owner)
        state = await self._runner_state(runner, view.session_id) if runner else None
        # A lease with no answer from its runner (starting, finishing, or the
        # runner unreachable) is still an attempt in progress.
        return state or "running"

    @staticmethod
    async def _runner_state(runner: RunnerClient, session_id: str) -> str | None:
        """The session's state on the runner that owns it: the first event of
        its watch stream is the current status (the stream is closed at once)."""
        events = runner.watch(session_id)
        try:
            async with asyncio.timeout(RUNNER_STATE_TIMEOUT_S):
                first = await anext(events)
        except (StopAsyncIteration, KeelError, TimeoutError):
            return None
        finally:
            if isinstance(events, AsyncGenerator):
                await events.aclose()  # ends the runner's stream now
        return first.state if isinstance(first, StatusChange) else None

    # -- what the model sees --

    async def context(self, caller: Caller, session_id: str, at: int | None) -> dict[str, Any]:
        """What a request built at context head `at` (None: the head) showed
        the model, exactly, as the compaction service rebuilds it: the system
        prompt of the loadout revision the answering attempt pinned, the
        messages up to its read watermark, blobs as content parts.
        `session_id` is the ledger's id (`ledger_session_id`)."""
        view = await self.session(caller, session_id)
        if at is None:
            at = view.head_seq
        if isinstance(at, bool) or not isinstance(at, int) or at < 1:
            raise BadRequest("at must be a seq (a positive integer)")
        if at > view.head_seq:
            raise SeqOutOfRange(f"at {at} is beyond the session's head {view.head_seq}")
        if self.compaction is None:
            raise Unavailable("this edge has no compaction service to build contexts with")
        try:
            built = await self.compaction.get_context(session_id, at)
        except CompactionSeqOutOfRange as error:
            raise SeqOutOfRange(error.message) from None
        except KeelError as error:
            raise from_service_error(error) from None
        return {
            "at": at,
            "systemPrompt": built.system_prompt,
            "messages": list(built.messages),
            "compactionSeq": built.compaction_seq,
            "loadoutRevision": built.loadout_revision,
            "watermark": built.watermark,
            "estimatedTokens": built.estimated_tokens,
        }

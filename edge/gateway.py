"""What the edge does for each request, behind the HTTP routes.

The edge owns nothing durable about sessions. It finds a session's owner
through the kernel to attach to the runner's partial hub, and asks the
compaction service what the model saw. Inputs (`edge.inputs`), callers
(`edge.auth`) and tenant administration (`edge.admin_ops`) live in modules
of their own, taking the gateway.

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
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from compaction.client import CompactionClient
from compaction.errors import SeqPastHead
from edge.approvals import PendingApproval, pending_approvals
from edge.auth import Authenticator, Caller
from edge.errors import (
    BadRequest,
    Conflict,
    SessionNotVisible,
    Unavailable,
    from_service_error,
    shown,
)
from edge.fanout import FanoutHub
from edge.multitask import TenantDefaults
from edge.session_status import AWAITING_APPROVAL, PARKED, SessionStatus
from kernel import KernelClient, RuntimeInfo
from kernel.domain import DrainMode
from services.blobs import BlobStore
from services.common.config import Settings
from services.common.errors import KeelError
from services.common.outage_log import OutageLog
from services.ledger import LedgerClient, SessionView
from services.ledger.facts import check_id
from services.runner.client import RunnerClient
from services.runner.events import IDLE, RUNNING, SessionState, StatusChange

log = logging.getLogger(__name__)

# How long GET /v1/sessions/{id} waits for the owner runner's state.
RUNNER_STATE_TIMEOUT_S = 2.0
DEFAULT_SESSION_PAGE = 100
MAX_SESSION_PAGE = 1000
# No ':' in a client's session id, so `<tenant>:<id>` splits one way only.
# Matched whole: `$` would also match before a trailing newline ("nl\n").
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


class SeqOutOfRange(BadRequest):
    """A seq past the session's head: that point does not exist yet."""

    code = "seq_out_of_range"
    reason = "SEQ_OUT_OF_RANGE"


@dataclass(frozen=True)
class SessionInfo:
    """A session as its tenant is told of it."""

    session_id: str
    head_seq: int
    status: SessionStatus
    owed_input_seqs: tuple[int, ...]
    latest_compaction_seq: int
    pending_approvals: tuple[PendingApproval, ...] = ()
    # Parked: the inputs the session failed on (what a skip settles) and why.
    parked_on: tuple[int, ...] = ()
    parked_reason: str = ""

    def to_json(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "id": self.session_id,
            "headSeq": self.head_seq,
            "status": self.status,
            "owedInputs": list(self.owed_input_seqs),
            "latestCompactionSeq": self.latest_compaction_seq,
            "pendingApprovals": [p.to_json() for p in self.pending_approvals],
        }
        if self.status == PARKED:
            info["parkedOn"] = list(self.parked_on)
            info["parkedReason"] = self.parked_reason
        return info


@dataclass(frozen=True)
class EdgeConfig:
    ledger_target: str
    kernel_target: str
    # The compaction service answers /context; without one that route is a 503.
    compaction_target: str = ""
    # How long SSE clients of a draining edge wait before reconnecting.
    drain_retry_after_ms: int = 1000
    keepalive_s: float = 15.0
    # The public gRPC API (keel.sessions.v1) on this port of the edge's host;
    # None: not served, 0: any free port.
    grpc_port: int | None = None
    # A drain's deadline when its request names none (KEEL_DRAIN_DEADLINE_MS).
    drain_deadline_ms: int = 30_000


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
        self.drain_mode = DrainMode.NONE
        # A drain of this edge has finished: it must be replaced (a
        # standalone edge exits; `keel up` starts another in its place).
        self.drained = asyncio.Event()
        self.auth = Authenticator(self.kernel, self.edge_id)
        self._runners: dict[str, RunnerClient] = {}
        self._addresses: dict[str, str] = {}
        self._tenants: dict[str, str] = {}
        # Each tenant's default double-texting strategy (edge/multitask.py).
        self.multitask_defaults = TenantDefaults(self._loadout_document)
        # Inputs committed whose session the kernel could not be told of,
        # said once per outage of this edge's kernel (edge/inputs.py).
        self.wake_ups = OutageLog(log, "kernel", attempts="wake-ups of committed inputs failed")

    async def _loadout_document(self, tenant_id: str) -> dict[str, object]:
        return dict((await self.kernel.get_loadout(tenant_id)).document)

    def start_draining(self, mode: DrainMode = DrainMode.SHUTDOWN) -> None:
        """Stop serving streams: every SSE client gets `drain` and reconnects.
        Inputs are still accepted until the listener closes."""
        self.drain_mode = DrainMode(mode)
        self.draining.set()
        self.fanout.drain()

    def stop_draining(self) -> bool:
        """Undoes a drain that has not finished: streams are served again
        and /readyz is 200. False when there was nothing to undo."""
        if self.drained.is_set() or not self.draining.is_set():
            return False
        self.draining.clear()
        self.drain_mode = DrainMode.NONE
        self.fanout.draining = False
        return True

    async def close(self) -> None:
        await self.auth.close()
        for client in self._runners.values():
            await client.close()
        await self.ledger.close()
        await self.kernel.close()
        if self.compaction is not None:
            await self.compaction.close()

    # -- auth and ownership --

    async def session(self, caller: Caller, session_id: str) -> SessionView:
        """The session if it is the caller's; another tenant's is a 404."""
        try:
            check_id(session_id, "session id")
            view = await self.ledger.get_session(session_id)
        except KeelError as error:
            raise from_service_error(error) from None
        if view.tenant_id != caller.tenant_id:
            raise SessionNotVisible("no such session")
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
            raise SessionNotVisible("no such session")

    async def session_info(self, caller: Caller, session_id: str) -> SessionInfo:
        """What GET /v1/sessions/{id} and GetSession report of the caller's session."""
        view = await self.session(caller, session_id)
        pending, status = await asyncio.gather(
            pending_approvals(self.ledger, view), self.status_of(view)
        )
        if status == IDLE and pending:
            status = AWAITING_APPROVAL
        return SessionInfo(
            session_id=self.public_session_id(view.session_id),
            head_seq=view.head_seq,
            status=status,
            owed_input_seqs=tuple(view.owed_input_seqs),
            latest_compaction_seq=view.latest_compaction_seq,
            pending_approvals=pending,
            parked_on=view.parked_on,
            parked_reason=view.parked_reason,
        )

    async def check_cursor(self, caller: Caller, session_id: str, after: int) -> SessionView:
        """The caller's session, if its facts can be read after `after`."""
        view = await self.session(caller, session_id)
        if after < 0:
            raise BadRequest("a cursor is a seq (a non-negative integer)", field="after")
        if after > view.head_seq:
            # A cursor from the future would silently skip facts until the
            # session caught up with it: refuse it instead.
            raise SeqOutOfRange(
                f"cursor {after} is beyond the session's head {view.head_seq}", field="after"
            )
        return view

    # -- sessions and inputs --

    @staticmethod
    def ledger_session_id(caller: Caller, session_id: str) -> str:
        """The ledger's id of the caller's session `session_id`."""
        if not _SESSION_ID.fullmatch(session_id):
            raise BadRequest(
                "a session id is 1-64 characters of letters, digits, '_.-', "
                f"got {shown(session_id)}",
                field="id",
            )
        ledger_id = f"{caller.tenant_id}:{session_id}"
        if len(ledger_id) > 128:
            raise BadRequest("this session id is too long for this tenant's id", field="id")
        return ledger_id

    @staticmethod
    def public_session_id(ledger_id: str) -> str:
        return ledger_id.rpartition(":")[2]

    async def create_session(self, caller: Caller, session_id: str | None) -> str:
        """Creates the caller's session (`session_id` or a new one); its public id."""
        session_id = session_id or f"s-{uuid.uuid4().hex[:16]}"
        ledger_id = self.ledger_session_id(caller, session_id)
        if not await self.ledger.create_session(ledger_id, caller.tenant_id):
            raise Conflict("you have a session with this id already", reason="SESSION_EXISTS")
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

    async def status_of(self, view: SessionView) -> SessionStatus:
        """idle, running, compacting or parked. The kernel knows whether an
        attempt holds the session; only its runner knows whether that attempt
        is compacting right now.

        A kernel that cannot be asked makes this a 503, never `idle`: an
        answer may still be streaming (its runner outlives a kernel gap),
        and a client that reads `idle` stops waiting for it."""
        if view.parked:
            return PARKED
        lease = (await self.kernel.get_lease(view.session_id)).lease
        if lease is None:
            return IDLE
        owner = lease.runtime_id
        runner = await self.runner(owner)
        state = await self._runner_state(runner, view.session_id) if runner else None
        # A lease with no answer from its runner (starting, finishing, or the
        # runner unreachable) is still an attempt in progress.
        return state or RUNNING

    @staticmethod
    async def _runner_state(runner: RunnerClient, session_id: str) -> SessionState | None:
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
            raise BadRequest("at must be a seq (a positive integer)", field="at")
        if at > view.head_seq:
            raise SeqOutOfRange(f"at {at} is beyond the session's head {view.head_seq}", field="at")
        if self.compaction is None:
            raise Unavailable("this edge has no compaction service to build contexts with")
        try:
            built = await self.compaction.get_context(session_id, at)
        except SeqPastHead as error:
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

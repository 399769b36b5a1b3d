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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edge.blobs import BlobStore
from edge.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    Unauthorized,
    from_service_error,
)
from edge.fanout import FanoutHub
from kernel import InvalidApiKey, KernelClient, RuntimeInfo
from services.common.config import Settings
from services.common.errors import KeelError
from services.ledger import LedgerClient, SessionView
from services.ledger.facts import check_id
from services.runner.client import RunnerClient

log = logging.getLogger("keel.edge")

AUTH_CACHE_S = 30.0
MAX_TEXT_CHARS = 256 * 1024
# No ':' in a client's session id, so `<tenant>:<id>` splits one way only.
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


@dataclass(frozen=True)
class Caller:
    tenant_id: str
    admin: bool


@dataclass(frozen=True)
class EdgeConfig:
    ledger_target: str
    kernel_target: str
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

    # -- auth and ownership --

    async def authenticate(self, key: str) -> Caller:
        if not key:
            raise Unauthorized("missing API key: send Authorization: Bearer <key>")
        cached = self._keys.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        try:
            tenant_id, admin = await self.kernel.authenticate(key)
        except InvalidApiKey:
            raise Unauthorized("unknown API key") from None
        except KeelError as error:
            raise from_service_error(error) from None
        caller = Caller(tenant_id, admin)
        self._keys[key] = (time.monotonic() + AUTH_CACHE_S, caller)
        return caller

    @staticmethod
    def require_admin(caller: Caller) -> None:
        if not caller.admin:
            raise Forbidden("this endpoint needs an admin key")

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
                f"got {session_id[:80]!r}"
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
        try:
            created = await self.ledger.create_session(ledger_id, caller.tenant_id)
        except KeelError as error:
            raise from_service_error(error) from None
        if not created:
            raise Conflict("you have a session with this id already")
        return session_id

    async def list_sessions(self, caller: Caller) -> list[dict[str, Any]]:
        """The caller's sessions: one range of the ledger's ids, `<tenant>:…`."""
        prefix = f"{caller.tenant_id}:"
        out: list[dict[str, Any]] = []
        after = prefix
        while after:
            page = await self.ledger.list_sessions(after, 1000)
            for summary in page.sessions:
                if not summary.session_id.startswith(prefix):
                    return out
                if summary.tenant_id == caller.tenant_id:
                    out.append(
                        {
                            "id": self.public_session_id(summary.session_id),
                            "headSeq": summary.head_seq,
                        }
                    )
            after = page.next_after
        return out

    async def commit_input(
        self, caller: Caller, session_id: str, body: Mapping[str, Any], retry_of: int | None = None
    ) -> tuple[int, bool]:
        """Commits an input then wakes the kernel; returns (seq, duplicate)."""
        await self.check_owner(caller, session_id)
        text = body.get("text")
        request_id = body.get("requestId")
        if not isinstance(text, str) or not isinstance(request_id, str):
            raise BadRequest("an input needs text (string) and requestId (string)")
        if len(text) > MAX_TEXT_CHARS:
            raise BadRequest(f"text is longer than {MAX_TEXT_CHARS} characters")
        data: dict[str, Any] = {"text": text, "requestId": request_id}
        if retry_of is not None:
            data["retryOf"] = retry_of
        blobs = body.get("blobs")
        if blobs is not None:
            if not isinstance(blobs, list) or not all(isinstance(b, str) for b in blobs):
                raise BadRequest("blobs must be a list of blob ids")
            for blob_id in blobs:
                if not (
                    await asyncio.to_thread(self.blobs.get, caller.tenant_id, blob_id)
                ).complete:
                    raise BadRequest(f"blob {blob_id} is not completely uploaded")
            data["blobs"] = blobs
        try:
            appended = await self.ledger.append_one(session_id, "input", data)
            # A duplicate still enqueues: the first attempt to wake may be the
            # one that was lost, and a spare wake-up is harmless.
            await self.kernel.enqueue(session_id, caller.tenant_id, appended.seq, unpark=True)
        except KeelError as error:
            raise from_service_error(error) from None
        return appended.seq, appended.duplicate

    async def retry(self, caller: Caller, session_id: str, seq: object) -> tuple[int, bool]:
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq < 1 << 63:
            raise BadRequest("retry needs the seq (positive integer) of an input")
        facts, _ = await self.ledger.read(session_id, seq - 1, 1)
        if not facts or facts[0].seq != seq or facts[0].kind != "input":
            raise BadRequest(f"seq {seq} is not an input of this session")
        original = facts[0].data
        body = {"text": original["text"], "requestId": f"retry-{seq}-{uuid.uuid4().hex[:12]}"}
        return await self.commit_input(caller, session_id, body, retry_of=seq)

    async def cancel(self, caller: Caller, session_id: str) -> int:
        await self.check_owner(caller, session_id)
        try:
            appended = await self.ledger.append_one(session_id, "cancelled", {"reason": "client"})
            await self.kernel.enqueue(session_id, caller.tenant_id)
        except KeelError as error:
            raise from_service_error(error) from None
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
        if view.parked:
            return "parked"
        # Compacting is a phase of running; SSE `status` events tell them apart.
        return "running" if await self.owner(view.session_id) is not None else "idle"

"""Who is calling: API keys to callers, cached, and dropped when revoked.

The edge asks the kernel once per key and caches the answer for
AUTH_CACHE_S, so a request does not cost a kernel call. A revoked key must
not live on in that cache: every edge follows the kernel's key revocations
(WatchRevocations) and drops a revoked key's caller as soon as the kernel
reports it.

A revocation also ends every event stream opened with the key, on every
edge (edge/key_streams.py): streams register with `open_stream`. A stream
may open a little after its key was checked (the SSE route reads the
session first), and a revocation may reach the edge in between: each caller
carries how many revocations the edge had seen when the kernel confirmed
its key, and `open_stream` looks up the ones seen since among the last
RECENT_REVOCATIONS (a stream of a key revoked there is ended at once; one
whose check is older than that memory is ended as unconfirmed, and its
client reconnects and is checked again). An edge that was cut off from the
kernel learns of what it missed when its watch reconnects, from the last
revocation it saw: those revocations end streams exactly as live ones do.

Failed keys are limited per client address (edge/limits.py): the caller of
`authenticate` passes the address and the edge's `FailedKeys`, and a blocked
address is refused before the kernel is asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edge.errors import Forbidden, Unauthorized, UnknownKey, from_service_error
from edge.key_streams import KeyRevoked, KeyUnconfirmed, OpenStream, OpenStreams
from kernel import InvalidApiKey, KernelClient
from kernel.tenancy import hash_key
from services.common.errors import KeelError

if TYPE_CHECKING:
    from edge.limits import FailedKeys

log = logging.getLogger(__name__)

AUTH_CACHE_S = 30.0
# Reconnect delays of the revocation watch after the kernel went away.
REVOCATION_RETRY_FIRST_S = 0.05
REVOCATION_RETRY_MAX_S = 2.0
# Revoked keys remembered to check streams that open after their key's check
# (see the module docstring): about 100 bytes each.
RECENT_REVOCATIONS = 10_000


@dataclass(frozen=True)
class Caller:
    """Who sent a request: acting for `tenant_id`; an admin manages that
    tenant, an operator runs the deployment (every tenant's runtimes)."""

    tenant_id: str
    admin: bool
    operator: bool = False
    # The SHA-256 of the key it called with: what per-key limits count by.
    key_hash: str = field(default="", repr=False)
    # The key's id (`key_…`): who did it, in audit records.
    key_id: str = ""
    # How many revocations the edge had seen when the kernel confirmed the
    # key: any seen later may be of this key (`Authenticator.open_stream`).
    checked_at: int = field(default=0, compare=False, repr=False)


class Authenticator:
    """API keys to callers for one edge (see the module docstring)."""

    def __init__(self, kernel: KernelClient, name: str) -> None:
        self._kernel = kernel
        self._name = name
        # Callers by the SHA-256 of their key: what a revocation names, so the
        # kernel's WatchRevocations can drop one at once (follow_revocations).
        self._keys: dict[str, tuple[float, Caller]] = {}
        # Counts revocations seen: an authentication that overlapped one is
        # answered but not cached, as it may be of the key just revoked.
        self._revocations_seen = 0
        self._last_revocation_id = 0
        # The last RECENT_REVOCATIONS revoked keys' hashes, each with its
        # number among the revocations seen, and the number of the last one
        # forgotten.
        self._recent: OrderedDict[str, int] = OrderedDict()
        self._forgotten_through = 0
        # The event streams open on this edge, by key.
        self.streams = OpenStreams()
        self._revocation_watch: asyncio.Task[None] | None = None
        # Kernel lookups under way, by key hash (see authenticate).
        self._lookups: dict[str, asyncio.Future[Caller]] = {}

    @property
    def revocations_seen(self) -> int:
        """How many key revocations this edge has learned of."""
        return self._revocations_seen

    async def close(self) -> None:
        if self._revocation_watch is not None:
            self._revocation_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._revocation_watch

    async def authenticate(
        self, key: str, address: str = "", failed_keys: FailedKeys | None = None
    ) -> Caller:
        """The caller `key` stands for. With `failed_keys`, a key from a
        blocked `address` is refused (429) before the kernel is asked."""
        if not key:
            raise Unauthorized("missing API key: send Authorization: Bearer <key>")
        digest = hash_key(key)
        cached = self._keys.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            if failed_keys is not None:
                failed_keys.check_cached(address, digest)
            return cached[1]
        pending = self._lookups.get(digest)
        if pending is not None:
            # The kernel is being asked about this very key already: wait for
            # that answer. A burst of first requests with one right key (a
            # page's streams after an edge restart) costs one lookup and one
            # token of the address's failed-key budget, not one each.
            if failed_keys is not None:
                failed_keys.check_cached(address, digest)
            try:
                caller = await asyncio.shield(pending)
            except InvalidApiKey:
                raise UnknownKey("unknown or revoked API key") from None
            except KeelError as error:
                raise from_service_error(error) from None
            if failed_keys is not None:
                failed_keys.accepted(address, digest, False)
            return caller
        reserved = failed_keys.reserve(address, digest) if failed_keys is not None else False
        lookup = asyncio.ensure_future(self._lookup(key, digest))
        self._lookups[digest] = lookup
        lookup.add_done_callback(lambda done: self._lookup_done(digest, done))
        try:
            caller = await asyncio.shield(lookup)
        except InvalidApiKey:
            if failed_keys is not None:
                failed_keys.rejected(address, digest)
            raise UnknownKey("unknown or revoked API key") from None
        except BaseException as error:
            # Not an answer about the key (the kernel is away, or the client
            # left): the check does not count against the address.
            if failed_keys is not None:
                failed_keys.refund(address, reserved)
            if isinstance(error, KeelError):
                raise from_service_error(error) from None
            raise
        if failed_keys is not None:
            failed_keys.accepted(address, digest, reserved)
        return caller

    def _lookup_done(self, digest: str, done: asyncio.Future[Caller]) -> None:
        self._lookups.pop(digest, None)
        # Every waiter may have left (clients disconnected): the outcome is
        # then nobody's, and must not be reported as never retrieved.
        if not done.cancelled():
            done.exception()

    async def _lookup(self, key: str, digest: str) -> Caller:
        """Asks the kernel about one key; caches a right key's caller."""
        seen = self._revocations_seen
        grant = await self._kernel.authenticate(key)
        caller = Caller(
            grant.tenant_id,
            grant.admin,
            grant.operator,
            key_hash=digest,
            key_id=grant.key_id,
            checked_at=seen,
        )
        if self._revocations_seen == seen:
            self._keys[digest] = (time.monotonic() + AUTH_CACHE_S, caller)
        return caller

    def follow_revocations(self) -> None:
        """Starts following the kernel's key revocations (needs a running
        loop): a revoked key's cached caller is dropped as soon as the kernel
        reports it, on every edge, rather than trusted until AUTH_CACHE_S."""
        if self._revocation_watch is None or self._revocation_watch.done():
            self._revocation_watch = asyncio.get_running_loop().create_task(
                self._follow_revocations(), name=f"{self._name}-revocations"
            )

    async def _follow_revocations(self) -> None:
        delay = REVOCATION_RETRY_FIRST_S
        while True:
            try:
                # From the last id seen: revocations made while the kernel
                # was away come first, as its backlog.
                async for revoked in self._kernel.watch_revocations(self._last_revocation_id):
                    self._revoked(revoked.key_hash)
                    self._last_revocation_id = revoked.revocation_id
                    delay = REVOCATION_RETRY_FIRST_S
            except KeelError as error:
                log.info("key revocation watch interrupted: %s", error.message)
            except Exception:
                # Never let a bug stop the following: retry with backoff.
                log.exception("key revocation watch failed")
            await asyncio.sleep(delay)
            delay = min(delay * 2, REVOCATION_RETRY_MAX_S)

    def _revoked(self, key_hash: str) -> None:
        """A revocation reached this edge: the key is dropped from the cache
        and every stream it opened here ends."""
        self._revocations_seen += 1
        self._keys.pop(key_hash, None)
        self._recent[key_hash] = self._revocations_seen
        self._recent.move_to_end(key_hash)
        while len(self._recent) > RECENT_REVOCATIONS:
            _, self._forgotten_through = self._recent.popitem(last=False)
        ended = self.streams.end_key(key_hash, _revoked_error())
        if ended:
            log.info("ended %d event stream(s) of a revoked key", ended)

    def open_stream(self, caller: Caller) -> OpenStream:
        """Registers an event stream of the caller's key until it closes
        (`with` it): a revocation of the key ends it. Ended at once when
        the key was revoked after the caller was checked, or when the edge
        cannot tell any more (see the module docstring)."""
        stream = self.streams.open(caller.key_hash)
        if caller.checked_at != self._revocations_seen:
            at = self._recent.get(caller.key_hash)
            if at is not None and at > caller.checked_at:
                stream.end(_revoked_error())
            elif caller.checked_at < self._forgotten_through:
                stream.end(
                    KeyUnconfirmed("this edge could not confirm the API key; open the stream again")
                )
        return stream


def _revoked_error() -> KeyRevoked:
    return KeyRevoked("the API key this stream was opened with has been revoked")


def require_admin(caller: Caller) -> None:
    if not caller.admin:
        raise Forbidden("this endpoint needs an admin key")


def require_operator(caller: Caller) -> None:
    # A tenant's admin must not stop runtimes every other tenant runs on.
    if not caller.operator:
        raise Forbidden("this endpoint needs an operator key")

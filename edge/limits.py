"""How much one client may ask of the edge, on both front doors.

- Failed keys, per client address: a token bucket of `failed_keys_burst`
  checks, refilled over `failed_keys_window_s`. Every key the edge has to ask
  the kernel about takes a token first (so a thousand guesses sent at once
  cannot all be in flight); a right key gives its token back, a wrong one
  spends it. An address with no token left is refused (429 / gRPC
  RESOURCE_EXHAUSTED with a retry delay) without asking the kernel, for any
  key, even a right one, except a key already accepted from that same
  address: someone behind the same NAT as a guesser keeps working, and a
  guesser gains nothing from it (it would need a right key first). Other
  addresses are not affected. IPv6 addresses count per /64, as one host
  usually holds a whole /64. At most `tracked_addresses` are remembered
  (the least recently seen is forgotten first), so memory stays bounded.
- Event streams (HTTP SSE and gRPC StreamEvents together) open at once, per
  API key and per tenant: one more is refused with 429 naming the limit.
  Their counts are dropped as soon as they reach zero.
- Slow clients: how long a request's head and body may take to arrive
  (enforced in edge/slow_clients.py), and how long an idle kept-alive
  connection stays open between requests (`keep_alive_s`: longer than the
  idle timeout of common load balancers and client pools, so the edge never
  closes a connection a client is just reusing).
- Request heads: at most `max_head_bytes` (request line and headers) and
  `max_headers` header lines, counted while the head arrives: a longer one
  is answered 431 and its connection closed (edge/slow_clients.py). The
  gRPC door holds its metadata to the same byte limit (edge/server.py).
- Request size: a JSON body over HTTP, and a request message over gRPC, of
  at most `max_body_bytes`; a larger one is refused by name (413
  `payload_too_large` / INVALID_ARGUMENT `PAYLOAD_TOO_LARGE`, with the limit)
  before it is parsed. (Blob chunks have their own limit, edge/routes/blobs.py;
  a gRPC message over the transport's limit, `KEEL_GRPC_MAX_MESSAGE_BYTES`,
  is refused by gRPC itself with RESOURCE_EXHAUSTED.)

`ClientLimits.from_env` reads `KEEL_EDGE_*` variables, so `keel up` and
`keel edge` can be tuned without a flag per limit.
"""

from __future__ import annotations

import ipaddress
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from edge.auth import Caller
from edge.errors import PayloadTooLarge, TooManyFailedKeys, TooManyStreams
from services.common import settings_registry as registry
from services.common.setting import Setting, int_default, read_int, read_list, read_number

# Keys accepted from one address that stay usable while it is blocked.
TRUSTED_KEYS_PER_ADDRESS = 8

# Each limit's variable (services.common.settings_registry).
_SETTINGS: dict[str, Setting] = {
    "failed_keys_burst": registry.KEEL_EDGE_FAILED_KEYS_BURST,
    "failed_keys_window_s": registry.KEEL_EDGE_FAILED_KEYS_WINDOW_S,
    "tracked_addresses": registry.KEEL_EDGE_TRACKED_ADDRESSES,
    "streams_per_key": registry.KEEL_EDGE_STREAMS_PER_KEY,
    "streams_per_tenant": registry.KEEL_EDGE_STREAMS_PER_TENANT,
    "header_timeout_s": registry.KEEL_EDGE_HEADER_TIMEOUT_S,
    "body_timeout_s": registry.KEEL_EDGE_BODY_TIMEOUT_S,
    "body_min_bytes_per_s": registry.KEEL_EDGE_BODY_MIN_BYTES_PER_S,
    "trusted_proxies": registry.KEEL_EDGE_TRUSTED_PROXIES,
    "max_body_bytes": registry.KEEL_EDGE_MAX_BODY_BYTES,
    "max_head_bytes": registry.KEEL_EDGE_MAX_HEAD_BYTES,
    "max_headers": registry.KEEL_EDGE_MAX_HEADERS,
    "keep_alive_s": registry.KEEL_EDGE_KEEP_ALIVE_S,
}
# Room for the longest input text (edge/inputs.py) as JSON, escapes and all.
DEFAULT_MAX_BODY_BYTES = int_default(registry.KEEL_EDGE_MAX_BODY_BYTES)
# Room for a browser's cookies or a long bearer token many times over; far
# below what a client could make the edge buffer without a limit.
DEFAULT_MAX_HEAD_BYTES = int_default(registry.KEEL_EDGE_MAX_HEAD_BYTES)


@dataclass(frozen=True)
class ClientLimits:
    # Failed keys: this many per address at once, refilled over the window.
    failed_keys_burst: int = 20
    failed_keys_window_s: float = 60.0
    tracked_addresses: int = 10_000
    # Concurrent event streams (SSE and gRPC StreamEvents together).
    streams_per_key: int = 200
    streams_per_tenant: int = 1000
    # A request's head (request line and headers) must arrive within this
    # long of the connection's first byte (or of its opening).
    header_timeout_s: float = 10.0
    # A body may stall this long between chunks; in all it may take this
    # long plus a second per `body_min_bytes_per_s` bytes received (a byte
    # every few seconds never completes a body, whatever the stall limit).
    body_timeout_s: float = 10.0
    body_min_bytes_per_s: int = 500
    # Proxies whose X-Forwarded-For names the client (none: the peer is).
    trusted_proxies: tuple[str, ...] = field(default_factory=tuple)
    # The largest JSON body (HTTP) or request message (gRPC) taken.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # A request's head: its bytes (request line and headers) and header lines.
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    max_headers: int = 100
    # An idle kept-alive connection is closed after this long: more than the
    # 60 s of common load balancers, so they close first (a client reusing a
    # connection the edge is closing gets a read error instead of an answer).
    keep_alive_s: float = 75.0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, int | float) and not value > 0:
                raise ValueError(f"{_SETTINGS[item.name].name} ({item.name}) must be > 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientLimits:
        """The defaults, with whatever `KEEL_EDGE_*` variables say."""
        env = os.environ if env is None else env
        given: dict[str, object] = {}
        for item in fields(cls):
            setting = _SETTINGS[item.name]
            if setting.kind == "list":
                given[item.name] = read_list(env, setting)
            elif setting.kind == "number":
                given[item.name] = read_number(env, setting)
            else:
                given[item.name] = read_int(env, setting)
        return cls(**given)  # type: ignore[arg-type]


def too_large(limit: int, what: str = "the body") -> PayloadTooLarge:
    """The refusal of a request over `limit` bytes, naming the limit (in
    gRPC's ErrorInfo metadata too, as `limit`)."""
    refusal = PayloadTooLarge(f"{what} is larger than {limit} bytes, the most this edge takes")
    refusal.metadata["limit"] = str(limit)
    return refusal


def client_address(host: str) -> str:
    """The address failed keys are counted by: an IPv4 address as is, an
    IPv6 one by its /64 (an IPv4-mapped one as IPv4)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _Address:
    __slots__ = ("tokens", "trusted", "updated")

    def __init__(self, tokens: float, now: float) -> None:
        self.tokens = tokens
        self.updated = now
        # Key hashes accepted from this address, most recent last.
        self.trusted: list[str] = []


class FailedKeys:
    """The failed-key token buckets of one edge (see the module docstring)."""

    def __init__(self, limits: ClientLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self._burst = float(limits.failed_keys_burst)
        self._rate = limits.failed_keys_burst / limits.failed_keys_window_s
        self._capacity = limits.tracked_addresses
        self._clock = clock
        self._addresses: OrderedDict[str, _Address] = OrderedDict()

    @property
    def tracked(self) -> int:
        return len(self._addresses)

    def check_cached(self, address: str, key_hash: str) -> None:
        """A key the edge knows to be right: refused only while `address`
        is blocked and the key was never accepted from it."""
        entry = self._addresses.get(address)
        if entry is None or key_hash in entry.trusted:
            return
        self._refill(entry)
        if entry.tokens < 1:
            self._refuse(entry)
        self._trust(entry, key_hash)

    def reserve(self, address: str, key_hash: str) -> bool:
        """Before the kernel is asked about a key: takes a token (True), or
        none for a key accepted from this address before (False), or refuses."""
        entry = self._entry(address)
        if key_hash in entry.trusted:
            # Its cache entry expired, or it was revoked since: asked again
            # at no token's cost, and its answer gives no token back.
            return False
        self._refill(entry)
        if entry.tokens < 1:
            self._refuse(entry)
        entry.tokens -= 1
        return True

    def accepted(self, address: str, key_hash: str, reserved: bool) -> None:
        """The kernel accepted the key: its token comes back, and the key
        keeps working from this address while it is blocked."""
        entry = self._entry(address)
        if reserved:
            entry.tokens = min(self._burst, entry.tokens + 1)
        self._trust(entry, key_hash)

    def refund(self, address: str, reserved: bool) -> None:
        """The kernel could not tell (unavailable): the check did not count."""
        entry = self._addresses.get(address)
        if entry is not None and reserved:
            entry.tokens = min(self._burst, entry.tokens + 1)

    def rejected(self, address: str, key_hash: str) -> None:
        """The kernel refused the key: its token stays spent (and a key that
        was trusted from here, since revoked, is trusted no more)."""
        entry = self._addresses.get(address)
        if entry is not None and key_hash in entry.trusted:
            entry.trusted.remove(key_hash)

    @staticmethod
    def _trust(entry: _Address, key_hash: str) -> None:
        if key_hash in entry.trusted:
            entry.trusted.remove(key_hash)
        entry.trusted.append(key_hash)
        del entry.trusted[:-TRUSTED_KEYS_PER_ADDRESS]

    def _entry(self, address: str) -> _Address:
        entry = self._addresses.get(address)
        if entry is None:
            entry = self._addresses[address] = _Address(self._burst, self._clock())
            while len(self._addresses) > self._capacity:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(address)
        return entry

    def _refill(self, entry: _Address) -> None:
        now = self._clock()
        entry.tokens = min(self._burst, entry.tokens + (now - entry.updated) * self._rate)
        entry.updated = now

    def _refuse(self, entry: _Address) -> None:
        wait_s = max(1, math.ceil((1 - entry.tokens) / self._rate))
        raise TooManyFailedKeys(
            "too many unknown API keys from this address; "
            f"retry in {wait_s} s (keys already accepted from it still work)",
            retry_after_s=wait_s,
        )


class StreamSlot:
    """One open event stream, counted until `release` (idempotent)."""

    __slots__ = ("_key", "_streams", "_tenant")

    def __init__(self, streams: EventStreams, key: str, tenant: str) -> None:
        self._streams: EventStreams | None = streams
        self._key = key
        self._tenant = tenant

    def release(self) -> None:
        if self._streams is not None:
            self._streams._close(self._key, self._tenant)
            self._streams = None


class EventStreams:
    """Open event streams per API key and per tenant, for both front doors."""

    def __init__(self, limits: ClientLimits) -> None:
        self._per_key_limit = limits.streams_per_key
        self._per_tenant_limit = limits.streams_per_tenant
        self._per_key: dict[str, int] = {}
        self._per_tenant: dict[str, int] = {}

    @property
    def open(self) -> int:
        return sum(self._per_tenant.values())

    @property
    def tracked(self) -> int:
        """Keys and tenants with a count (0 once every stream closed)."""
        return len(self._per_key) + len(self._per_tenant)

    def acquire(self, caller: Caller) -> StreamSlot:
        key, tenant = caller.key_hash, caller.tenant_id
        if self._per_key.get(key, 0) >= self._per_key_limit:
            raise TooManyStreams(
                f"this API key has {self._per_key_limit} event streams open, the most one "
                "key may hold; close one before opening another",
                limit="streams_per_key",
                maximum=self._per_key_limit,
            )
        if self._per_tenant.get(tenant, 0) >= self._per_tenant_limit:
            raise TooManyStreams(
                f"this tenant has {self._per_tenant_limit} event streams open, the most one "
                "tenant may hold; close one before opening another",
                limit="streams_per_tenant",
                maximum=self._per_tenant_limit,
            )
        self._per_key[key] = self._per_key.get(key, 0) + 1
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        return StreamSlot(self, key, tenant)

    def _close(self, key: str, tenant: str) -> None:
        for counts, name in ((self._per_key, key), (self._per_tenant, tenant)):
            left = counts.get(name, 0) - 1
            if left > 0:
                counts[name] = left
            else:
                counts.pop(name, None)


@dataclass(frozen=True)
class Guards:
    """What one edge shares between its front doors to hold the limits."""

    limits: ClientLimits
    failed_keys: FailedKeys
    streams: EventStreams

    @classmethod
    def of(cls, limits: ClientLimits | None = None) -> Guards:
        limits = limits or ClientLimits()
        return cls(limits, FailedKeys(limits), EventStreams(limits))

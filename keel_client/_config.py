"""How a client connects, times out and reconnects: frozen, typed settings."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReconnectPolicy:
    """How `events()` reconnects after a dropped stream.

    The n-th consecutive attempt waits `initial_backoff_s * multiplier**n`,
    capped at `max_backoff_s`, minus up to `jitter` of itself at random, so
    that the clients of a restarted edge do not all come back in the same
    instant. Any message received resets the count. When no stream has
    delivered anything for `give_up_after_s` the iterator raises
    `ReconnectGaveUp` (None: it never gives up).
    """

    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2
    give_up_after_s: float | None = 60.0

    def __post_init__(self) -> None:
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("backoff needs 0 < initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1:
            raise ValueError("multiplier must be at least 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter is a fraction in [0, 1)")
        if self.give_up_after_s is not None and self.give_up_after_s <= 0:
            raise ValueError("give_up_after_s must be positive (or None: never)")

    def backoff_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before reconnect attempt `attempt` (0 for the first)."""
        # min() first: multiplier**attempt overflows a float long before an
        # hour-long outage ends.
        exponent = min(attempt, 64)
        delay = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**exponent)
        return delay * (1.0 - self.jitter * (rng or random).random())


@dataclass(frozen=True)
class ClientOptions:
    """Connection settings of `AsyncKeelClient` / `KeelClient`."""

    # Deadline of each unary call (seconds); the event stream has none.
    timeout_s: float = 30.0
    # TLS to the edge; `root_certificates` (PEM) replaces the system roots.
    tls: bool = False
    root_certificates: bytes | None = None
    reconnect: ReconnectPolicy = field(default_factory=ReconnectPolicy)
    # HTTP/2 pings on an idle connection, so an edge host that vanished
    # without closing the socket is noticed (0: no pings). Keel's servers
    # accept pings every 5 s or more.
    keepalive_s: float = 30.0
    max_message_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if self.keepalive_s < 0:
            raise ValueError("keepalive_s must be 0 (off) or positive")
        if self.root_certificates is not None and not self.tls:
            raise ValueError("root_certificates given without tls=True")

    def channel_options(self) -> list[tuple[str, int | str]]:
        options: list[tuple[str, int | str]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.primary_user_agent", "keel-client-python"),
            # gRPC's own reconnect backoff (1 s growing to 120 s by default)
            # would leave the channel refusing calls long after a restarted
            # edge is back; keep it within the iterator's own schedule.
            ("grpc.initial_reconnect_backoff_ms", int(self.reconnect.initial_backoff_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(self.reconnect.initial_backoff_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.reconnect.max_backoff_s * 1000)),
        ]
        if self.keepalive_s:
            options += [
                ("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.max_pings_without_data", 0),
            ]
        return options

"""An input racing the end of a sticky window, in every order, against the
real store (both backends, a controllable clock).

Runtime A answered input 1 under epoch 1. Then six things happen, each
once, in every one of their 720 orders: A finishes asking for a window (by
a Finish, or on PostgreSQL by the ledger's append of its answer, as a
runner's turn is settled there, with a Finish when the ledger could not); the
window's time passes; input 2 arrives; A's LeaseStream ends (no wake can
reach it); runtime B claims whatever is claimable and answers it; A runs a
wake it was given, or the lease held on for it when input 2 came before
its Finish. Afterwards runners keep claiming until nothing is owed.

A model runner answers, in one step, the inputs announced so far that no
turn answered, and only under a lease that is valid at that moment. In
every order the store must keep:
- one owner: a lease is issued only when no other is valid, and a wake
  goes to the runtime that kept the window, with its epoch, before its end;
- a claim always issues a new epoch; a kept session holds no slot;
- no input left behind a window: right after input 2 arrives the session
  is held (its holder will see it) or claimable now;
- exactly once: input 2 is answered, by exactly one turn.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import pytest

from kernel.domain import Lease, LeaseState
from kernel.errors import EpochSuperseded, LeaseLost
from services.common.config import Settings
from tests.support.kernel_stores import SETTLE, Stores, open_stores

TTL = 1_000
STICKY_MS = 500
EVENTS = ("finish", "window_passes", "input", "stream_ends", "b_claims", "a_runs")
A, B = "A", "B"


@dataclass
class Race:
    stores: Stores
    prefix: str
    reachable: set[str] = field(default_factory=lambda: {A, B})
    inputs: int = 1
    # input seq -> the epoch whose turn answered it
    answers: dict[int, int] = field(default_factory=dict)
    leases: list[Lease] = field(default_factory=list)
    ended: set[int] = field(default_factory=set)
    kept: tuple[int, int] | None = None  # (epoch, until)
    # A's successful turns are settled as a runner's are on PostgreSQL: by
    # the ledger's append of the answer where it can, else by a Finish.
    by_ledger: bool = False
    settled_by_the_ledger: int = 0

    @property
    def session(self) -> str:
        return f"{self.prefix}-s"

    @property
    def tenant(self) -> str:
        return f"{self.prefix}-t"

    def runtime(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def valid(self, lease: Lease) -> bool:
        return (
            lease.epoch not in self.ended
            and lease is self.leases[-1]
            and lease.expires_at_ms > self.stores.clock.now
        )

    def took(self, lease: Lease, woken: bool) -> None:
        assert not any(self.valid(held) for held in self.leases), "two owners of one session"
        if woken:
            assert self.kept is not None, "a wake without a window"
            epoch, until = self.kept
            assert lease.runtime_id == self.runtime(A) and lease.epoch == epoch
            assert until > self.stores.clock.now, "a wake after the window's end"
        else:
            assert lease.epoch > self.leases[-1].epoch, "a claim without a new epoch"
        self.kept = None
        self.leases.append(lease)

    def answer_and_finish(self, lease: Lease, sticky: bool, read_through: int = 0) -> None:
        """One turn under `lease`: answers what is owed (or what it read
        earlier: `read_through`), then finishes."""
        assert self.valid(lease)
        read_through = read_through or self.inputs
        for seq in range(1, read_through + 1):
            self.answers.setdefault(seq, lease.epoch)
        if sticky and self.by_ledger and self.settled_by_ledger(lease, read_through):
            return
        result = self.stores.leases.finish(
            self.session,
            lease.epoch,
            lease.runtime_id,
            read_through,
            sticky_ms=STICKY_MS if sticky else 0,
        )
        record = self.stores.leases.record(self.session)
        assert record is not None
        if result.continued:
            # A newer input came before this Finish: held on, same epoch,
            # for the same runtime to answer at once.
            assert sticky and record.input_seq > read_through
            assert record.live(self.stores.clock.now)
            assert (record.epoch, record.runtime_id) == (lease.epoch, lease.runtime_id)
            self.leases[-1] = replace(lease, expires_at_ms=record.expires_at_ms)
            return
        self.ended.add(lease.epoch)
        if result.sticky_until_ms:
            assert record.input_seq <= read_through, "kept with a newer input owed"
            self.kept = (lease.epoch, result.sticky_until_ms)
        else:
            assert record.queued == (record.input_seq > read_through), "an input dropped"

    def settled_by_ledger(self, lease: Lease, read_through: int) -> bool:
        """The settlement the answer's append carries (kernel/turn_settlement.py);
        False when it left the turn to a Finish."""
        rows = self.stores.database.run(
            lambda tx: tx.rows(
                SETTLE,
                (
                    [self.session],
                    [lease.epoch],
                    [lease.runtime_id],
                    [read_through],
                    [STICKY_MS],
                    self.stores.clock.now,
                ),
            )
        )
        if not rows:
            return False
        record = self.stores.leases.record(self.session)
        assert record is not None and record.state is LeaseState.STICKY
        assert record.input_seq <= read_through, "kept with a newer input owed"
        self.ended.add(lease.epoch)
        self.kept = (lease.epoch, int(rows[0][1]))
        self.settled_by_the_ledger += 1
        return True

    # -- the events --

    def finish(self) -> None:
        """A's first turn, which read input 1 only, finishes."""
        first = self.leases[0]
        if self.valid(first):
            self.answer_and_finish(first, sticky=True, read_through=1)

    def window_passes(self) -> None:
        self.stores.clock.advance(STICKY_MS + 1)

    def input(self) -> None:
        self.inputs += 1
        woken = self.stores.leases.enqueue(
            self.session,
            self.tenant,
            self.inputs,
            False,
            lambda runtime_id: runtime_id.rpartition("-")[2] in self.reachable,
        )
        if woken is not None:
            self.took(woken.lease, woken=True)
        now = self.stores.clock.now
        record = self.stores.leases.record(self.session)
        assert record is not None
        assert record.state is not LeaseState.STICKY, "an input left behind a window"
        assert record.live(now) or record.claimable(now), "an input stranded"
        if not record.live(now):
            self.kept = None

    def stream_ends(self) -> None:
        self.reachable.discard(A)

    def b_claims(self) -> None:
        self.stores.leases.sweep()
        lease = self.stores.leases.claim(self.runtime(B))
        if lease is None:
            return
        assert lease.session_id == self.session, lease
        self.took(lease, woken=False)
        self.answer_and_finish(lease, sticky=False)

    def a_runs(self) -> None:
        """A runs a turn under the lease it holds (woken, or held on)."""
        held = self.leases[-1]
        if held.runtime_id == self.runtime(A) and self.valid(held):
            self.answer_and_finish(held, sticky=True)

    def settle(self) -> None:
        """Runners keep claiming (and A runs its wake) until nothing is owed."""
        for _ in range(5):
            self.a_runs()
            if len(self.answers) == self.inputs:
                return
            self.stores.clock.advance(TTL + STICKY_MS + 1)
            self.b_claims()

    def stale_holder_refused(self) -> None:
        """Once another epoch has been issued, A's kept epoch is refused."""
        if self.leases[-1].epoch == 1:
            return
        with pytest.raises((EpochSuperseded, LeaseLost)):
            self.stores.leases.finish(self.session, 1, self.runtime(A), self.inputs)


def test_an_input_racing_a_sticky_window_is_answered_exactly_once(settings: Settings) -> None:
    _every_order(settings, by_ledger=False)


def test_so_it_is_when_the_ledger_settles_the_answers(pg_settings: Settings) -> None:
    _every_order(pg_settings, by_ledger=True)


def _every_order(settings: Settings, by_ledger: bool) -> None:
    stores = open_stores(settings, lease_ms=TTL)
    settled_by_the_ledger = 0
    try:
        for number, order in enumerate(itertools.permutations(EVENTS)):
            race = Race(stores, f"o{number:03d}", by_ledger=by_ledger)
            stores.register(race.runtime(A), race.runtime(B))
            stores.tenants.create_tenant(race.tenant, "")
            stores.leases.enqueue(race.session, race.tenant, 1, False)
            first = stores.leases.claim(race.runtime(A))
            assert first is not None and first.session_id == race.session
            race.leases.append(first)
            for event in order:
                getattr(race, event)()
            race.settle()
            assert race.answers.keys() == {1, 2}, (order, race.answers)
            in_use, _ = stores.leases.slots(race.tenant)
            assert in_use == stores.leases.held_count(race.tenant), order
            race.stale_holder_refused()
            settled_by_the_ledger += race.settled_by_the_ledger
            # Nothing of this order is left for the next one to claim.
            stores.clock.advance(TTL + STICKY_MS + 1)
            stores.leases.sweep()
    finally:
        stores.database.close()
    # Both ways were taken: the ledger settled some turns, Finish the rest.
    assert (settled_by_the_ledger > 0) == by_ledger, settled_by_the_ledger

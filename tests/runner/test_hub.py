"""The partial hub: replay to a late watcher, grace after release, bounds.

The hub is in-memory and framework-free, so it is driven directly: an
attempt publishes, a watch (what `WatchSession` serves) reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.runner import hub as hub_module
from services.runner.hub import Partial, PartialHub, ReplayEnd, StatusChange, WatchEvent

SESSION = "t:s-1"


def text(word: str, epoch: int = 1, attempt_id: str = "a1") -> Partial:
    return Partial("g-1", "text", word, epoch, attempt_id)


def started(hub: PartialHub, words: list[str], epoch: int = 1, attempt_id: str = "a1") -> None:
    """An attempt that began and streamed `words`."""
    hub.publish(SESSION, StatusChange("running", epoch))
    for word in words:
        hub.publish(SESSION, text(word, epoch, attempt_id))


async def take(events: AsyncIterator[WatchEvent], count: int) -> list[WatchEvent]:
    return [await anext(events) for _ in range(count)]


async def rest(events: AsyncIterator[WatchEvent]) -> list[WatchEvent]:
    return [event async for event in events]


async def test_a_late_watcher_gets_status_then_every_partial_then_live() -> None:
    hub = PartialHub()
    started(hub, ["Hello", ", "])
    events = hub.watch(SESSION)
    assert await take(events, 4) == [
        StatusChange("running", 1),
        text("Hello"),
        text(", "),
        ReplayEnd(2),
    ]
    hub.publish(SESSION, text("world"))
    hub.publish(SESSION, StatusChange("compacting", 1))
    assert await take(events, 2) == [text("world"), StatusChange("compacting", 1)]
    hub.release(SESSION)
    assert await rest(events) == []


async def test_the_first_event_is_the_current_status_not_a_past_one() -> None:
    hub = PartialHub()
    started(hub, ["a"])
    hub.publish(SESSION, StatusChange("compacting", 1))
    hub.publish(SESSION, text("b"))
    events = hub.watch(SESSION)
    # Past status changes are not replayed: only where the session is now.
    assert await take(events, 4) == [
        StatusChange("compacting", 1),
        text("a"),
        text("b"),
        ReplayEnd(2),
    ]
    await events.aclose()


async def test_a_live_watcher_misses_nothing_of_a_burst() -> None:
    """An instant model publishes thousands of tokens without yielding; the
    watcher reads them from the attempt's log, not from a bounded queue."""
    hub = PartialHub()
    started(hub, [])
    events = hub.watch(SESSION)
    assert await take(events, 2) == [StatusChange("running", 1), ReplayEnd(0)]
    words = [f"w{i} " for i in range(5000)]
    for word in words:
        hub.publish(SESSION, text(word))
    hub.release(SESSION)
    got = await rest(events)
    assert [event.text for event in got if isinstance(event, Partial)] == words


async def test_an_ended_attempt_is_replayed_to_whoever_names_it() -> None:
    hub = PartialHub()
    started(hub, ["Hello", "!"], epoch=3, attempt_id="a3")
    hub.release(SESSION)

    # Not owned any more: an unnamed watch (the status question) has nothing.
    assert not hub.owns(SESSION)
    assert not hub.watchable(SESSION)
    # Another attempt's name does not match.
    assert not hub.watchable(SESSION, 2)
    assert not hub.watchable(SESSION, 3, "other")

    assert hub.watchable(SESSION, 3, "a3")
    assert await rest(hub.watch(SESSION, 3, "a3")) == [
        StatusChange("running", 3),
        text("Hello", 3, "a3"),
        text("!", 3, "a3"),
        ReplayEnd(2),
    ]
    # By epoch alone too, as often as asked within the grace period.
    assert len(await rest(hub.watch(SESSION, 3))) == 4


async def test_an_ended_attempt_is_replayed_while_the_next_one_runs() -> None:
    hub = PartialHub()
    started(hub, ["Hello, "], epoch=1, attempt_id="a1")
    hub.release(SESSION)
    started(hub, ["Hello, world!"], epoch=2, attempt_id="a2")

    old = await rest(hub.watch(SESSION, 1, "a1"))
    assert old == [StatusChange("running", 1), text("Hello, ", 1, "a1"), ReplayEnd(1)]

    current = hub.watch(SESSION, 2, "a2")
    assert await take(current, 3) == [
        StatusChange("running", 2),
        text("Hello, world!", 2, "a2"),
        ReplayEnd(1),
    ]
    hub.release(SESSION)
    assert await rest(current) == []


async def test_a_watch_of_the_attempt_as_it_ends_gets_the_tail_then_ends() -> None:
    hub = PartialHub()
    started(hub, ["a"])
    events = hub.watch(SESSION, 1, "a1")
    assert await take(events, 3) == [StatusChange("running", 1), text("a"), ReplayEnd(1)]
    hub.publish(SESSION, text("b"))
    hub.release(SESSION)
    assert await rest(events) == [text("b")]


async def test_an_attempt_without_partials_leaves_nothing_to_replay() -> None:
    hub = PartialHub()
    started(hub, [])
    hub.release(SESSION)
    assert not hub.watchable(SESSION, 1)


async def test_the_log_keeps_the_newest_items_within_its_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hub_module, "MAX_LOG_ITEMS", 10)
    hub = PartialHub()
    words = [f"w{i}" for i in range(25)]
    started(hub, words)
    got = await take(hub.watch(SESSION), 12)
    assert got[0] == StatusChange("running", 1)
    assert [event.text for event in got[1:11] if isinstance(event, Partial)] == words[-10:]
    assert got[11] == ReplayEnd(10)


async def test_the_log_is_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    item = hub_module.ITEM_OVERHEAD_BYTES + 1000
    monkeypatch.setattr(hub_module, "MAX_LOG_BYTES", 3 * item)
    hub = PartialHub()
    words = [str(i) * 1000 for i in range(1, 6)]
    started(hub, words)
    got = await take(hub.watch(SESSION), 4)
    assert [event.text for event in got[1:] if isinstance(event, Partial)] == words[-3:]


async def test_a_watcher_that_falls_behind_the_bound_skips_what_was_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hub_module, "MAX_LOG_ITEMS", 10)
    hub = PartialHub()
    started(hub, ["w0"])
    events = hub.watch(SESSION)
    assert await take(events, 3) == [StatusChange("running", 1), text("w0"), ReplayEnd(1)]
    words = [f"w{i}" for i in range(1, 31)]
    for word in words:
        hub.publish(SESSION, text(word))
    hub.release(SESSION)
    got = await rest(events)
    assert [event.text for event in got if isinstance(event, Partial)] == words[-10:]


async def test_the_grace_period_is_bounded_in_sessions_and_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hub_module, "GRACE_SESSIONS", 2)
    hub = PartialHub()
    for session in ("t:a", "t:b", "t:c"):
        hub.publish(session, StatusChange("running", 1))
        hub.publish(session, text("x"))
        hub.release(session)
    assert [hub.watchable(s, 1) for s in ("t:a", "t:b", "t:c")] == [False, True, True]

    monkeypatch.setattr(hub_module, "GRACE_S", 0.0)
    hub.publish("t:d", StatusChange("running", 1))
    hub.publish("t:d", text("x"))
    hub.release("t:d")
    # Past its grace period an ended attempt is gone.
    assert not hub.watchable("t:d", 1)
    assert hub.watchable("t:c", 1)


async def test_the_grace_period_is_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each ended log holds a status and a 1000-character partial: room for one.
    one_log = 2 * hub_module.ITEM_OVERHEAD_BYTES + 1000
    monkeypatch.setattr(hub_module, "GRACE_BYTES", one_log + one_log // 2)
    hub = PartialHub()
    for session in ("t:a", "t:b"):
        hub.publish(session, StatusChange("running", 1))
        hub.publish(session, text("x" * 1000))
        hub.release(session)
    assert [hub.watchable(s, 1) for s in ("t:a", "t:b")] == [False, True]


async def test_close_all_ends_every_watch_and_forgets_ended_attempts() -> None:
    hub = PartialHub()
    started(hub, ["a"])
    events = hub.watch(SESSION)
    assert await take(events, 3) == [StatusChange("running", 1), text("a"), ReplayEnd(1)]
    hub.publish("t:other", StatusChange("running", 1))
    hub.publish("t:other", text("b"))
    hub.release("t:other")
    hub.close_all()
    assert await rest(events) == []
    assert not hub.watchable(SESSION, 1)
    assert not hub.watchable("t:other", 1)

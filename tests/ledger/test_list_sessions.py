"""Listing sessions page by page: the cursor, not a page's length, says when
the listing is complete (owing_only filters after a page is scanned)."""

from __future__ import annotations

from services.ledger import FactToAppend, LedgerClient


async def test_owing_sessions_are_all_found_across_short_pages(client: LedgerClient) -> None:
    owing = set()
    for n in range(12):
        session_id = f"list-{n:02d}"
        await client.create_session(session_id, "tenant-a")
        if n % 5 == 4:  # list-04, list-09: sparse among idle sessions
            await client.append(
                session_id, [FactToAppend("input", {"text": "hi", "requestId": "r"})]
            )
            owing.add(session_id)

    found: list[str] = []
    pages = 0
    after = ""
    while True:
        page = await client.list_sessions(after, limit=3, owing_only=True)
        pages += 1
        assert len(page.sessions) <= 3
        found.extend(s.session_id for s in page.sessions)
        if not page.next_after:
            break
        assert page.next_after > after
        after = page.next_after
    assert found == sorted(owing)
    # Some pages came back empty yet were not the last.
    assert pages > len(owing)


async def test_the_last_page_has_no_cursor(client: LedgerClient) -> None:
    for n in range(4):
        await client.create_session(f"tail-{n}", "tenant-a")
    first = await client.list_sessions("tail-", limit=3)
    assert [s.session_id for s in first.sessions] == ["tail-0", "tail-1", "tail-2"]
    assert first.next_after == "tail-2"
    last = await client.list_sessions(first.next_after, limit=3)
    assert [s.session_id for s in last.sessions] == ["tail-3"]
    assert last.next_after == ""

"""Per-tenant blob quotas and validated content types.

The attack: one tenant declared 500 blobs of 64 MiB in under a second (32 GiB
reserved, no body sent), and `contentType` took CR/LF and 900 KB strings. A
create now counts the declared length against the tenant's quota (1 GiB and
10,000 blobs by default, KEEL_BLOB_QUOTA_BYTES / KEEL_BLOB_QUOTA_COUNT), is
refused with 413 `blob_quota_exceeded` once it would pass it, and leaves
nothing behind; other tenants are not affected.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import psycopg
import pytest
from psycopg import sql

from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from services.blobs import (
    DEFAULT_QUOTA_BYTES,
    MAX_BLOB_BYTES,
    BlobQuota,
    BlobQuotaExceeded,
    blob_store,
)
from services.common.config import Settings
from tests.support.edge_stack import ADMIN_KEY, Stack
from tests.support.replicas import start_at_once

OTHER_KEY = "blob-quota-tenant-b-key-0123456789"


def _held(settings: Settings, tenant: str) -> tuple[int, int]:
    """What the store's table holds for `tenant`: (blobs, declared bytes)."""
    table = sql.Identifier(settings.pg_schema, "edge_blobs")
    with psycopg.connect(settings.database_url) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*), COALESCE(sum(length), 0) FROM {} WHERE tenant_id = %s"
            ).format(table),
            (tenant,),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def _create(
    http: httpx.AsyncClient, length: int, content_type: str = "image/png"
) -> httpx.Response:
    return await http.post("/v1/blobs", json={"length": length, "contentType": content_type})


async def test_declared_sizes_count_so_500_blobs_of_64_mib_stop_at_the_quota(stack: Stack) -> None:
    attempts = 500
    # The key is checked once, as a client's first request would (the edge
    # then knows it, and 500 requests at once are not 500 key checks).
    assert (await stack.http.get("/v1/sessions")).status_code == 200
    answers = await asyncio.gather(*(_create(stack.http, MAX_BLOB_BYTES) for _ in range(attempts)))
    statuses = [a.status_code for a in answers]
    fit = DEFAULT_QUOTA_BYTES // MAX_BLOB_BYTES  # 16
    assert statuses.count(201) == fit, sorted(set(statuses))
    assert statuses.count(413) == attempts - fit, sorted(set(statuses))
    refused = next(a for a in answers if a.status_code == 413).json()["error"]
    assert refused["code"] == "blob_quota_exceeded", refused
    assert str(DEFAULT_QUOTA_BYTES) in refused["message"]
    # Refused creates left nothing behind: only the admitted blobs exist.
    assert _held(stack.cluster.settings, "default") == (fit, fit * MAX_BLOB_BYTES)

    # Another tenant has a quota of its own.
    await stack.cluster.kernel.create_tenant("tenant-b")
    await stack.cluster.kernel.create_api_key("tenant-b", OTHER_KEY)
    async with stack.client(OTHER_KEY) as other:
        assert (await _create(other, MAX_BLOB_BYTES)).status_code == 201


@pytest.fixture
async def small_quota_edge(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[EdgeServer]:
    """An edge started where the operator set KEEL_BLOB_QUOTA_*."""
    monkeypatch.setenv("KEEL_BLOB_QUOTA_COUNT", "3")
    monkeypatch.setenv("KEEL_BLOB_QUOTA_BYTES", "2000")
    cluster = stack.cluster
    edge = await EdgeServer(
        cluster.settings, EdgeConfig(cluster.ledger_server.target, cluster.kernel_server.target)
    ).start()
    yield edge
    await edge.stop()


async def test_the_operator_sets_the_count_and_bytes_quotas(
    stack: Stack, small_quota_edge: EdgeServer
) -> None:
    async with httpx.AsyncClient(
        base_url=small_quota_edge.url,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    ) as http:
        assert (await _create(http, 600)).status_code == 201
        too_big = await _create(http, 1401)  # 600 + 1401 > 2000 bytes
        assert too_big.status_code == 413 and "2000" in too_big.json()["error"]["message"]
        assert (await _create(http, 400)).status_code == 201
        assert (await _create(http, 1)).status_code == 201
        too_many = await _create(http, 1)  # a fourth blob, with bytes to spare
        assert too_many.status_code == 413, too_many.text
        assert too_many.json()["error"]["code"] == "blob_quota_exceeded"
        assert "quota is 3" in too_many.json()["error"]["message"]
    assert _held(stack.cluster.settings, "default") == (3, 1001)


def test_concurrent_creates_of_one_tenant_never_pass_the_quota(settings: Settings) -> None:
    store = blob_store(settings, BlobQuota(max_blobs=5, max_bytes=10_000))

    def create() -> str:
        return store.create("t1", 100, "text/plain").id

    made, refused = start_at_once(create, count=12)
    assert len(made) == 5 and len(refused) == 7
    assert all(isinstance(error, BlobQuotaExceeded) for error in refused)
    # What was admitted is all there and whole; another tenant is unaffected.
    assert {store.get("t1", blob_id).length for blob_id in made} == {100}
    assert store.create("t2", 100, "text/plain").length == 100


def test_the_disk_store_counts_what_it_already_holds(sqlite_settings: Settings) -> None:
    quota = BlobQuota(max_blobs=2, max_bytes=10_000)
    blob_store(sqlite_settings, quota).create("t1", 10, "text/plain")
    # A restarted edge counts the blobs on disk, not from zero.
    again = blob_store(sqlite_settings, quota)
    again.create("t1", 10, "text/plain")
    with pytest.raises(BlobQuotaExceeded):
        again.create("t1", 10, "text/plain")


def test_quota_settings_are_positive_integers() -> None:
    assert BlobQuota.from_env({}) == BlobQuota(10_000, 1 << 30)
    assert BlobQuota.from_env({"KEEL_BLOB_QUOTA_COUNT": "7"}).max_blobs == 7
    for bad in ("0", "-1", "lots", "1e9", "²"):
        with pytest.raises(ValueError, match="KEEL_BLOB_QUOTA_BYTES"):
            BlobQuota.from_env({"KEEL_BLOB_QUOTA_BYTES": bad})


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain\r\nX-Injected: 1",
        "text/plain\n",  # `$` used to accept a trailing newline
        "text/plain\r",
        'image/png; name="a\nb"',
        "t" * 200 + "/" + "p" * 100,  # longer than 255
        "text/" + "x" * 900_000,
        "no-slash",
        "text/plain; charset=ütf-8",
        "",
    ],
)
async def test_a_content_type_that_is_not_a_media_type_is_refused(
    stack: Stack, content_type: str
) -> None:
    response = await _create(stack.http, 10, content_type)
    assert response.status_code == 400, response.text
    assert "contentType" in response.json()["error"]["message"]
    assert _held(stack.cluster.settings, "default") == (0, 0)


async def test_media_types_with_parameters_are_accepted(stack: Stack) -> None:
    for content_type in ("text/plain; charset=utf-8", "application/vnd.api+json", "image/png"):
        created = await _create(stack.http, 10, content_type)
        assert created.status_code == 201, (content_type, created.text)
        assert created.json()["contentType"] == content_type

"""A dev key `keel up` kept in its data dir is revoked when a start is given
another one through KEEL_DEV_KEY: the operator chose a new key, and the old
one must not stay valid beside it (issue 24, point 14: "reuse or revoke the
previous dev key"; reuse is tests/edge/test_up_dev_key.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.keel_up import keel_up

pytestmark = pytest.mark.slow

CHOSEN = "chosen-dev-key-0123456789abcdef"


def status_with(url: str, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{url}/v1/runtime/status", headers=headers).status_code


def test_a_kept_dev_key_is_revoked_when_another_is_chosen(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with keel_up(data_dir, None) as first:
        kept = first.key
        assert status_with(first.url, kept) == 200

    with keel_up(data_dir, CHOSEN) as second:
        assert second.key == CHOSEN
        assert status_with(second.url, CHOSEN) == 200
        assert status_with(second.url, kept) == 401
        listed = httpx.get(f"{second.url}/v1/keys", headers={"Authorization": f"Bearer {CHOSEN}"})
        valid = [k for k in listed.json()["keys"] if k["operator"] and not k.get("revokedAtMs")]
        assert len(valid) == 1, valid

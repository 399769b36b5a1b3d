"""`keel up` without KEEL_DEV_KEY keeps its dev key in the data dir and uses
it again on the next start: restarts leave one valid dev operator key, not
one more each (8 starts once left 8 valid operator keys). A dev key revoked
by its operator is replaced by a new one on the next start, never revived;
one replaced by a KEEL_DEV_KEY the operator chose is revoked, not left valid
beside it.
"""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest

from tests.support.keel_up import keel_up

pytestmark = pytest.mark.slow

CHOSEN = "chosen-dev-key-0123456789abcdef"


def valid_operator_keys(url: str, key: str) -> list[str]:
    """The ids of every unrevoked operator key (asked with `key`)."""
    answer = httpx.get(f"{url}/v1/keys", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return [k["id"] for k in answer.json()["keys"] if k["operator"] and not k.get("revokedAtMs")]


def status_with(url: str, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{url}/v1/runtime/status", headers=headers).status_code


def test_restarts_keep_one_valid_dev_operator_key(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with keel_up(data_dir, None) as first:
        first_key = first.key
        assert len(valid_operator_keys(first.url, first_key)) == 1

    with keel_up(data_dir, None) as second:
        assert second.key == first_key, "the kept dev key is used again"
        [kept_id] = valid_operator_keys(second.url, second.key)
        assert stat.S_IMODE((data_dir / "dev-key").stat().st_mode) == 0o600
        # Its operator revokes it: the next start makes a new one.
        revoked = httpx.delete(
            f"{second.url}/v1/keys/{kept_id}", headers={"Authorization": f"Bearer {second.key}"}
        )
        assert revoked.status_code in (200, 204), revoked.text

    with keel_up(data_dir, None) as third:
        assert third.key != first_key
        assert len(valid_operator_keys(third.url, third.key)) == 1
        assert status_with(third.url, first_key) == 401


def test_a_kept_dev_key_is_revoked_when_another_is_chosen(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with keel_up(data_dir, None) as first:
        kept = first.key
        assert status_with(first.url, kept) == 200

    with keel_up(data_dir, CHOSEN) as second:
        assert second.key == CHOSEN
        assert status_with(second.url, CHOSEN) == 200
        assert status_with(second.url, kept) == 401
        assert len(valid_operator_keys(second.url, CHOSEN)) == 1

"""A loadout naming a secret or a host the operator did not allow is refused
when it is written, through both front doors, naming the field.

The stack's operator granted tenant "default" nothing and allows only the
official provider APIs (the defaults): so `apiKeyEnv` may name no variable
at all, an openai model without `baseUrl` cannot read OPENAI_API_KEY, and
`baseUrl` may not point anywhere else. Nothing refused is stored.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.edge_stack import Stack
from tests.support.front_doors import FrontDoor, Refused

ATTACKER = "http://attacker.example:8443/v1"


def _openai(**fields: Any) -> dict[str, Any]:
    return {"model": {"provider": "openai", "name": "gpt-test", **fields}}


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    # (case, document, field, what the message names)
    ("Keel's dev key", _openai(apiKeyEnv="KEEL_DEV_KEY"), "model.apiKeyEnv", "Keel's own"),
    (
        "the internal token",
        _openai(apiKeyEnv="KEEL_INTERNAL_TOKEN", baseUrl="https://api.openai.com/v1"),
        "model.apiKeyEnv",
        "Keel's own",
    ),
    (
        "an ungranted provider key",
        _openai(apiKeyEnv="OPENAI_API_KEY"),
        "model.apiKeyEnv",
        "KEEL_SECRET_GRANTS",
    ),
    ("the ungranted default key", _openai(), "model.apiKeyEnv", "KEEL_SECRET_GRANTS"),
    (
        "the ungranted anthropic default key",
        {"model": {"provider": "anthropic", "name": "claude-test"}},
        "model.apiKeyEnv",
        "KEEL_SECRET_GRANTS",
    ),
    (
        "a host of the tenant's own",
        _openai(baseUrl=ATTACKER),
        "model.baseUrl",
        "KEEL_PROVIDER_ORIGINS",
    ),
    (
        "a host of its own with a key",
        _openai(baseUrl=ATTACKER, apiKeyEnv="OPENAI_API_KEY"),
        "model.baseUrl",
        "KEEL_PROVIDER_ORIGINS",
    ),
    (
        "the cloud metadata service",
        _openai(baseUrl="http://169.254.169.254/latest"),
        "model.baseUrl",
        "KEEL_PROVIDER_ORIGINS",
    ),
    (
        "the official host over plain http",
        _openai(baseUrl="http://api.openai.com/v1"),
        "model.baseUrl",
        "KEEL_PROVIDER_ORIGINS",
    ),
]


@pytest.mark.parametrize(
    ("document", "field", "named"),
    [pytest.param(document, field, named, id=case) for case, document, field, named in REFUSED],
)
async def test_a_loadout_naming_a_forbidden_secret_or_host_is_refused(
    door: FrontDoor, document: dict[str, Any], field: str, named: str
) -> None:
    before, _ = await door.get_loadout()
    with pytest.raises(Refused) as refused:
        await door.put_loadout(document)
    assert refused.value.outcome == "invalid_argument", refused.value
    if door.name == "grpc":  # ErrorInfo names it too (HTTP: in the message)
        assert refused.value.field == field, refused.value
    assert field in refused.value.message and named in refused.value.message, refused.value
    assert (await door.get_loadout())[0] == before, "nothing refused is stored"


async def test_http_names_the_field_in_a_400(stack: Stack) -> None:
    response = await stack.http.put("/v1/loadout", json=_openai(apiKeyEnv="KEEL_DEV_KEY"))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_loadout" and "model.apiKeyEnv" in error["message"]


async def test_what_needs_no_secret_elsewhere_is_accepted(door: FrontDoor) -> None:
    # The official API at its own origin, with no key named: the runner will
    # refuse to call it without a granted key, but there is nothing to refuse
    # here (a `baseUrl` says no key is needed unless one is granted).
    for document in (
        {"systemPrompt": "Be brief."},
        {"model": {"provider": "scripted", "name": "s"}},
        _openai(baseUrl="https://api.openai.com/v1"),
        {"model": {"provider": "anthropic", "name": "c", "baseUrl": "https://api.anthropic.com"}},
    ):
        assert await door.put_loadout(document) > 0, document

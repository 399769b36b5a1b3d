"""A provider call never follows a redirect to another origin.

The operator allows one origin (KEEL_PROVIDER_ORIGINS); the model there
answers every request with a redirect to a second loopback server, a
different port and so a different origin, never allowed. Both SDKs follow
redirects by default, which would send the whole request body (the tenant's
conversation) to that origin. The adapters, built as the runner builds them
(`provider_from_loadout`, over real HTTP through the SDKs), must refuse the
redirect: the second server receives nothing, and the call fails with an
error that says what happened and is not retried.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from agent_io.providers import ModelRequest, ProviderError, provider_from_loadout
from services.common.secrets import SecretPolicy
from tests.support.provider_listener import ProviderListener
from tests.support.redirecting_origin import RedirectingOrigin

TENANT = "acme"
KEY_VARIABLE = "ACME_MODEL_KEY"
KEY = "acme-model-key-never-redirected-4d2c"
SECRET_TEXT = "the tenant's conversation, for the allowed origin only"
# The redirects that keep the method and body (307, 308), and those after
# which an HTTP client would send a GET to the new origin (301, 302, 303).
REDIRECTS = (307, 308, 301, 302, 303)
BASE_PATHS = {"openai": "/v1", "anthropic": ""}


@pytest.fixture
async def elsewhere() -> AsyncIterator[ProviderListener]:
    """The origin a redirect points to: records anything that reaches it."""
    async with ProviderListener() as listener:
        yield listener


async def _call(kind: str, origin: RedirectingOrigin) -> ProviderError:
    policy = SecretPolicy().with_grant(TENANT, KEY_VARIABLE).with_origin(origin.url)
    provider = provider_from_loadout(
        {
            "provider": kind,
            "name": "redirected-model",
            "baseUrl": f"{origin.url}{BASE_PATHS[kind]}",
            "apiKeyEnv": KEY_VARIABLE,
        },
        tenant_id=TENANT,
        secrets=policy,
        env={KEY_VARIABLE: KEY},
    )
    request = ModelRequest(system="", messages=({"role": "user", "content": SECRET_TEXT},))
    try:
        with pytest.raises(ProviderError) as failed:
            async for _ in provider.stream(request):
                pass
    finally:
        await provider.aclose()
    return failed.value


@pytest.mark.parametrize("status", REDIRECTS)
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_redirect_to_another_origin_is_not_followed(
    kind: str, status: int, elsewhere: ProviderListener
) -> None:
    async with RedirectingOrigin(elsewhere.url, status) as origin:
        error = await _call(kind, origin)
        assert len(origin.paths) == 1, "the allowed origin was called once"
    assert elsewhere.seen == [], "nothing of the request reached the other origin"
    assert not error.retryable, "a redirect is the configuration's fault: asking again sends it"
    assert error.status == status
    message = str(error)
    assert f"redirect ({status})" in message and elsewhere.url in message, message
    assert "baseUrl" in message, message

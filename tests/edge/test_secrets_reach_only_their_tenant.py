"""A tenant's model reaches only what the operator granted that tenant.

The attack: a tenant writes a loadout whose `baseUrl` is a host of its own
and whose `apiKeyEnv` names a variable of the runner holding someone else's
secret (another tenant's provider key, Keel's dev key, the internal token),
and receives it as a bearer token. Here the tenant's listener is allowed
(KEEL_PROVIDER_ORIGINS) and the tenant is granted one variable of its own
(KEEL_SECRET_GRANTS); a real runner process has the other secrets in its
environment, including the SDKs' own ambient settings. The listener must
see the granted value and nothing else, in any header or body; a grant the
operator withdraws (runner restarted with another policy) fails the
tenant's attempts cleanly, with nothing sent to the listener.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from services.common.config import Settings
from services.common.secrets import DEFAULT_PROVIDER_ORIGINS, SecretPolicy
from services.ledger import CommittedFact
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.internal_auth import TEST_TOKEN
from tests.support.polling import eventually
from tests.support.processes import ChildProcess
from tests.support.provider_listener import ANSWER, ProviderListener

TENANT = "acme"
TENANT_ADMIN = "acme-admin-key-for-secret-tests-0123"
GRANTED_VARIABLE = "ACME_MODEL_KEY"
GRANTED_VALUE = "acme-own-provider-key-7f3a9c51"
# In the runner's environment beside the granted one: none may leave it.
OTHER_SECRETS = {
    "OPENAI_API_KEY": "default-tenant-openai-key-91b2e4",  # granted to "default"
    "GLOBEX_MODEL_KEY": "globex-provider-key-c04d88",  # granted to "globex"
    "KEEL_DEV_KEY": "keel-dev-key-never-leaves-5e6f0a",
    # What the SDKs would read on their own and send with every request.
    "OPENAI_ORG_ID": "org-of-the-operator-8a1b33",
    "OPENAI_PROJECT_ID": "proj-of-the-operator-2c3d44",
    "OPENAI_CUSTOM_HEADERS": "X-Operator-Secret: operator-header-secret-77aa55",
    "ANTHROPIC_AUTH_TOKEN": "anthropic-operator-token-99ee11",
}
DEADLINE_S = 60.0


@dataclass
class Deployment:
    cluster: Cluster
    listener: ProviderListener
    policy: SecretPolicy
    http: httpx.AsyncClient

    def runner(self, policy: SecretPolicy) -> ChildProcess:
        """A runner process with every secret above in its environment and
        `policy` as the operator's grants."""
        return self.cluster.start_runner(
            **policy.to_env(), **OTHER_SECRETS, **{GRANTED_VARIABLE: GRANTED_VALUE}
        )

    async def answered(self, session: str, seq: int) -> CommittedFact:
        ledger_id = f"{TENANT}:{session}"

        async def answer() -> CommittedFact | None:
            for fact in await self.cluster.facts(ledger_id):
                if fact.kind == "assistant" and fact.data.get("inputSeqs") == [seq]:
                    return fact
            return None

        return await eventually(answer, f"the answer to input {seq}", DEADLINE_S)


def _policy(listener: ProviderListener) -> SecretPolicy:
    return SecretPolicy(
        grants={
            TENANT: frozenset({GRANTED_VARIABLE}),
            "default": frozenset({"OPENAI_API_KEY"}),
            "globex": frozenset({"GLOBEX_MODEL_KEY"}),
        },
        provider_origins=(*DEFAULT_PROVIDER_ORIGINS, listener.url),
    )


@pytest.fixture
async def deployment(pg_settings: Settings) -> AsyncIterator[Deployment]:
    async with ProviderListener() as listener:
        policy = _policy(listener)
        # The kernel applies the operator's policy to every loadout written.
        cluster = await start_cluster(
            pg_settings.with_overrides(secrets=policy), backoff_base_ms=100, max_attempts=3
        )
        edge: EdgeServer | None = None
        try:
            await cluster.kernel.create_tenant(TENANT, "Acme")
            await cluster.kernel.create_api_key(TENANT, TENANT_ADMIN, admin=True)
            edge = await EdgeServer(
                cluster.settings,
                EdgeConfig(cluster.ledger_server.target, cluster.kernel_server.target),
            ).start()
            async with httpx.AsyncClient(
                base_url=edge.url,
                headers={"Authorization": f"Bearer {TENANT_ADMIN}"},
                timeout=httpx.Timeout(DEADLINE_S),
            ) as http:
                yield Deployment(cluster, listener, policy, http)
        finally:
            if edge is not None:
                await edge.stop()
            await stop_cluster(cluster)


def _model(listener: ProviderListener, **fields: Any) -> dict[str, Any]:
    return {"provider": "openai", "name": "gpt-test", "baseUrl": f"{listener.url}/v1", **fields}


async def _send(http: httpx.AsyncClient, session: str, text: str) -> int:
    posted = await http.post(f"/v1/sessions/{session}/inputs", json={"text": text})
    assert posted.status_code == 202, posted.text
    seq: int = posted.json()["seq"]
    return seq


def _leaked(deployment: Deployment) -> list[str]:
    """Every secret (other than the granted one) found in what the listener saw."""
    secrets = [*OTHER_SECRETS.values(), TEST_TOKEN, TENANT_ADMIN]
    found: list[str] = []
    for seen in deployment.listener.seen:
        for text in seen.texts():
            found.extend(secret for secret in secrets if secret in text)
    return found


async def test_the_listener_receives_only_the_tenants_granted_secret(
    deployment: Deployment,
) -> None:
    http, listener = deployment.http, deployment.listener
    runner = deployment.runner(deployment.policy)
    await deployment.cluster.runner_ready(runner)

    # Naming anyone else's variable is refused when the loadout is written.
    for variable in ("OPENAI_API_KEY", "GLOBEX_MODEL_KEY", "KEEL_DEV_KEY", "KEEL_INTERNAL_TOKEN"):
        refused = await http.put(
            "/v1/loadout", json={"model": _model(listener, apiKeyEnv=variable)}
        )
        assert refused.status_code == 400, (variable, refused.text)
        assert "model.apiKeyEnv" in refused.json()["error"]["message"], refused.text
    assert (await http.get("/v1/loadout")).json()["revision"] == 0

    stored = await http.put(
        "/v1/loadout", json={"model": _model(listener, apiKeyEnv=GRANTED_VARIABLE)}
    )
    assert stored.status_code == 200, stored.text
    session = (await http.post("/v1/sessions", json={"id": "granted"})).json()["id"]
    seq = await _send(http, session, "hello through my own model")
    answer = await deployment.answered(session, seq)
    assert answer.data["content"][0]["text"] == ANSWER

    assert listener.seen, "the tenant's model was called"
    for seen in listener.seen:
        headers = dict(seen.headers)
        assert headers["authorization"] == f"Bearer {GRANTED_VALUE}", seen
        # The SDKs' ambient settings stayed in the runner too.
        assert not {"openai-organization", "openai-project", "x-operator-secret"} & set(headers)
    assert _leaked(deployment) == []


async def test_a_withdrawn_grant_fails_the_attempt_and_sends_nothing(
    deployment: Deployment,
) -> None:
    http, listener, cluster = deployment.http, deployment.listener, deployment.cluster
    granted = deployment.runner(deployment.policy)
    await cluster.runner_ready(granted)
    stored = await http.put(
        "/v1/loadout", json={"model": _model(listener, apiKeyEnv=GRANTED_VARIABLE)}
    )
    assert stored.status_code == 200, stored.text
    session = (await http.post("/v1/sessions", json={"id": "withdrawn"})).json()["id"]
    await deployment.answered(session, await _send(http, session, "while granted"))
    calls_while_granted = len(listener.seen)

    # The operator withdraws the grant: the runner restarts without it. The
    # stored loadout still names the variable; the runner refuses to read it.
    granted.kill()
    withdrawn_policy = SecretPolicy(
        grants={k: v for k, v in deployment.policy.grants.items() if k != TENANT},
        provider_origins=deployment.policy.provider_origins,
    )
    runner = deployment.runner(withdrawn_policy)
    await cluster.runner_ready(runner)
    seq = await _send(http, session, "after the grant was withdrawn")

    ledger_id = f"{TENANT}:{session}"

    async def parked() -> bool | None:
        return True if (await cluster.kernel.get_lease(ledger_id)).parked else None

    # Each attempt fails at once; after max_attempts the session is parked,
    # still owing the input: no crash loop, no retry storm.
    await eventually(parked, "the session to be parked", DEADLINE_S)
    view = await cluster.ledger.get_session(ledger_id)
    assert seq in view.owed_input_seqs
    refusals = [line for line in runner.lines if "could not start" in line]
    assert refusals and all(f"${GRANTED_VARIABLE}" in line for line in refusals), runner.lines
    assert all("not granted" in line for line in refusals)
    assert "Traceback" not in runner.output()
    assert runner.proc.poll() is None, "the runner keeps running"
    assert len(listener.seen) == calls_while_granted, "nothing was sent after the withdrawal"
    assert _leaked(deployment) == []

    # The same runner still serves a tenant whose loadout needs no secret.
    await cluster.new_session("default:other")
    other_seq = await cluster.send("default:other", "still working?", "r-other")
    await cluster.settled("default:other")
    facts = await cluster.facts("default:other")
    assert facts[-1].kind == "assistant" and facts[-1].data["inputSeqs"] == [other_seq]

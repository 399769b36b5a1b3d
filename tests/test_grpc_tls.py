"""Internal gRPC over mutual TLS, with a CA the test makes.

A ledger served with `KEEL_GRPC_TLS_*` (certificate, key and CA) serves a
client holding a certificate its CA signed, and refuses at the handshake a
client without a certificate, one whose certificate another CA signed, and
one speaking plaintext. The token and TLS can be on together; a half
configured TLS is one clear error before anything serves; `keel ledger` on
mutual TLS alone starts and serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from keel.ledger.v1 import ledger_pb2, ledger_pb2_grpc
from services.common.config import Settings
from services.common.errors import ServiceUnavailable
from services.common.internal_auth import InternalAuthError, require_internal_auth
from services.common.serving import open_channel, serve_services
from services.ledger import LedgerClient, LedgerServer
from services.ledger.errors import SessionNotFound
from tests.support.internal_auth import auth_env, with_token
from tests.support.keel_up import KEEL, clean_env
from tests.support.processes import ChildProcess
from tests.support.tls import CertificateAuthority, Issued

CALL_TIMEOUT_S = 10.0
LOOPBACK = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    server: Issued
    client: Issued
    # Signed by another CA: what a stranger with "a certificate" holds.
    foreign: Issued


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = CertificateAuthority("keel-internal", tmp_path / "pki")
    other = CertificateAuthority("someone-else", tmp_path / "other-pki")
    return Pki(
        ca=ca,
        server=ca.issue("ledger", hosts=LOOPBACK),
        client=ca.issue("runner"),
        foreign=other.issue("intruder"),
    )


@pytest.fixture
async def tls_ledger(pki: Pki, tmp_path: Path) -> AsyncIterator[LedgerServer]:
    server = await LedgerServer(pki.server.settings(Settings(data_dir=tmp_path / "data"))).start()
    yield server
    await server.stop(grace=0.2)


async def _session_seen(target: str, settings: Settings, session_id: str) -> None:
    """Creates a session, appends to it and reads it back over a subscription."""
    async with LedgerClient(target, settings) as client:
        await client.create_session(session_id, "t")
        await client.append_one(session_id, "input", {"text": "over tls", "requestId": "r1"})
        seen = []
        async for fact in client.subscribe(session_id, 0):
            seen.append(fact.kind)
            if len(seen) == 2:
                break
    assert seen == ["session_created", "input"]


async def _refused_at_handshake(target: str, credentials: grpc.ChannelCredentials) -> None:
    async with grpc.aio.secure_channel(target, credentials) as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetSession(
                ledger_pb2.GetSessionRequest(session_id="any"), timeout=CALL_TIMEOUT_S
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value


async def test_a_client_with_a_certificate_of_the_ca_is_served(
    tls_ledger: LedgerServer, pki: Pki
) -> None:
    await _session_seen(tls_ledger.target, pki.client.settings(), "mtls")


async def test_a_client_without_a_certificate_is_refused(
    tls_ledger: LedgerServer, pki: Pki
) -> None:
    # It trusts the server (the right CA) but has nothing to show.
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.pem.read_bytes())
    await _refused_at_handshake(tls_ledger.target, credentials)


async def test_a_client_with_a_certificate_of_another_ca_is_refused(
    tls_ledger: LedgerServer, pki: Pki
) -> None:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.pem.read_bytes(),
        private_key=pki.foreign.key.read_bytes(),
        certificate_chain=pki.foreign.cert.read_bytes(),
    )
    await _refused_at_handshake(tls_ledger.target, credentials)
    # The same through Keel's own channel: the typed client fails, nothing is written.
    stranger = Issued(pki.foreign.cert, pki.foreign.key, pki.ca.pem).settings()
    async with LedgerClient(tls_ledger.target, stranger) as client:
        with pytest.raises(ServiceUnavailable):
            await client.create_session("intruded", "t")
    async with LedgerClient(tls_ledger.target, pki.client.settings()) as client:
        with pytest.raises(SessionNotFound):
            await client.get_session("intruded")


async def test_a_plaintext_client_is_refused(tls_ledger: LedgerServer) -> None:
    async with open_channel(tls_ledger.target, Settings()) as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetSession(
                ledger_pb2.GetSessionRequest(session_id="any"), timeout=CALL_TIMEOUT_S
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_server_certificate_for_a_service_name_is_checked_against_that_name(
    pki: Pki, tmp_path: Path
) -> None:
    named = pki.ca.issue("ledger-by-name", hosts=("ledger.keel.internal",))
    server = await LedgerServer(named.settings(Settings(data_dir=tmp_path / "data"))).start()
    try:
        # Dialled by address, the certificate's name does not match...
        async with LedgerClient(server.target, pki.client.settings()) as client:
            with pytest.raises(ServiceUnavailable):
                await client.create_session("unnamed", "t")
        # ...unless the client is told the name to expect.
        expecting = pki.client.settings(server_name="ledger.keel.internal")
        await _session_seen(server.target, expecting, "named")
    finally:
        await server.stop(grace=0.2)


async def test_the_token_and_tls_can_both_be_required(pki: Pki, tmp_path: Path) -> None:
    both = with_token(pki.server.settings(Settings(data_dir=tmp_path / "data")))
    server = await LedgerServer(both).start()
    try:
        async with open_channel(server.target, pki.client.settings()) as channel:
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetSession(ledger_pb2.GetSessionRequest(session_id="any"))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await _session_seen(server.target, with_token(pki.client.settings()), "both")
    finally:
        await server.stop(grace=0.2)


@pytest.mark.parametrize(
    ("cert", "key", "ca", "named"),
    [
        (True, False, False, "KEEL_GRPC_TLS_CERT"),
        (False, True, True, "KEEL_GRPC_TLS_KEY, KEEL_GRPC_TLS_CA"),
        (False, False, True, "KEEL_GRPC_TLS_CA"),
    ],
)
async def test_a_half_configured_tls_is_one_clear_error(
    pki: Pki, cert: bool, key: bool, ca: bool, named: str
) -> None:
    half = Settings(
        grpc_tls_cert=str(pki.server.cert) if cert else "",
        grpc_tls_key=str(pki.server.key) if key else "",
        grpc_tls_ca=str(pki.ca.pem) if ca else "",
    )
    # Refused by a server before it binds, and by a client before it dials.
    with pytest.raises(InternalAuthError) as by_server:
        await serve_services([], "127.0.0.1:0", half)
    with pytest.raises(InternalAuthError) as by_client:
        open_channel("127.0.0.1:1", half)
    for caught in (by_server, by_client):
        message = str(caught.value)
        assert "\n" not in message and f"({named} set)" in message
        assert "KEEL_GRPC_TLS_CERT and KEEL_GRPC_TLS_KEY are both needed" in message


def test_an_unreadable_tls_file_is_named(pki: Pki, tmp_path: Path) -> None:
    missing = pki.client.settings().with_overrides(grpc_tls_key=str(tmp_path / "nope.pem"))
    with pytest.raises(InternalAuthError, match=r"KEEL_GRPC_TLS_KEY=.*nope\.pem: cannot read"):
        require_internal_auth(missing)


def test_mutual_tls_alone_is_enough_to_start_but_tls_without_a_ca_is_not(pki: Pki) -> None:
    require_internal_auth(pki.client.settings())
    server_only = pki.client.settings().with_overrides(grpc_tls_ca="")
    with pytest.raises(InternalAuthError, match="KEEL_INTERNAL_TOKEN"):
        require_internal_auth(server_only)
    require_internal_auth(with_token(server_only))


async def test_keel_ledger_on_mutual_tls_alone_starts_and_serves(pki: Pki, tmp_path: Path) -> None:
    env = clean_env(
        KEEL_DATA_DIR=str(tmp_path / "data"), **auth_env(pki.server.settings(Settings()))
    )
    env.pop("KEEL_INTERNAL_TOKEN", None)
    child = ChildProcess([str(KEEL), "ledger", "--address", "127.0.0.1:0"], env=env)
    try:
        target = await asyncio.to_thread(child.wait_listening)
        await _session_seen(target, pki.client.settings(), "from-keel")
    finally:
        child.terminate()

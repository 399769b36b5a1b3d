"""Internal gRPC is closed: every service refuses a caller without the token.

Each service of an in-process cluster (real servers on loopback, on the
internal token of tests/support/internal_auth.py) is called three times per
RPC: without a token, with a wrong one, and through `open_channel` with the
right one. Unary and streaming calls alike must be refused with
UNAUTHENTICATED and the reason INTERNAL_AUTH_REQUIRED, and nothing a refused
call asked for may happen (the attacks of the "closed by default" issue: an
admin key minted through the kernel, inputs appended through the ledger, the
runner drained). Reflection is refused too; health stays open for probes.

Then the same from the outside: `keel up` (both modes) runs on a token it
made for its data dir, its files are its owner's alone, and `keel <service>`
does not start without a token.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from compaction.server import CompactionServer
from keel.compaction.v1 import compaction_pb2, compaction_pb2_grpc
from keel.kernel.v1 import kernel_pb2, kernel_pb2_grpc
from keel.ledger.v1 import ledger_pb2, ledger_pb2_grpc
from keel.runner.v1 import runner_pb2, runner_pb2_grpc
from services.cli.data_dir import TOKEN_FILE, data_dir_token, with_internal_token
from services.cli.supervisor import Supervisor
from services.cli.up import (
    ModelChoiceError,
    UpOptions,
    model_from_flag,
    model_secrets,
)
from services.common.config import Settings
from services.common.errors import error_info
from services.common.internal_auth import UNAUTHENTICATED_REASON
from services.common.secrets import SecretPolicy
from services.common.serving import open_channel
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.internal_auth import TEST_TOKEN, with_token
from tests.support.keel_up import KEEL, clean_env, keel_up, run_keel
from tests.support.polling import eventually
from tests.support.processes import ChildProcess

KEY = "internal-auth-test-key-0123456789"
# As long as the right one: only the content may tell them apart.
WRONG_TOKEN = "x" * len(TEST_TOKEN)
STRANGERS = {"no token": Settings(), "a wrong token": with_token(Settings(), WRONG_TOKEN)}
DEADLINE_S = 60.0

Call = Callable[[grpc.aio.Channel], Awaitable[Any]]


async def first(stream: Any) -> Any:
    """The first message of a response stream."""
    async for message in stream:
        return message
    raise AssertionError("the stream ended without a message")


async def assert_refused(target: str, call: Call) -> None:
    """`call` without a token and with a wrong one: UNAUTHENTICATED, with the reason."""
    for who, credentials in STRANGERS.items():
        async with open_channel(target, credentials) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (who, refused.value)
        info = error_info(refused.value)
        assert info is not None and info.reason == UNAUTHENTICATED_REASON, who


async def assert_guarded(target: str, settings: Settings, call: Call) -> Any:
    """Refused to strangers, answered (its result returned) with the token."""
    await assert_refused(target, call)
    async with open_channel(target, settings) as channel:
        return await call(channel)


async def reflected_services(channel: grpc.aio.Channel) -> Any:
    """Reflection's list of services (a stream-stream call).

    The request is written on the call, not handed over as an iterator: a
    server that refuses the call ends it at once, and an iterator's write
    racing that end fails as INTERNAL ("Failed execute_batch") instead of
    the status the server sent; a write on an ended call raises that status."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    await call.done_writing()
    return await first(call)


async def assert_probes_open_and_reflection_closed(
    target: str, settings: Settings, service: str
) -> None:
    async with open_channel(target, Settings()) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    listed = await assert_guarded(target, settings, reflected_services)
    assert service in {s.name for s in listed.list_services_response.service}


# ------------------------------------------------------------------ in-process services


@dataclass
class Services:
    cluster: Cluster
    compaction: CompactionServer
    runners: list[RunnerServer] = field(default_factory=list)

    @property
    def settings(self) -> Settings:
        return self.cluster.settings

    async def start_runner(self) -> RunnerServer:
        """A runner of this cluster; it attaches to the kernel over a
        streaming call, so without a working token it would never be ready."""
        ledger, kernel = self.cluster.ledger_server.target, self.cluster.kernel_server.target
        config = RunnerConfig(ledger, kernel, compaction_target=self.compaction.target)
        async with asyncio.timeout(DEADLINE_S):
            runner = await RunnerServer(self.settings, config).start()
        self.runners.append(runner)
        return runner


@pytest.fixture
async def services(sqlite_settings: Settings) -> AsyncIterator[Services]:
    assert sqlite_settings.internal_token == TEST_TOKEN
    cluster = await start_cluster(sqlite_settings)
    ledger, kernel = cluster.ledger_server.target, cluster.kernel_server.target
    compaction = await CompactionServer(sqlite_settings, ledger, kernel).start()
    running = Services(cluster, compaction)
    try:
        yield running
    finally:
        for runner in running.runners:
            await runner.stop(grace=0.2)
        await compaction.stop(grace=0.2)
        await stop_cluster(cluster)


async def test_the_ledger_refuses_strangers_unary_and_streaming(services: Services) -> None:
    target, settings = services.cluster.ledger_server.target, services.settings

    def stub(channel: grpc.aio.Channel) -> ledger_pb2_grpc.LedgerServiceAsyncStub:
        return ledger_pb2_grpc.LedgerServiceStub(channel)

    create = ledger_pb2.CreateSessionRequest(session_id="guarded", tenant_id="default")
    await assert_guarded(target, settings, lambda channel: stub(channel).CreateSession(create))
    # The attack: an input appended behind the edge's back.
    data = json.dumps({"text": "injected", "requestId": "r-1"})
    append = ledger_pb2.AppendRequest(
        session_id="guarded", facts=[ledger_pb2.NewFact(kind="input", data_json=data)]
    )
    appended = await assert_guarded(target, settings, lambda channel: stub(channel).Append(append))
    assert appended.head_seq == 2
    subscribe = ledger_pb2.SubscribeRequest(session_id="guarded", after_seq=0)
    fact = await assert_guarded(
        target, settings, lambda channel: first(stub(channel).Subscribe(subscribe))
    )
    assert fact.fact.seq == 1
    # Only what the token holder asked for was committed.
    facts = await services.cluster.ledger.read_all("guarded")
    assert [f.kind for f in facts] == ["session_created", "input"]
    await assert_probes_open_and_reflection_closed(target, settings, "keel.ledger.v1.LedgerService")


async def test_the_kernel_refuses_strangers_unary_and_streaming(services: Services) -> None:
    target, settings = services.cluster.kernel_server.target, services.settings
    kernel = services.cluster.kernel

    def stub(channel: grpc.aio.Channel) -> kernel_pb2_grpc.KernelServiceAsyncStub:
        return kernel_pb2_grpc.KernelServiceStub(channel)

    # The attack: a stranger mints an operator key that would then work over HTTP.
    stolen = "minted-by-a-stranger-0123456789abcdef"
    mint = kernel_pb2.CreateApiKeyRequest(
        tenant_id="default", key=stolen, admin=True, operator=True
    )
    await assert_refused(target, lambda channel: stub(channel).CreateApiKey(mint))
    assert not await kernel.list_api_keys("default")
    minted = await assert_guarded(
        target,
        settings,
        lambda channel: stub(channel).CreateApiKey(
            kernel_pb2.CreateApiKeyRequest(tenant_id="default", admin=True)
        ),
    )
    revoke = kernel_pb2.RevokeApiKeyRequest(key_id=minted.key_id)
    await assert_guarded(target, settings, lambda channel: stub(channel).RevokeApiKey(revoke))

    # Streaming: the revocation stream and a runtime's Attach stream.
    watch = kernel_pb2.WatchRevocationsRequest(after_id=0)
    revocation = await assert_guarded(
        target, settings, lambda channel: first(stub(channel).WatchRevocations(watch))
    )
    assert revocation.key_hash == hashlib.sha256(minted.key.encode()).hexdigest()
    register = kernel_pb2.RegisterRuntimeRequest(runtime_id="guarded-runtime")
    await assert_guarded(target, settings, lambda channel: stub(channel).RegisterRuntime(register))
    attach = kernel_pb2.AttachRequest(runtime_id="guarded-runtime")
    beat = await assert_guarded(
        target, settings, lambda channel: first(stub(channel).Attach(attach))
    )
    assert beat.server_time_ms > 0
    await assert_probes_open_and_reflection_closed(target, settings, "keel.kernel.v1.KernelService")


async def test_the_compaction_service_refuses_strangers(services: Services) -> None:
    target, settings = services.compaction.target, services.settings
    await services.cluster.new_session("planned")

    def stub(channel: grpc.aio.Channel) -> compaction_pb2_grpc.CompactionServiceAsyncStub:
        return compaction_pb2_grpc.CompactionServiceStub(channel)

    # Its one kind of RPC is unary; answering it takes the service's own
    # calls to the ledger and kernel, which carry the token too.
    plan = compaction_pb2.PlanRequest(session_id="planned")
    planned = await assert_guarded(target, settings, lambda channel: stub(channel).Plan(plan))
    assert not planned.should_compact and planned.context_window > 0
    # Reflection is its streaming call (stream-stream).
    await assert_probes_open_and_reflection_closed(
        target, settings, "keel.compaction.v1.CompactionService"
    )


async def test_the_runner_refuses_strangers_unary_and_streaming(services: Services) -> None:
    runner = await services.start_runner()
    target, settings = runner.target, services.settings
    cluster = services.cluster

    def stub(channel: grpc.aio.Channel) -> runner_pb2_grpc.RunnerServiceAsyncStub:
        return runner_pb2_grpc.RunnerServiceStub(channel)

    # The attack: a stranger drains the runner; it must go on claiming.
    drain = runner_pb2.DrainRequest(mode=runner_pb2.DRAIN_MODE_SHUTDOWN, deadline_ms=1000)
    await assert_refused(target, lambda channel: stub(channel).Drain(drain))
    status = await assert_guarded(
        target, settings, lambda channel: stub(channel).Status(runner_pb2.StatusRequest())
    )
    assert status.claiming and status.drain_mode == runner_pb2.DRAIN_MODE_NONE

    # The runner answers (its calls to the kernel, ledger and compaction
    # service carry the token), then its attempt can be watched by holders only.
    await cluster.new_session("watched")
    await cluster.send("watched", "hello through a closed cluster", "r-1")
    view = await cluster.settled("watched", DEADLINE_S)
    assert not view.owed_input_seqs
    facts = await cluster.facts("watched")
    [started] = [f for f in facts if f.kind == "epoch_started"]
    assert any(f.kind == "assistant" for f in facts)
    watch = runner_pb2.WatchSessionRequest(
        session_id="watched", epoch=started.data["epoch"], attempt_id=started.data["attemptId"]
    )
    watched = await assert_guarded(
        target, settings, lambda channel: first(stub(channel).WatchSession(watch))
    )
    assert watched.WhichOneof("event") is not None
    await assert_probes_open_and_reflection_closed(target, settings, "keel.runner.v1.RunnerService")


async def test_an_unknown_method_is_refused_not_revealed(services: Services) -> None:
    """A stranger cannot tell which methods exist: everything is UNAUTHENTICATED."""
    target = services.cluster.ledger_server.target
    async with open_channel(target, Settings()) as channel:
        probe = channel.unary_unary("/keel.ledger.v1.LedgerService/NoSuchMethod", None, None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await probe(b"")
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ------------------------------------------------------------------ the token file


def test_keel_up_makes_one_private_token_per_data_dir_and_reuses_it(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    token = data_dir_token(data_dir)
    assert len(token) >= 32
    path = data_dir / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert data_dir_token(data_dir) == token, "a restart reuses the token"
    assert [p.name for p in data_dir.iterdir()] == [TOKEN_FILE], "no temporary file is left"
    assert data_dir_token(tmp_path / "data").strip() == path.read_text().strip()
    # An explicit token wins over the file.
    explicit = with_internal_token(Settings(data_dir=data_dir, internal_token=TEST_TOKEN))
    assert explicit.internal_token == TEST_TOKEN
    assert with_internal_token(Settings(data_dir=data_dir)).internal_token == token


def test_a_token_file_left_readable_is_closed_again(tmp_path: Path) -> None:
    (tmp_path / TOKEN_FILE).write_text(TEST_TOKEN + "\n")
    (tmp_path / TOKEN_FILE).chmod(0o644)
    assert data_dir_token(tmp_path) == TEST_TOKEN
    assert stat.S_IMODE((tmp_path / TOKEN_FILE).stat().st_mode) == 0o600


def test_a_symlink_in_place_of_the_token_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text(TEST_TOKEN)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / TOKEN_FILE).symlink_to(elsewhere)
    with pytest.raises(OSError):
        data_dir_token(data_dir)


# ------------------------------------------------------------------ the commands


def _modes(data_dir: Path) -> dict[str, int]:
    """The permission bits of the data dir and of everything in it."""
    found = {".": stat.S_IMODE(data_dir.stat().st_mode)}
    for path in data_dir.rglob("*"):
        found[str(path.relative_to(data_dir))] = stat.S_IMODE(path.lstat().st_mode)
    return found


async def _answered(http: httpx.AsyncClient, text: str) -> dict[str, Any]:
    session = (await http.post("/v1/sessions", json={})).json()["id"]
    posted = await http.post(
        f"/v1/sessions/{session}/inputs", json={"text": text, "requestId": "auth-1"}
    )
    assert posted.status_code == 202, posted.text
    seq = posted.json()["seq"]

    async def answer() -> dict[str, Any] | None:
        page = (await http.get(f"/v1/sessions/{session}/events?format=json")).json()
        for fact in page["facts"]:
            if fact["kind"] == "assistant" and seq in fact["data"].get("inputSeqs", []):
                found: dict[str, Any] = fact["data"]
                return found
        return None

    return await eventually(answer, "the answer", DEADLINE_S)


@pytest.mark.slow
async def test_keel_up_processes_runs_closed_on_its_own_token(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    # A data dir an older Keel left open is closed again.
    data_dir.mkdir(mode=0o755)
    data_dir.chmod(0o755)
    with keel_up(data_dir, KEY, "--processes") as up:
        token = (data_dir / TOKEN_FILE).read_text().strip()
        assert len(token) >= 32
        async with httpx.AsyncClient(
            base_url=up.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ) as http:
            answer = await _answered(http, "hello through closed processes")
        text = "".join(part.get("text", "") for part in answer["content"])
        assert "hello through closed processes" in text
        modes = _modes(data_dir)
    assert modes["."] == 0o700
    assert modes[TOKEN_FILE] == 0o600
    sqlite_files = [name for name in modes if ".sqlite3" in name]
    assert sqlite_files, modes
    loose = {
        name: oct(mode)
        for name, mode in modes.items()
        if mode != (0o700 if (data_dir / name).is_dir() else 0o600)
    }
    assert not loose, f"readable by others: {loose}"
    # The next `keel up` on this data dir uses the same token.
    with keel_up(data_dir, KEY):
        assert (data_dir / TOKEN_FILE).read_text().strip() == token


_KERNEL_PORT = re.compile(r"serving keel\.kernel\.v1\.KernelService on port (\d+)")


async def test_keel_ups_kernel_refuses_a_local_process_without_the_token(tmp_path: Path) -> None:
    """The attack of the issue against a real `keel up`: another local
    process calls the kernel's CreateApiKey directly."""
    data_dir = tmp_path / "data"
    with keel_up(data_dir, KEY, env={"KEEL_LOG_LEVEL": "INFO"}) as up:
        line = up.child.wait_for_line(lambda text: bool(_KERNEL_PORT.search(text)), 5)
        match = _KERNEL_PORT.search(line)
        assert match is not None
        kernel = f"127.0.0.1:{match.group(1)}"
        mint = kernel_pb2.CreateApiKeyRequest(tenant_id="default", admin=True, operator=True)
        await assert_refused(
            kernel, lambda channel: kernel_pb2_grpc.KernelServiceStub(channel).CreateApiKey(mint)
        )
        token = (data_dir / TOKEN_FILE).read_text().strip()
        async with open_channel(kernel, Settings(internal_token=token)) as channel:
            stub = kernel_pb2_grpc.KernelServiceStub(channel)
            tenants = await stub.ListTenants(kernel_pb2.ListTenantsRequest())
        assert "default" in [t.tenant_id for t in tenants.tenants]


@pytest.mark.parametrize(
    ("command", "env"),
    [
        (["ledger", "--address", "127.0.0.1:0"], {}),
        (["kernel", "--address", "127.0.0.1:0"], {}),
        (["runner"], {}),
        (["kernel", "--address", "127.0.0.1:0"], {"KEEL_INTERNAL_TOKEN": "too-short"}),
    ],
    ids=["ledger", "kernel", "runner", "short-token"],
)
def test_a_service_does_not_start_without_internal_auth(
    command: list[str], env: dict[str, str], tmp_path: Path
) -> None:
    result = run_keel(*command, env={"KEEL_DATA_DIR": str(tmp_path / "data"), **env})
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"keel {command[0]}: ")
    assert "KEEL_INTERNAL_TOKEN" in lines[0]
    if not env:
        assert "KEEL_GRPC_TLS_CERT" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_keel_up_refuses_a_weak_dev_key(tmp_path: Path) -> None:
    result = run_keel("up", "--data-dir", str(tmp_path / "data"), env={"KEEL_DEV_KEY": "dev"})
    assert result.returncode == 2, result
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("keel: KEEL_DEV_KEY: ") and "24 characters" in line


def test_a_service_with_its_token_starts(tmp_path: Path) -> None:
    env = clean_env(KEEL_DATA_DIR=str(tmp_path / "data"), KEEL_INTERNAL_TOKEN=TEST_TOKEN)
    child = ChildProcess([str(KEEL), "ledger", "--address", "127.0.0.1:0"], env=env)
    try:
        child.wait_listening(DEADLINE_S)
    finally:
        child.terminate()
    assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o700
    assert os.listdir(tmp_path / "data")


def test_keel_up_grants_its_model_and_hands_token_and_grants_to_its_children(
    tmp_path: Path,
) -> None:
    """`keel up --model` is the operator's choice: the default tenant may name
    the model's key variable and call its URL, in every child process too."""
    env = {"OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    model = model_from_flag("openai:gpt-test", env)
    policy = model_secrets(SecretPolicy(), model)
    assert policy.may_read("default", "OPENAI_API_KEY")
    assert not policy.may_read("another-tenant", "OPENAI_API_KEY")
    assert policy.allows_origin("http://127.0.0.1:9/v1/chat/completions")
    assert not policy.allows_origin("http://127.0.0.1:10/v1")

    settings = Settings(data_dir=tmp_path, internal_token=TEST_TOKEN, secrets=policy)
    child_env = Supervisor(settings, UpOptions(processes=True)).env()
    assert child_env["KEEL_INTERNAL_TOKEN"] == TEST_TOKEN
    assert SecretPolicy.from_env(child_env) == policy


def test_keel_up_refuses_a_model_url_that_is_not_one() -> None:
    env = {"OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": "localhost:8000/v1"}
    with pytest.raises(ModelChoiceError, match="OPENAI_BASE_URL"):
        model_from_flag("openai:gpt-test", env)

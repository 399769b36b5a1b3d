"""`keel up`: every service, one command.

Embedded (default): ledger, kernel, compaction, runner and edge in this
process, each on its own loopback gRPC port and talking through the same
contracts as in production. `--processes`: each service as its own OS process
under a small supervisor that restarts a child that dies (runners there embed
their own compaction service; the edge asks the compaction process for
contexts).

In both modes the services authenticate to each other with the data dir's
internal token (services/cli/data_dir.py), and `--model` is granted its key
variable and its URL's origin for the default tenant, as an operator would
grant them in KEEL_SECRET_GRANTS and KEEL_PROVIDER_ORIGINS.

A runtime whose drain has finished is replaced, never revived: a drained
runner or edge process exits and the supervisor starts a new one; embedded,
a drained runner is stopped and a new runner (a new runtime id) started in
this process, and a drained edge is restarted on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from compaction.server import CompactionServer
from edge.gateway import EdgeConfig
from kernel import KernelClient, KernelServer
from services.cli.data_dir import close_data_dir
from services.cli.discovery import remove_discovery, write_discovery
from services.cli.embedded_runtimes import EmbeddedEdge, EmbeddedRunners
from services.common.config import Settings
from services.common.internal_auth import TOKEN_ENV
from services.common.secrets import SecretPolicy
from services.ledger import LedgerServer
from services.runner.config import RunnerConfig

DEFAULT_TENANT = "default"
# `--model provider:name`: where each provider's key (and, for a compatible
# server elsewhere, its URL) usually is; the loadout names the variable, the
# runner reads it at call time, so the key itself is stored nowhere.
MODEL_KEY_ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
MODEL_BASE_URL_ENV = {"openai": "OPENAI_BASE_URL", "anthropic": "ANTHROPIC_BASE_URL"}


class ModelChoiceError(ValueError):
    """`--model` cannot be used as given (its message is the one line to show)."""


def model_from_flag(spec: str, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The loadout's `model` object for `--model openai:gpt-4.1-mini`."""
    provider, colon, name = spec.partition(":")
    if not colon or not name or provider not in MODEL_KEY_ENV:
        raise ModelChoiceError(
            f"--model {spec!r}: expected provider:name with provider openai or anthropic, "
            "e.g. openai:gpt-4.1-mini"
        )
    key_env = MODEL_KEY_ENV[provider]
    if not env.get(key_env):
        raise ModelChoiceError(f"--model {spec}: set {key_env} to the {provider} API key first")
    model = {"provider": provider, "name": name, "apiKeyEnv": key_env}
    base_url = env.get(MODEL_BASE_URL_ENV[provider])
    if base_url:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ModelChoiceError(
                f"{MODEL_BASE_URL_ENV[provider]}={base_url!r} is not an http(s)://host/… URL"
            )
        model["baseUrl"] = base_url
    return model


def model_secrets(policy: SecretPolicy, model: Mapping[str, str]) -> SecretPolicy:
    """`--model` is the operator's own choice: the default tenant may name
    that model's key variable, and the model may be called at its `baseUrl`
    (the kernel and runners refuse both otherwise)."""
    policy = policy.with_grant(DEFAULT_TENANT, model["apiKeyEnv"])
    if "baseUrl" in model:
        policy = policy.with_origin(model["baseUrl"])
    return policy


@dataclass(frozen=True)
class UpOptions:
    http_port: int = 8080
    # The edge's public gRPC API (keel.sessions.v1); 0: any free port.
    grpc_port: int = 8081
    host: str = "127.0.0.1"
    processes: bool = False
    runners: int = 1
    dev_key: str = ""
    # The default tenant's model (`--model`, see model_from_flag); None
    # leaves its loadout as it is.
    model: Mapping[str, str] | None = None


async def bootstrap_tenant(
    kernel_target: str, settings: Settings, dev_key: str, model: Mapping[str, str] | None = None
) -> str:
    """The default tenant and a dev key (fixed by KEEL_DEV_KEY) that is its
    admin and an operator: one developer runs the whole deployment. With
    `model`, the tenant's loadout gets that model (the rest is kept)."""
    key = dev_key or f"keel-dev-{secrets.token_urlsafe(18)}"
    async with KernelClient(kernel_target, settings) as kernel:
        await kernel.create_tenant(DEFAULT_TENANT, "Default tenant")
        await kernel.create_api_key(DEFAULT_TENANT, key, admin=True, operator=True)
        if model is not None:
            current = await kernel.get_loadout(DEFAULT_TENANT)
            document = {**current.document, "model": dict(model)}
            # A restart with the same flag adds no revision.
            if current.revision == 0 or document != current.document:
                await kernel.put_loadout(DEFAULT_TENANT, document)
    return key


def _announce_grpc(address: str) -> None:
    # Before "Keel is up", which tells whoever reads the output that all is said.
    print(f"gRPC API: {address}", flush=True)


def _announce(url: str, key: str, model: Mapping[str, str] | None = None) -> None:
    print(f"Keel is up: {url}/#key={key}", flush=True)
    print(f"  dev key (admin of tenant {DEFAULT_TENANT!r}, operator): {key}", flush=True)
    if model is not None:
        where = f" at {model['baseUrl']}" if "baseUrl" in model else ""
        print(
            f"  model: {model['provider']} {model['name']}{where} (key from ${model['apiKeyEnv']})",
            flush=True,
        )
    print(f"  try: curl -H 'Authorization: Bearer <key>' -X POST {url}/v1/sessions", flush=True)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()


async def up_embedded(settings: Settings, options: UpOptions) -> None:
    ledger = await LedgerServer(settings).start()
    kernel = await KernelServer(settings, ledger_target=ledger.target).start()
    runner_config = RunnerConfig.from_env(ledger.target, kernel.target)
    # Everything listens on loopback here: an advertise address set for a
    # standalone runner would send edges elsewhere.
    runner_config = replace(runner_config, advertise_address="")
    # One compaction service for the runners and the edge (/context), unless
    # KEEL_COMPACTION_ADDRESS names one elsewhere.
    compaction: CompactionServer | None = None
    if not runner_config.compaction_target:
        compaction = await CompactionServer(
            settings,
            ledger.target,
            kernel.target,
            default_context_window=runner_config.default_context_window,
        ).start()
        runner_config = replace(runner_config, compaction_target=compaction.target)
    runners = await EmbeddedRunners(settings, runner_config, options.runners).start()
    edge = await EmbeddedEdge(
        settings,
        EdgeConfig(
            ledger.target,
            kernel.target,
            runner_config.compaction_target,
            grpc_port=options.grpc_port,
            drain_deadline_ms=runner_config.handoff_deadline_ms,
        ),
        options.host,
        options.http_port,
    ).start()
    assert edge.edge is not None
    key = await bootstrap_tenant(kernel.target, settings, options.dev_key, options.model)
    url = f"http://{options.host}:{edge.port}"
    grpc_address = edge.edge.grpc_address or ""
    _announce_grpc(grpc_address)
    _announce(url, key, options.model)
    try:
        write_discovery(settings.data_dir, url, grpc_address)
        await _wait_for_signal()
        print("draining: in-flight runs settle at a commit boundary…", flush=True)
        await runners.drain("handoff")
    finally:
        remove_discovery(settings.data_dir)
        await edge.stop()
        await runners.stop()
        if compaction is not None:
            await compaction.stop()
        await kernel.stop()
        await ledger.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Child:
    name: str
    args: list[str]
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    output: list[str] = field(default_factory=list)


class Supervisor:
    """Starts each service as a child, restarts any that dies, stops them all."""

    def __init__(self, settings: Settings, options: UpOptions) -> None:
        self.settings = settings
        self.options = options
        self.children: list[Child] = []
        self._stopping = False
        self._readers: set[asyncio.Task[None]] = set()

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "KEEL_DATABASE_URL": self.settings.database_url,
                "KEEL_DATA_DIR": str(self.settings.data_dir),
                "KEEL_PG_SCHEMA": self.settings.pg_schema,
                # Every child checks and sends the same token (made per data dir).
                TOKEN_ENV: self.settings.internal_token,
                # Every child listens on loopback: nothing else to advertise.
                "KEEL_ADVERTISE_ADDRESS": "",
                **self.settings.secrets.to_env(),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    async def spawn(self, child: Child) -> None:
        child.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.cli.main",
            *child.args,
            env=self.env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        print(f"  {child.name}: pid {child.process.pid}", flush=True)

    async def wait_ready(self, child: Child, marker: str) -> None:
        assert child.process is not None and child.process.stdout is not None
        while True:
            line = await child.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{child.name} exited before it was ready")
            if marker in line.decode(errors="replace"):
                # Keep reading so a chatty child never blocks on a full pipe.
                self._readers.add(asyncio.create_task(self._drain_output(child)))
                return

    async def _drain_output(self, child: Child) -> None:
        assert child.process is not None and child.process.stdout is not None
        async for _ in child.process.stdout:
            pass

    async def keep_alive(self, child: Child, marker: str) -> None:
        while not self._stopping:
            assert child.process is not None
            code = await child.process.wait()
            if self._stopping:
                return
            child.restarts += 1
            print(
                f"  {child.name} (pid {child.process.pid}) exited with {code}; restarting",
                flush=True,
            )
            await self.spawn(child)
            with contextlib.suppress(RuntimeError):
                await self.wait_ready(child, marker)

    async def run(self) -> None:
        ledger_addr = f"127.0.0.1:{_free_port()}"
        kernel_addr = f"127.0.0.1:{_free_port()}"
        compaction_addr = f"127.0.0.1:{_free_port()}"
        # Chosen once, so an edge that is restarted comes back on the same port.
        grpc_port = self.options.grpc_port or _free_port()
        # The edge is a child: with port 0 the supervisor picks the port, so
        # the URL it announces (and writes for clients) is the real one.
        http_port = self.options.http_port or _free_port()
        plan = [
            (Child("ledger", ["ledger", "--address", ledger_addr]), "listening on"),
            (
                Child("kernel", ["kernel", "--address", kernel_addr, "--ledger", ledger_addr]),
                "listening on",
            ),
            (
                Child(
                    "compaction",
                    [
                        "compaction",
                        "--address",
                        compaction_addr,
                        "--ledger",
                        ledger_addr,
                        "--kernel",
                        kernel_addr,
                    ],
                ),
                "listening on",
            ),
        ]
        plan += [
            (
                Child(
                    f"runner-{i + 1}", ["runner", "--ledger", ledger_addr, "--kernel", kernel_addr]
                ),
                "listening on",
            )
            for i in range(max(self.options.runners, 1))
        ]
        plan.append(
            (
                Child(
                    "edge",
                    [
                        "edge",
                        "--ledger",
                        ledger_addr,
                        "--kernel",
                        kernel_addr,
                        "--compaction",
                        compaction_addr,
                        "--host",
                        self.options.host,
                        "--http-port",
                        str(http_port),
                        "--grpc-port",
                        str(grpc_port),
                    ],
                ),
                "listening on",
            )
        )
        print("starting Keel as separate processes:", flush=True)
        watchers: list[asyncio.Task[None]] = []
        try:
            for child, marker in plan:
                self.children.append(child)
                await self.spawn(child)
                await self.wait_ready(child, marker)
                if child.name == "kernel":
                    key = await bootstrap_tenant(
                        kernel_addr, self.settings, self.options.dev_key, self.options.model
                    )
                watchers.append(asyncio.create_task(self.keep_alive(child, marker)))
            url = f"http://{self.options.host}:{http_port}"
            grpc_address = f"{self.options.host}:{grpc_port}"
            _announce_grpc(grpc_address)
            _announce(url, key, self.options.model)
            write_discovery(self.settings.data_dir, url, grpc_address)
            await _wait_for_signal()
        finally:
            remove_discovery(self.settings.data_dir)
            self._stopping = True
            for child in reversed(self.children):
                if child.process is not None and child.process.returncode is None:
                    child.process.send_signal(signal.SIGTERM)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(child.process.wait(), 15)
                    if child.process.returncode is None:
                        child.process.kill()
                        await child.process.wait()
            for watcher in watchers:
                watcher.cancel()


def data_dir_settings(settings: Settings, data_dir: Path | None) -> Settings:
    """`settings` on `data_dir` (default: theirs), which exists and is 0700."""
    if data_dir is not None:
        settings = settings.with_overrides(data_dir=data_dir)
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    close_data_dir(Path(settings.data_dir))
    return settings

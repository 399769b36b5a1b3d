"""`keel up`: every service, one command.

Embedded (default): ledger, kernel, compaction, runner and edge in this
process, each on its own loopback gRPC port and talking through the same
contracts as in production. `--processes`: each service as its own OS process
under a small supervisor that restarts a child that dies (services/cli/
supervisor.py; runners there embed their own compaction service; the edge
asks the compaction process for contexts).

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
import os
import secrets
import signal
from collections.abc import Mapping
from dataclasses import dataclass, replace
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
    # Replicas of the ledger and of the kernel (`--processes` on PostgreSQL
    # only, see replica_refusal); clients get every address in one target.
    ledgers: int = 1
    kernels: int = 1
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


def announce_grpc(address: str) -> None:
    # Before "Keel is up", which tells whoever reads the output that all is said.
    print(f"gRPC API: {address}", flush=True)


def announce(url: str, key: str, model: Mapping[str, str] | None = None) -> None:
    print(f"Keel is up: {url}/#key={key}", flush=True)
    print(f"  dev key (admin of tenant {DEFAULT_TENANT!r}, operator): {key}", flush=True)
    if model is not None:
        where = f" at {model['baseUrl']}" if "baseUrl" in model else ""
        print(
            f"  model: {model['provider']} {model['name']}{where} (key from ${model['apiKeyEnv']})",
            flush=True,
        )
    print(f"  try: curl -H 'Authorization: Bearer <key>' -X POST {url}/v1/sessions", flush=True)


def stop_signal() -> asyncio.Event:
    """Set by SIGTERM or SIGINT from now on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def _wait_for_signal() -> None:
    await stop_signal().wait()


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
    announce_grpc(grpc_address)
    announce(url, key, options.model)
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


def data_dir_settings(settings: Settings, data_dir: Path | None) -> Settings:
    """`settings` on `data_dir` (default: theirs), which exists and is 0700."""
    if data_dir is not None:
        settings = settings.with_overrides(data_dir=data_dir)
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    close_data_dir(Path(settings.data_dir))
    return settings

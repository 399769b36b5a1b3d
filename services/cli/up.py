"""`keel up`: every service, one command.

Embedded (the default on SQLite, `--embedded`): ledger, kernel, compaction,
runner and edge in this process, each on its own loopback gRPC port and
talking through the same contracts as in production. `--processes` (the
default on PostgreSQL, see default_processes): each service as its own OS
process under a small supervisor that restarts a child that dies (services/cli/
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
import contextlib
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
from kernel.errors import ApiKeyExists, InvalidApiKey
from services.cli.data_dir import store_dev_key, stored_dev_key
from services.cli.discovery import remove_discovery, write_discovery
from services.cli.embedded_runtimes import EmbeddedEdge, EmbeddedRunners
from services.cli.up_ports import (
    HIGHEST_PORT,
    INTERNAL_HOST,
    PortPlanError,
    internal_ports,
    planned_ports,
    service_names,
)
from services.common.config import Settings
from services.common.secrets import SecretPolicy
from services.ledger import LedgerServer
from services.runner.config import RunnerConfig
from services.service_start import NamedPort, close_data_dir, first_unavailable

DEFAULT_TENANT = "default"
# `--model provider:name`: where each provider's key (and, for a compatible
# server elsewhere, its URL) usually is; the loadout names the variable, the
# runner reads it at call time, so the key itself is stored nowhere.
MODEL_KEY_ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
MODEL_BASE_URL_ENV = {"openai": "OPENAI_BASE_URL", "anthropic": "ANTHROPIC_BASE_URL"}


class ModelChoiceError(ValueError):
    """`--model` cannot be used as given (its message is the one line to show)."""


class UpFailed(Exception):
    """`keel up` cannot start as asked (its message is the one line to show)."""


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
    # The internal services' first gRPC port (services/cli/up_ports.py);
    # None: free ports.
    grpc_base_port: int | None = None
    # Every fixed port this `keel up` listens on, checked before the start
    # and again after a failed one (up_ports.planned_ports).
    fixed_ports: tuple[NamedPort, ...] = ()


async def bootstrap_tenant(
    kernel_target: str,
    settings: Settings,
    dev_key: str,
    model: Mapping[str, str] | None = None,
    *,
    data_dir: Path | None = None,
) -> str:
    """The default tenant and a dev key (fixed by KEEL_DEV_KEY) that is its
    admin and an operator: one developer runs the whole deployment. With
    `model`, the tenant's loadout gets that model (the rest is kept).

    With `data_dir` (`keel up`), the dev key is kept there and used again on
    the next start, so restarts leave one valid dev key, not one more each:
    a key kept from before that is not the one used now (KEEL_DEV_KEY set or
    changed) is revoked, and a kept key someone revoked is replaced by a new one."""
    kept = stored_dev_key(data_dir) if data_dir is not None else ""
    key = dev_key or kept or _new_dev_key()
    async with KernelClient(kernel_target, settings) as kernel:
        await kernel.create_tenant(DEFAULT_TENANT, "Default tenant")
        if kept and kept != key:
            await _revoke(kernel, kept)
        try:
            await kernel.create_api_key(DEFAULT_TENANT, key, admin=True, operator=True)
        except ApiKeyExists as error:
            if dev_key:
                raise UpFailed(f"KEEL_DEV_KEY cannot be the dev key: {error.message}") from None
            # The kept key was revoked: its successor is new.
            key = _new_dev_key()
            await kernel.create_api_key(DEFAULT_TENANT, key, admin=True, operator=True)
        if model is not None:
            current = await kernel.get_loadout(DEFAULT_TENANT)
            document = {**current.document, "model": dict(model)}
            # A restart with the same flag adds no revision.
            if current.revision == 0 or document != current.document:
                await kernel.put_loadout(DEFAULT_TENANT, document)
    if data_dir is not None and key != kept:
        store_dev_key(data_dir, key)
    return key


def _new_dev_key() -> str:
    return f"keel-dev-{secrets.token_urlsafe(18)}"


async def _revoke(kernel: KernelClient, key: str) -> None:
    """Revokes the dev key an earlier start kept (already revoked: nothing to do)."""
    try:
        grant = await kernel.authenticate(key)
    except InvalidApiKey:
        return
    await kernel.revoke_api_key(grant.key_id)


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
    async with contextlib.AsyncExitStack() as started:
        try:
            edge, runners, kernel_target = await _start_embedded(settings, options, started)
        except (OSError, RuntimeError) as error:
            # A port taken since it was checked (grpc says RuntimeError):
            # the same one line as the check's; anything else goes on up.
            raise first_unavailable(options.fixed_ports) or error from None
        assert edge.edge is not None
        key = await bootstrap_tenant(
            kernel_target, settings, options.dev_key, options.model, data_dir=settings.data_dir
        )
        url = f"http://{options.host}:{edge.port}"
        grpc_address = edge.edge.grpc_address or ""
        # Clients find it before "Keel is up" sends anyone to them.
        started.callback(remove_discovery, settings.data_dir)
        write_discovery(settings.data_dir, url, grpc_address)
        announce_grpc(grpc_address)
        announce(url, key, options.model)
        await _wait_for_signal()
        print("draining: in-flight runs settle at a commit boundary…", flush=True)
        await runners.drain("handoff")


async def _start_embedded(
    settings: Settings, options: UpOptions, started: contextlib.AsyncExitStack
) -> tuple[EmbeddedEdge, EmbeddedRunners, str]:
    """Starts every service; each is stopped by `started` (in reverse order),
    also when a later one fails to start."""
    names = service_names(options.runners)
    ports = internal_ports(options.grpc_base_port, names)

    def address(name: str) -> str:
        return f"{INTERNAL_HOST}:{ports.get(name, 0)}"

    # Each stop is pushed before its start: it also undoes a half-done start.
    ledger = LedgerServer(settings, address("ledger"))
    started.push_async_callback(ledger.stop)
    await ledger.start()
    # The kernel undoes its own half-done start.
    kernel = await KernelServer(settings, address("kernel"), ledger_target=ledger.target).start()
    started.push_async_callback(kernel.stop)
    runner_config = RunnerConfig.from_env(ledger.target, kernel.target)
    # Everything listens on loopback here: an advertise address set for a
    # standalone runner would send edges elsewhere.
    runner_config = replace(runner_config, advertise_address="")
    # One compaction service for the runners and the edge (/context), unless
    # KEEL_COMPACTION_ADDRESS names one elsewhere.
    if not runner_config.compaction_target:
        compaction = CompactionServer(
            settings,
            ledger.target,
            kernel.target,
            address("compaction"),
            default_context_window=runner_config.default_context_window,
        )
        started.push_async_callback(compaction.stop)
        await compaction.start()
        runner_config = replace(runner_config, compaction_target=compaction.target)
    runners = EmbeddedRunners(settings, runner_config, [address(n) for n in names[3:]])
    started.push_async_callback(runners.stop)
    await runners.start()
    edge = EmbeddedEdge(
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
    )
    started.push_async_callback(edge.stop)
    await edge.start()
    return edge, runners, kernel.target


def fixed_ports_of(options: UpOptions, metrics_port: int | None) -> list[NamedPort]:
    """Every fixed port `options` (and `--metrics-port`) ask `keel up` to
    listen on, in start order; raises PortPlanError if they cannot all be."""
    if options.processes:
        names = service_names(options.runners, options.ledgers, options.kernels)
    else:
        names = service_names(options.runners)
    internal = internal_ports(options.grpc_base_port, names)
    metrics: dict[str, int] = {}
    if metrics_port is not None and options.processes:
        # One per child, as the supervisor gives them: this one and the next ones.
        children = [*names, "edge"]
        last = metrics_port + len(children) - 1
        if last > HIGHEST_PORT:
            raise PortPlanError(
                f"--metrics-port {metrics_port}: {len(children)} processes need ports up to "
                f"{last}, above {HIGHEST_PORT}"
            )
        metrics = {name: metrics_port + index for index, name in enumerate(children)}
    elif metrics_port is not None:
        metrics = {"up": metrics_port}
    return planned_ports(options.host, options.http_port, options.grpc_port, internal, metrics)


def default_processes(settings: Settings) -> bool:
    """Whether `keel up` without `--processes`/`--embedded` runs a process per
    service: on PostgreSQL, yes. Fifty busy sessions keep one process's core
    busy (the GIL), and the services on processes of their own answered
    20-25 % more turns a second with no slower single turn (`keel bench turns
    --layout split`, README). SQLite stays in one process: `make run` starts
    fastest that way, and its throughput is not what it is for."""
    return settings.uses_postgres


def data_dir_settings(settings: Settings, data_dir: Path | None) -> Settings:
    """`settings` on `data_dir` (default: theirs), which exists and is 0700."""
    if data_dir is not None:
        settings = settings.with_overrides(data_dir=data_dir)
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    close_data_dir(Path(settings.data_dir))
    return settings

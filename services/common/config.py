"""Settings shared by every service, read once from `KEEL_*` variables.

Settings are frozen so a running service never sees them change under it;
tests build their own instead of mutating the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.common import settings_registry as registry
from services.common.secrets import SecretPolicy
from services.common.setting import int_default, read_int, read_text

DEFAULT_LEASE_MS = int_default(registry.KEEL_LEASE_MS)
DEFAULT_MAX_FACT_BYTES = int_default(registry.KEEL_MAX_FACT_BYTES)
# The largest gRPC message a Keel server or channel takes: room for a batch
# of facts at their limit (the ledger refuses a larger fact by name first).
DEFAULT_GRPC_MAX_MESSAGE_BYTES = int_default(registry.KEEL_GRPC_MAX_MESSAGE_BYTES)


def _otlp_endpoint(env: Mapping[str, str], signal: str) -> str:
    return env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


@dataclass(frozen=True)
class Settings:
    """Process-wide configuration.

    `database_url` chooses the backend: a `postgresql://` URL selects
    PostgreSQL, anything else (or nothing) SQLite files under `data_dir`.
    """

    database_url: str = ""
    data_dir: Path = field(default_factory=lambda: Path(".keel"))
    lease_ms: int = DEFAULT_LEASE_MS
    max_fact_bytes: int = DEFAULT_MAX_FACT_BYTES
    grpc_max_message_bytes: int = DEFAULT_GRPC_MAX_MESSAGE_BYTES
    # Shared token every internal gRPC call must carry ("" disables the check;
    # the `keel <service>` commands refuse to start without it or mTLS).
    internal_token: str = ""
    # Internal gRPC over TLS: PEM files. With a CA, each side also checks the
    # other's certificate against it (mutual TLS).
    grpc_tls_cert: str = ""
    grpc_tls_key: str = ""
    grpc_tls_ca: str = ""
    # The name to verify in servers' certificates when it differs from the
    # address dialled (e.g. certificates issued for a service DNS name).
    grpc_tls_server_name: str = ""
    # Which secrets each tenant may name and where model calls may go.
    secrets: SecretPolicy = field(default_factory=SecretPolicy)
    # "none", "console" or "otlp".
    otel_exporter: str = "none"
    # Where `otlp` sends each signal: the standard variables, the signal's own
    # first (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, ..._METRICS_ENDPOINT), else
    # OTEL_EXPORTER_OTLP_ENDPOINT; "" = not configured, and nothing is sent.
    otlp_traces_endpoint: str = ""
    otlp_metrics_endpoint: str = ""
    log_level: str = "INFO"
    # PostgreSQL schema holding Keel's tables (tests use one per run).
    pg_schema: str = "public"

    @property
    def tracing(self) -> bool:
        """Whether gRPC calls carry spans: only when they go somewhere, since
        the instrumentation costs every call a share of a turn's budget."""
        exporter = self.otel_exporter.lower()
        return exporter == "console" or (exporter == "otlp" and bool(self.otlp_traces_endpoint))

    @property
    def grpc_tls(self) -> bool:
        return bool(self.grpc_tls_cert or self.grpc_tls_key or self.grpc_tls_ca)

    @property
    def uses_postgres(self) -> bool:
        return self.database_url.startswith(("postgres://", "postgresql://"))

    def sqlite_path(self, service: str) -> Path:
        """The SQLite file of one service (each service owns its own file)."""
        return self.data_dir / f"{service}.sqlite3"

    def with_overrides(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        return cls(
            database_url=read_text(env, registry.KEEL_DATABASE_URL),
            data_dir=Path(read_text(env, registry.KEEL_DATA_DIR)),
            lease_ms=read_int(env, registry.KEEL_LEASE_MS),
            max_fact_bytes=read_int(env, registry.KEEL_MAX_FACT_BYTES),
            grpc_max_message_bytes=read_int(env, registry.KEEL_GRPC_MAX_MESSAGE_BYTES),
            internal_token=read_text(env, registry.KEEL_INTERNAL_TOKEN),
            grpc_tls_cert=read_text(env, registry.KEEL_GRPC_TLS_CERT),
            grpc_tls_key=read_text(env, registry.KEEL_GRPC_TLS_KEY),
            grpc_tls_ca=read_text(env, registry.KEEL_GRPC_TLS_CA),
            grpc_tls_server_name=read_text(env, registry.KEEL_GRPC_TLS_SERVER_NAME),
            secrets=SecretPolicy.from_env(env),
            otel_exporter=read_text(env, registry.KEEL_OTEL_EXPORTER),
            otlp_traces_endpoint=_otlp_endpoint(env, "TRACES"),
            otlp_metrics_endpoint=_otlp_endpoint(env, "METRICS"),
            log_level=read_text(env, registry.KEEL_LOG_LEVEL),
            pg_schema=read_text(env, registry.KEEL_PG_SCHEMA),
        )

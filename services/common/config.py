"""Settings shared by every service, read once from `KEEL_*` variables.

Settings are frozen so a running service never sees them change under it;
tests build their own instead of mutating the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_LEASE_MS = 30_000
DEFAULT_MAX_FACT_BYTES = 1 << 20


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


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
    # Shared token every internal gRPC call must carry ("" disables the check).
    internal_token: str = ""
    # "none", "console" or "otlp".
    otel_exporter: str = "none"
    log_level: str = "INFO"
    # PostgreSQL schema holding Keel's tables (tests use one per run).
    pg_schema: str = "public"

    @property
    def tracing(self) -> bool:
        """Whether gRPC calls carry spans: only when they go somewhere, since
        the instrumentation costs every call a share of a turn's budget."""
        return self.otel_exporter.lower() != "none"

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
            database_url=env.get("KEEL_DATABASE_URL", ""),
            data_dir=Path(env.get("KEEL_DATA_DIR", ".keel")),
            lease_ms=_int(env, "KEEL_LEASE_MS", DEFAULT_LEASE_MS),
            max_fact_bytes=_int(env, "KEEL_MAX_FACT_BYTES", DEFAULT_MAX_FACT_BYTES),
            internal_token=env.get("KEEL_INTERNAL_TOKEN", ""),
            otel_exporter=env.get("KEEL_OTEL_EXPORTER", "none"),
            log_level=env.get("KEEL_LOG_LEVEL", "INFO"),
            pg_schema=env.get("KEEL_PG_SCHEMA", "public"),
        )

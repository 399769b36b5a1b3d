"""The internal token of tests, so test clusters run as deployed: closed.

The shared settings fixtures (tests/conftest.py) carry TEST_TOKEN, so every
in-process server checks it and every client built from those settings sends
it through the real interceptors; child processes get it through
`settings_env`. A test that opens a raw channel adds `token_metadata()`.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.common.config import Settings
from services.common.internal_auth import TOKEN_ENV, TOKEN_HEADER

TEST_TOKEN = "keel-test-internal-token-5b1f0c7e"


def with_token(settings: Settings, token: str = TEST_TOKEN) -> Settings:
    return settings.with_overrides(internal_token=token)


def auth_env(settings: Settings) -> dict[str, str]:
    """The variables that give a child process `settings`' internal auth."""
    env = {TOKEN_ENV: settings.internal_token}
    tls = {
        "KEEL_GRPC_TLS_CERT": settings.grpc_tls_cert,
        "KEEL_GRPC_TLS_KEY": settings.grpc_tls_key,
        "KEEL_GRPC_TLS_CA": settings.grpc_tls_ca,
        "KEEL_GRPC_TLS_SERVER_NAME": settings.grpc_tls_server_name,
    }
    env.update({name: value for name, value in tls.items() if value})
    return env


def token_env(env: Mapping[str, str] | None = None, token: str = TEST_TOKEN) -> dict[str, str]:
    """`env` (default: empty) with the test token."""
    return {**(env or {}), TOKEN_ENV: token}


def token_metadata(token: str = TEST_TOKEN) -> tuple[tuple[str, str]]:
    """Call metadata for a raw stub of an internal service."""
    return ((TOKEN_HEADER, token),)

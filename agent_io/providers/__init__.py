"""Model providers: the contract (`base`), the offline scripted model and the
two real wire protocols, plus the factory that builds one from a loadout.

    provider_from_loadout(model, tenant_id=, secrets=) -> Provider
                                                  model: the loadout's "model" object
    ScriptedModel                                 offline, deterministic (default)
    OpenAICompatible                              chat completions, `openai` SDK
    AnthropicMessages                             messages API, `anthropic` SDK

The two SDK adapters are imported on first use: the SDKs take well over a
second to import, which a runner on the default scripted model (and every
restart of a runner process) should not pay.

A model's key is read from the runner's environment only through the
operator's `SecretPolicy`, for the tenant whose loadout it is, and a model is
only called at an origin the policy allows: the kernel checked both when the
loadout was written, this checks them again at call time, so a grant the
operator withdrew since then (a runner restarted with another policy) is
refused here (kernel.loadout_secrets has the rules).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agent_io.providers.base import (
    Completed,
    ContextOverflow,
    ModelRequest,
    Provider,
    ProviderError,
    Purpose,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from agent_io.providers.scripted import DEFAULT_CONTEXT_WINDOW, ScriptedModel
from services.common.lazy_exports import lazy_exports
from services.common.secrets import (
    DEFAULT_KEY_ENV,
    OFFICIAL_BASE_URL,
    SecretNotGranted,
    SecretPolicy,
    origin_refused,
)

if TYPE_CHECKING:
    from agent_io.providers.anthropic_messages import AnthropicMessages
    from agent_io.providers.openai_compat import OpenAICompatible

__all__ = [
    "AnthropicMessages",
    "Completed",
    "ContextOverflow",
    "ModelConfigError",
    "ModelRequest",
    "OpenAICompatible",
    "Provider",
    "ProviderError",
    "Purpose",
    "ScriptedModel",
    "StreamEvent",
    "TextDelta",
    "ThinkingDelta",
    "ToolCallDelta",
    "ToolSpec",
    "Usage",
    "provider_from_loadout",
]

PROVIDER_KINDS = ("scripted", "openai", "anthropic")
# Sent when a custom base URL needs no key (a local OpenAI-compatible server):
# the SDKs refuse to build a client without one.
_NO_KEY = "unused"
_LAZY = {
    "AnthropicMessages": "agent_io.providers.anthropic_messages",
    "OpenAICompatible": "agent_io.providers.openai_compat",
}

# The SDK adapters load openai/anthropic: only when a loadout names them.
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


class ModelConfigError(ValueError):
    """A loadout's model cannot be built: malformed, an unknown provider, a
    missing key, or a secret or origin the operator does not allow. The
    attempt fails with this message; nothing is sent anywhere."""


def provider_from_loadout(
    model: Mapping[str, Any],
    *,
    tenant_id: str,
    secrets: SecretPolicy,
    env: Mapping[str, str] | None = None,
) -> Provider:
    """Build the provider a loadout's `model` object describes, for the
    tenant whose loadout it is, reading its key from `env` (default: the
    process's environment) through the operator's `secrets` policy.

    `{"provider": "scripted"|"openai"|"anthropic", "name", "baseUrl"?,
    "apiKeyEnv"?, "contextWindow"?, "maxOutputTokens"?, "tokenDelayMs"?,
    "thinking"? (anthropic only: the API's thinking config)}`.
    A missing provider means the scripted model. Raises ModelConfigError
    (a ValueError) on a malformed object, an unknown provider, a missing API
    key, a variable not granted to the tenant or an origin not allowed.
    """
    kind = model.get("provider", "scripted")
    if kind not in PROVIDER_KINDS:
        raise ModelConfigError(
            f"unknown model provider {kind!r}; expected one of {', '.join(PROVIDER_KINDS)}"
        )
    context_window = _optional_int(model, "contextWindow")
    max_output_tokens = _optional_int(model, "maxOutputTokens")
    if kind == "scripted":
        return ScriptedModel(
            model=_optional_str(model, "name") or "scripted",
            context_window=context_window or DEFAULT_CONTEXT_WINDOW,
            token_delay_ms=_optional_int(model, "tokenDelayMs", minimum=0) or 0,
            max_output_tokens=max_output_tokens,
        )
    name = _optional_str(model, "name")
    if not name:
        raise ModelConfigError(f"a {kind} model needs a 'name'")
    given_url = _optional_str(model, "baseUrl")
    # Always explicit: left unset, the SDKs would read *_BASE_URL from the
    # runner's environment and call somewhere no check has seen.
    base_url = given_url or OFFICIAL_BASE_URL[kind]
    if not secrets.allows_origin(base_url):
        raise ModelConfigError(f"the {kind} model {name!r}: {origin_refused(base_url, secrets)}")
    api_key = _api_key(model, kind, tenant_id, secrets, os.environ if env is None else env)
    if not api_key:
        if given_url is None:
            key_env = _optional_str(model, "apiKeyEnv") or DEFAULT_KEY_ENV[kind]
            raise ModelConfigError(f"the {kind} model {name!r} needs an API key in ${key_env}")
        # A server of the tenant's own that needs no key; the SDKs must be
        # given one, or they would read the runner's default variable.
        api_key = _NO_KEY
    if kind == "openai":
        from agent_io.providers.openai_compat import OpenAICompatible

        return OpenAICompatible(
            model=name,
            api_key=api_key,
            base_url=base_url,
            context_window=context_window,
            max_output_tokens=max_output_tokens,
        )
    thinking = model.get("thinking")
    if thinking is not None and not isinstance(thinking, Mapping):
        raise ModelConfigError(f"'thinking' must be an object, got {thinking!r}")
    from agent_io.providers.anthropic_messages import AnthropicMessages

    return AnthropicMessages(
        model=name,
        api_key=api_key,
        base_url=base_url,
        context_window=context_window,
        max_output_tokens=max_output_tokens,
        thinking=thinking,
    )


def _api_key(
    model: Mapping[str, Any],
    kind: str,
    tenant_id: str,
    secrets: SecretPolicy,
    env: Mapping[str, str],
) -> str | None:
    """The key the tenant's model sends. A variable the loadout names must be
    granted to the tenant; without one, the default variable is read only if
    it is granted (a `baseUrl` server may need no key)."""
    named = _optional_str(model, "apiKeyEnv")
    if named is None:
        default = DEFAULT_KEY_ENV[kind]
        return env.get(default) if secrets.may_read(tenant_id, default) else None
    try:
        return secrets.read(tenant_id, named, env)
    except SecretNotGranted as refused:
        raise ModelConfigError(f"the {kind} model's apiKeyEnv: {refused}") from None


def _optional_str(model: Mapping[str, Any], key: str) -> str | None:
    value = model.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ModelConfigError(f"model {key!r} must be a string, got {value!r}")


def _optional_int(model: Mapping[str, Any], key: str, *, minimum: int = 1) -> int | None:
    value = model.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ModelConfigError(f"model {key!r} must be an integer >= {minimum}, got {value!r}")
    return value

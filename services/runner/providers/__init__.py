"""Model providers: the contract (`base`), the offline scripted model and the
two real wire protocols, plus the factory that builds one from a loadout.

    provider_from_loadout(model) -> Provider     model: the loadout's "model" object
    ScriptedModel                                 offline, deterministic (default)
    OpenAICompatible                              chat completions, `openai` SDK
    AnthropicMessages                             messages API, `anthropic` SDK

The two SDK adapters are imported on first use: the SDKs take well over a
second to import, which a runner on the default scripted model (and every
restart of a runner process) should not pay.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from services.runner.providers.base import (
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
from services.runner.providers.scripted import DEFAULT_CONTEXT_WINDOW, ScriptedModel

if TYPE_CHECKING:
    from services.runner.providers.anthropic_messages import AnthropicMessages
    from services.runner.providers.openai_compat import OpenAICompatible

__all__ = [
    "AnthropicMessages",
    "Completed",
    "ContextOverflow",
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
_DEFAULT_KEY_ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
# Sent when a custom base URL needs no key (a local OpenAI-compatible server):
# the SDKs refuse to build a client without one.
_NO_KEY = "unused"
_LAZY = {
    "AnthropicMessages": "services.runner.providers.anthropic_messages",
    "OpenAICompatible": "services.runner.providers.openai_compat",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def provider_from_loadout(model: Mapping[str, Any]) -> Provider:
    """Build the provider a loadout's `model` object describes.

    `{"provider": "scripted"|"openai"|"anthropic", "name", "baseUrl"?,
    "apiKeyEnv"?, "contextWindow"?, "maxOutputTokens"?, "tokenDelayMs"?,
    "thinking"? (anthropic only: the API's thinking config)}`.
    A missing provider means the scripted model. Raises ValueError on a
    malformed object, an unknown provider or a missing API key.
    """
    kind = model.get("provider", "scripted")
    if kind not in PROVIDER_KINDS:
        raise ValueError(
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
        raise ValueError(f"a {kind} model needs a 'name'")
    base_url = _optional_str(model, "baseUrl")
    key_env = _optional_str(model, "apiKeyEnv") or _DEFAULT_KEY_ENV[kind]
    api_key = os.environ.get(key_env)
    if not api_key:
        if base_url is None:
            raise ValueError(f"the {kind} model {name!r} needs an API key in ${key_env}")
        api_key = _NO_KEY
    if kind == "openai":
        from services.runner.providers.openai_compat import OpenAICompatible

        return OpenAICompatible(
            model=name,
            api_key=api_key,
            base_url=base_url,
            context_window=context_window,
            max_output_tokens=max_output_tokens,
        )
    thinking = model.get("thinking")
    if thinking is not None and not isinstance(thinking, Mapping):
        raise ValueError(f"'thinking' must be an object, got {thinking!r}")
    from services.runner.providers.anthropic_messages import AnthropicMessages

    return AnthropicMessages(
        model=name,
        api_key=api_key,
        base_url=base_url,
        context_window=context_window,
        max_output_tokens=max_output_tokens,
        thinking=thinking,
    )


def _optional_str(model: Mapping[str, Any], key: str) -> str | None:
    value = model.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"model {key!r} must be a string, got {value!r}")


def _optional_int(model: Mapping[str, Any], key: str, *, minimum: int = 1) -> int | None:
    value = model.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"model {key!r} must be an integer >= {minimum}, got {value!r}")
    return value

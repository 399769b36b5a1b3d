"""What the settings registry tells about a process: its effective values
(secrets masked), the `KEEL_*` variables it would not know, and the README's
configuration table.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from services.common.setting import (
    SERVICES,
    Setting,
    read_choice,
    read_int,
    read_list,
    read_millis,
    read_number,
    read_text,
)
from services.common.settings_registry import BY_NAME, SETTINGS, declared

MASK = "****"
# The password of a URL (`scheme://user:password@host`), whatever the setting.
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/:@\s]*:)[^/@\s]+(?=@)", re.I)


@dataclass(frozen=True)
class Effective:
    """One setting's value in a process, as `keel config` shows it."""

    name: str
    value: str
    # "env" (set in the environment) or "default".
    source: str
    # Why the value set cannot be used ("" when it can).
    error: str = ""


@dataclass(frozen=True)
class Unknown:
    """A `KEEL_*` variable no setting declares, and the closest that does."""

    name: str
    suggestion: str | None

    def line(self) -> str:
        hint = f"did you mean {self.suggestion}?" if self.suggestion else "no setting is near it"
        return f"keel config: unknown variable {self.name} ({hint})"


def mask(setting: Setting, value: str) -> str:
    """`value` as it may be shown: a secret hidden, a URL's password hidden."""
    if setting.secret and value:
        return MASK
    return _URL_PASSWORD.sub(lambda m: m["head"] + MASK, value)


def _parsed(env: Mapping[str, str], setting: Setting) -> str:
    """The value `setting` takes in `env`, checked by its own parser."""
    if setting.kind == "int":
        return (
            ""
            if setting.default is None and not env.get(setting.name)
            else str(read_int(env, setting))
        )
    if setting.kind == "millis":
        return str(read_millis(env, setting))
    if setting.kind == "number":
        return f"{read_number(env, setting):g}"
    if setting.kind == "list":
        return ",".join(read_list(env, setting))
    if setting.kind == "choice":
        return read_choice(env, setting)
    return read_text(env, setting)


def effective(env: Mapping[str, str], *, every_scope: bool = False) -> list[Effective]:
    """Each setting's value in `env`: the service settings, and the test and
    bench ones that are set (all of them with `every_scope`). A family is
    shown by its members that are set."""
    shown: list[Effective] = []
    for setting in SETTINGS:
        if setting.family:
            members = sorted(name for name in env if setting.matches(name))
            shown.extend(Effective(name, mask(setting, env[name]), "env") for name in members)
            continue
        is_set = setting.name in env
        if setting.scope != "service" and not (is_set or every_scope):
            continue
        try:
            value, error = _parsed(env, setting), ""
        except ValueError as refusal:
            value, error = env.get(setting.name, ""), str(refusal)
        source = "env" if is_set else "default"
        shown.append(Effective(setting.name, mask(setting, value), source, error))
    return shown


def unknown(env: Mapping[str, str]) -> list[Unknown]:
    """The `KEEL_*` variables of `env` no setting declares, sorted."""
    names = list(BY_NAME)
    return [
        Unknown(name, next(iter(difflib.get_close_matches(name, names, n=1)), None))
        for name in sorted(env)
        if name.startswith("KEEL_") and declared(name) is None
    ]


def _amount(value: int, unit: str) -> str:
    if unit == "bytes":
        for size, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value >= size and value % size == 0:
                return f"{value // size} {suffix}"
    return f"{value:,}" + (f" {unit}" if unit else "")


def _default(setting: Setting) -> str:
    default = setting.default
    if default is None or default == "" or default == ():
        return "unset"
    if isinstance(default, tuple):
        return f"`{','.join(default)}`"
    if isinstance(default, int | float) and not isinstance(default, bool):
        return _amount(int(default), setting.unit)
    return f"`{default}`"


def _kind(setting: Setting) -> str:
    kind = {"millis": "ms", "number": "number", "list": "list", "choice": "choice"}.get(
        setting.kind, setting.kind
    )
    if setting.kind == "choice" or setting.choices:
        kind = " / ".join(f"`{choice}`" for choice in setting.choices)
    elif setting.unit and setting.kind != "millis":
        kind = f"{kind} ({setting.unit})"
    if setting.minimum is not None and setting.maximum is not None:
        kind += f", {setting.minimum} to {setting.maximum}"
    elif setting.minimum is not None and setting.minimum > 0:
        kind += f", ≥ {setting.minimum}"
    return kind + (", secret" if setting.secret else "")


def _readers(setting: Setting) -> str:
    if not set(SERVICES) <= set(setting.readers):
        return ", ".join(setting.readers)
    others = [reader for reader in setting.readers if reader not in SERVICES]
    return ", ".join(["every service", *others])


def markdown_table() -> str:
    """The README's configuration table: every setting, one row each."""
    rows = [
        "| Variable | Type | Default | Read by | What it sets |",
        "| --- | --- | --- | --- | --- |",
    ]
    for setting in SETTINGS:
        name = f"`{setting.name}<NAME>`" if setting.family else f"`{setting.name}`"
        readers = _readers(setting)
        if setting.scope != "service":
            readers += f" ({setting.scope} only)"
        rows.append(
            f"| {name} | {_kind(setting)} | {_default(setting)} | {readers} | {setting.doc} |"
        )
    return "\n".join(rows) + "\n"

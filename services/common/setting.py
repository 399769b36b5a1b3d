"""One `KEEL_*` variable as the settings registry declares it, and the one
parser of each kind of value.

Every reader of a `KEEL_*` variable goes through `read_int`, `read_millis`,
`read_number`, `read_text`, `read_choice`, `read_list` or `read_raw` with the
variable's declaration (services.common.settings_registry), so a variable
has one default, one parser and one error message wherever it is read. An
empty value counts as unset everywhere except through `read_raw`, for the
few variables whose empty value means something of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

# int: a whole number (with a unit, and bounds when it has any); millis: a
# duration in whole milliseconds, never negative; number: a positive finite
# number; text: any string; choice: one of a few words; list: comma-separated.
Kind = Literal["int", "millis", "number", "text", "choice", "list"]
# service: configures a Keel process; test / bench: read only by the test
# suite or the benchmarks, declared so `keel config` knows them.
Scope = Literal["service", "test", "bench"]
# Who reads a variable: a service, the CLI, the shipped packages (which read
# by name, not through the registry), the benchmarks or the tests.
READERS = frozenset(
    {
        "ledger",
        "kernel",
        "runner",
        "compaction",
        "edge",
        "cli",
        "keel_tools",
        "keel_client",
        "bench",
        "tests",
    }
)
SERVICES = ("ledger", "kernel", "runner", "compaction", "edge", "cli")

Default = int | float | str | tuple[str, ...] | None


@dataclass(frozen=True)
class Setting:
    """A declared `KEEL_*` variable: what it is, its default, who reads it."""

    name: str
    kind: Kind
    default: Default
    doc: str
    readers: tuple[str, ...]
    unit: str = ""
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    # Masked in `keel config`: a token, a key or a password.
    secret: bool = False
    scope: Scope = "service"
    # The name is a prefix: a family of variables named by another setting
    # (KEEL_TOOL_TOKEN_<NAME>, named by KEEL_TOOL_TOKENS).
    family: bool = False

    def __post_init__(self) -> None:
        if not self.name.startswith("KEEL_"):
            raise ValueError(f"{self.name}: a setting's name starts with KEEL_")
        unknown = set(self.readers) - READERS
        if not self.readers or unknown:
            raise ValueError(f"{self.name}: readers must be some of {sorted(READERS)}")
        if "|" in self.doc or "\n" in self.doc:
            raise ValueError(f"{self.name}: the doc is one line without '|' (a table cell)")

    def matches(self, variable: str) -> bool:
        """Whether `variable` is this setting (or one of its family)."""
        if self.family:
            return variable.startswith(self.name) and len(variable) > len(self.name)
        return variable == self.name


def int_default(setting: Setting) -> int:
    """The default of a whole-number setting, for the dataclass that holds it."""
    assert isinstance(setting.default, int), setting.name
    return setting.default


def _given(env: Mapping[str, str], setting: Setting) -> str:
    return env.get(setting.name, "").strip()


def read_raw(env: Mapping[str, str], setting: Setting) -> str | None:
    """The value as set, None when unset (an empty value is kept: for the
    variables where empty and unset differ)."""
    return env.get(setting.name)


def read_text(env: Mapping[str, str], setting: Setting) -> str:
    """A string; the default when unset or empty."""
    raw = env.get(setting.name, "")
    if raw == "":
        assert isinstance(setting.default, str), setting.name
        return setting.default
    return raw


def read_choice(env: Mapping[str, str], setting: Setting) -> str:
    """One of the setting's choices, as written (spaces and case kept)."""
    value = read_text(env, setting)
    if value not in setting.choices:
        raise ValueError(f"{setting.name} must be {' or '.join(setting.choices)}, got {value!r}")
    return value


def read_list(env: Mapping[str, str], setting: Setting) -> tuple[str, ...]:
    """Comma-separated items, each stripped, empty ones dropped."""
    raw = _given(env, setting)
    if not raw:
        assert isinstance(setting.default, tuple), setting.name
        return setting.default
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def _bounded(setting: Setting, value: int) -> int:
    unit = f" {setting.unit}" if setting.kind == "millis" else ""
    if setting.minimum is not None and value < setting.minimum:
        raise ValueError(f"{setting.name} must be >= {setting.minimum}{unit}, got {value}")
    if setting.maximum is not None and value > setting.maximum:
        raise ValueError(f"{setting.name} must be <= {setting.maximum}{unit}, got {value}")
    return value


def read_int(env: Mapping[str, str], setting: Setting) -> int:
    """A whole number (ASCII digits, an optional sign) within the bounds."""
    raw = _given(env, setting)
    if not raw:
        assert isinstance(setting.default, int), setting.name
        return setting.default
    try:
        if not raw.isascii():
            raise ValueError(raw)
        value = int(raw)
    except ValueError:
        raise ValueError(f"{setting.name} must be an integer, got {raw!r}") from None
    return _bounded(setting, value)


def read_millis(env: Mapping[str, str], setting: Setting) -> int:
    """A duration in whole milliseconds: ASCII digits only, within the bounds."""
    raw = _given(env, setting)
    if not raw:
        assert isinstance(setting.default, int), setting.name
        return setting.default
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"{setting.name} must be a whole number of milliseconds, got {raw!r}")
    return _bounded(setting, int(raw))


def read_number(env: Mapping[str, str], setting: Setting) -> float:
    """A positive finite number (a fraction allowed)."""
    raw = _given(env, setting)
    if not raw:
        assert isinstance(setting.default, int | float), setting.name
        return float(setting.default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{setting.name} must be a positive number, got {raw!r}")
    return value

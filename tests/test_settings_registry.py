"""Every `KEEL_*` variable is declared once, read through its declaration,
and documented in the README's generated table; `keel config` shows them.

The scans read names, not imports: a `KEEL_*` name anywhere in a package's
source (comments and docs too) must be a declared setting, a family member
(`KEEL_TOOL_TOKEN_ACME`) or a prefix of some (`KEEL_EDGE_*`); in the tests,
the names they read from the environment must be declared (as test-only).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

from edge.limits import ClientLimits
from kernel.config import KernelConfig
from services.blobs import BlobQuota
from services.common.config import Settings
from services.common.setting import Setting, read_int, read_millis, read_number
from services.common.settings_registry import SETTINGS, declared
from services.common.settings_report import MASK, markdown_table
from services.runner.config import RunnerConfig

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "agent_io",
    "compaction",
    "edge",
    "services",
    "kernel",
    "keel_tools",
    "keel_client",
    "bench",
    "scripts",
)
REGISTRY = ROOT / "services" / "common" / "settings_registry.py"
README = ROOT / "README.md"
# The keel of the environment running the tests (a checkout may keep its
# virtual environment elsewhere).
KEEL = Path(sys.executable).with_name("keel")
NAME = re.compile(r"KEEL_[A-Z0-9_]+")
# What a test reads from the environment (not what it sets for a child).
TEST_READ = re.compile(r"environ(?:\.get\(|\[)\s*[\"'](KEEL_[A-Z0-9_]+)")
# A read that bypasses the registry: a literal name handed to a mapping.
DIRECT_READ = re.compile(r"\b(?:environ|env)(?:\.get\(|\[)\s*[\"']KEEL_")
# Read by name on purpose: shipped alone, or not part of a service.
READ_BY_NAME = ("keel_tools", "keel_client", "bench")


def _sources(parts: Iterable[str]) -> list[Path]:
    return [
        path
        for part in parts
        for path in sorted((ROOT / part).rglob("*.py"))
        if path != REGISTRY and ".venv" not in path.parts
    ]


def _is_known(name: str) -> bool:
    """A declared setting, a family member, or a prefix in a doc (`KEEL_EDGE_*`)."""
    if declared(name) is not None:
        return True
    return name.endswith("_") and any(s.name.startswith(name) for s in SETTINGS)


def undeclared(paths: Iterable[Path], pattern: re.Pattern[str] = NAME) -> list[str]:
    """`path:name` for each `KEEL_*` name in `paths` that no setting declares."""
    return sorted(
        {
            f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}: {name}"
            for path in paths
            for name in pattern.findall(path.read_text())
            if not _is_known(name)
        }
    )


def unread(texts: dict[str, str]) -> list[str]:
    """Declared settings whose name (or registry constant, spelt the same)
    appears in none of `texts` (file -> text) of their readers."""
    dead = []
    for setting in SETTINGS:
        where = [
            text
            for path, text in texts.items()
            if setting.scope == "service" or path.startswith(("tests", "scripts", "bench"))
        ]
        if not any(setting.name in text for text in where):
            dead.append(setting.name)
    return dead


def readme_block(readme: str) -> str:
    _, _, rest = readme.partition("<!-- settings:begin -->\n")
    block, end, _ = rest.partition("<!-- settings:end -->\n")
    assert end, "README.md has no settings markers"
    return block


def _texts() -> dict[str, str]:
    paths = _sources(PACKAGES) + sorted((ROOT / "tests").rglob("*.py"))
    paths += [ROOT / "scripts" / "acceptance-all.sh"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths if p.exists()}


# ---------------------------------------------------------------- the scans


def test_every_keel_name_in_the_sources_is_declared() -> None:
    assert undeclared(_sources(PACKAGES)) == []


def test_every_keel_variable_a_test_reads_is_declared() -> None:
    # This file's probes name variables no setting declares, on purpose.
    tests = [p for p in sorted((ROOT / "tests").rglob("*.py")) if p != Path(__file__).resolve()]
    assert undeclared(tests, TEST_READ) == []


def test_the_scan_finds_an_undeclared_variable(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        'LIMIT = os.environ.get("KEEL_NOT_A_SETTING", "3")  # beside KEEL_EDGE_* and\n'
        "# KEEL_TOOL_TOKEN_BILLING, which are known\n"
    )
    assert undeclared([source]) == ["probe.py: KEEL_NOT_A_SETTING"]
    assert undeclared([source], TEST_READ) == ["probe.py: KEEL_NOT_A_SETTING"]


def test_every_declared_variable_is_read_somewhere() -> None:
    assert unread(_texts()) == []
    # And a declaration nothing reads would be named.
    assert unread({"services/x.py": ""}) == [s.name for s in SETTINGS]


def test_the_shipped_packages_read_their_variables_by_name() -> None:
    for package in ("keel_tools", "keel_client"):
        text = "".join(p.read_text() for p in _sources([package]))
        for setting in SETTINGS:
            if package in setting.readers:
                assert setting.name in text, f"{package} does not read {setting.name}"


def test_services_read_keel_variables_only_through_the_registry() -> None:
    parts = [p for p in PACKAGES if p not in READ_BY_NAME]
    direct = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _sources(parts)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if DIRECT_READ.search(line)
    ]
    assert direct == []


def test_names_are_unique_and_docs_are_one_line() -> None:
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    assert all(s.doc and "\n" not in s.doc for s in SETTINGS)


# ---------------------------------------------------------------- the README


def test_the_readme_table_is_the_generated_one() -> None:
    assert readme_block(README.read_text()) == markdown_table(), (
        "README.md's settings table is stale: run .venv/bin/python scripts/settings_table.py"
    )


def test_a_setting_missing_from_the_readme_is_seen() -> None:
    readme = README.read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `KEEL_LEASE_MS`"))
    assert readme_block(readme.replace(row + "\n", "")) != markdown_table()


# ---------------------------------------------------------------- defaults and parsers


def test_the_config_builders_take_the_registry_defaults() -> None:
    assert Settings.from_env({}) == Settings()
    assert KernelConfig.from_env({}) == KernelConfig()
    assert ClientLimits.from_env({}) == ClientLimits()
    assert BlobQuota.from_env({}) == BlobQuota()
    assert RunnerConfig.from_env("l:1", "k:2", {}) == RunnerConfig("l:1", "k:2")


@pytest.mark.parametrize(
    ("setting", "raw", "reader"),
    [
        (declared("KEEL_LEASE_MS"), "soon", read_int),
        (declared("KEEL_MAX_ATTEMPTS"), "0", read_int),
        (declared("KEEL_SWEEP_MS"), "-5", read_millis),
        (declared("KEEL_RECONCILE_MS"), "5", read_millis),
        (declared("KEEL_TOOL_TIMEOUT_S"), "0", read_number),
        (declared("KEEL_BLOB_QUOTA_BYTES"), "²", read_int),
    ],
)
def test_a_bad_value_is_refused_by_name(
    setting: Setting | None, raw: str, reader: Callable[[Mapping[str, str], Setting], object]
) -> None:
    assert setting is not None
    with pytest.raises(ValueError, match=setting.name):
        reader({setting.name: raw}, setting)


# ---------------------------------------------------------------- keel config


def _keel_config(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        [str(KEEL), "config", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_keel_config_prints_defaults_and_masks_secrets() -> None:
    token = "s3cret-token-0123456789abcdef"
    done = _keel_config(
        KEEL_INTERNAL_TOKEN=token,
        KEEL_DATABASE_URL="postgresql://keel:hunter2@db:5432/keel",
        KEEL_TOOL_TOKEN_ACME="acme-token-0123456789abcdefgh",
        KEEL_STICKY_MS="0",
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
    assert lines["KEEL_LEASE_MS"] == ["30000", "[default]"]
    assert lines["KEEL_STICKY_MS"] == ["0", "[env]"]
    assert lines["KEEL_INTERNAL_TOKEN"] == [MASK, "[env]"]
    assert lines["KEEL_TOOL_TOKEN_ACME"] == [MASK, "[env]"]
    assert lines["KEEL_DATABASE_URL"] == [f"postgresql://keel:{MASK}@db:5432/keel", "[env]"]
    assert "hunter2" not in done.stdout and token not in done.stdout
    assert "acme-token" not in done.stdout


def test_keel_config_refuses_an_unknown_variable_with_a_suggestion() -> None:
    done = _keel_config("--json", KEEL_LEASE_MSS="5000", KEEL_ZZZ_QQQ="1")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "keel config: unknown variable KEEL_LEASE_MSS (did you mean KEEL_LEASE_MS?)",
        "keel config: unknown variable KEEL_ZZZ_QQQ (no setting is near it)",
    ]
    report = json.loads(done.stdout)
    assert report["unknown"][0] == {"name": "KEEL_LEASE_MSS", "suggestion": "KEEL_LEASE_MS"}
    assert {"name": "KEEL_LEASE_MS", "value": "30000", "source": "default"} in report["settings"]


def test_keel_config_refuses_a_value_its_setting_cannot_take() -> None:
    done = _keel_config("--service", "kernel", KEEL_MAX_ATTEMPTS="0")
    assert done.returncode == 2
    assert "KEEL_MAX_ATTEMPTS must be >= 1" in done.stdout
    assert "KEEL_EDGE_MAX_HEADERS" not in done.stdout


def test_keel_config_knows_the_test_variables() -> None:
    done = _keel_config(KEEL_TEST_DATABASE_URL="postgresql://postgres@127.0.0.1:5432/test")
    assert done.returncode == 0, done.stderr
    assert "KEEL_TEST_DATABASE_URL" in done.stdout


def test_keel_config_markdown_is_the_table() -> None:
    done = _keel_config("--markdown")
    assert done.returncode == 0 and done.stdout == markdown_table()

"""The parts of Keel depend on each other in one direction only.

The leaf `agent_io` (model providers and tools) is shared by the runner and
the compaction service and imports neither; compaction never imports the
runner; the ledger knows nothing of the services that call it, and the kernel
only reads the ledger; the shipped client and tool-server packages depend only on the
generated contract. Every import of every module is read (including the ones
inside functions and under TYPE_CHECKING), so a deferred import cannot hide a
cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# part -> module prefixes it must never import.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "agent_io": (
        "services.runner",
        "services.ledger",
        "compaction.service",
        "compaction.server",
        "compaction.summarizer",
        "compaction.client",
        "kernel",
        "edge",
        "keel_client",
    ),
    "compaction": ("services.runner", "edge"),
    # The kernel reads the ledger (reconciling owed sessions), never the reverse.
    "kernel": ("services.runner", "compaction", "edge", "agent_io"),
    "services/ledger": ("services.runner", "kernel", "compaction", "edge", "agent_io"),
    "services/common": ("services.runner", "services.ledger", "kernel", "compaction", "edge"),
}
# Shipped alone to users: only the generated contract and themselves.
SELF_CONTAINED = ("keel_client", "keel_tools")
OUR_PACKAGES = ("agent_io", "services", "kernel", "compaction", "edge", "bench", "keel_client")


def _imports(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            # `from services import runner` names the module in the alias.
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _modules(part: str) -> list[Path]:
    return sorted((ROOT / part).rglob("*.py"))


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_part_never_imports_what_depends_on_it(part: str) -> None:
    assert _modules(part), f"{part} has no modules: the rule checks nothing"
    broken = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _modules(part)
        for module in _imports(path)
        if any(_under(module, prefix) for prefix in FORBIDDEN[part])
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("package", SELF_CONTAINED)
def test_shipped_packages_depend_only_on_the_contract(package: str) -> None:
    assert _modules(package), f"{package} has no modules: the rule checks nothing"
    broken = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _modules(package)
        for module in _imports(path)
        if any(_under(module, ours) for ours in OUR_PACKAGES if ours != package)
    ]
    assert not broken, "\n".join(broken)


def test_the_rules_see_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from services.runner.attempt import Attempt\n")
    assert "services.runner.attempt" in set(_imports(module))

"""The parts of Keel are layered: a part imports only the parts below it.

Bottom to top: the generated contracts, what every service shares, how a
service process starts, blobs, the ledger, the kernel (which reads the
ledger), the pure compaction policy, `agent_io` (model providers and tools,
which use the policy's token estimates), the compaction service, the runner,
the edge, the `keel` CLI, and the benchmarks and tests on top. The shipped client and tool-server
packages stand alone: they import only the contracts, and only the
benchmarks and tests import them.

Every import of every module is read (including the ones inside functions,
under TYPE_CHECKING, and `importlib.import_module` of a literal name), so a
deferred import cannot hide a cycle. The few imports that go up on purpose
are listed in `INTENDED_UPWARD`, each with its reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top: (part, the module prefixes that are that part). A module
# belongs to the part of its longest matching prefix, so `compaction.policy`
# is a part of its own, below `agent_io`, while the rest of `compaction` is
# above it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("contracts", ("keel",)),
    ("common", ("services.common",)),
    ("service start", ("services.service_start",)),
    ("session invariants", ("services.session_invariants",)),
    ("blobs", ("services.blobs", "services.blob_parts")),
    ("ledger", ("services.ledger",)),
    ("kernel", ("kernel",)),
    ("compaction policy", ("compaction.policy",)),
    ("agent_io", ("agent_io",)),
    ("compaction", ("compaction",)),
    ("runner", ("services.runner",)),
    ("edge", ("edge",)),
    ("cli", ("services.cli",)),
    ("bench", ("bench",)),
    ("tests", ("tests",)),
)
# Shipped to users on their own: they import only the contracts, and only
# these parts import them.
ALONE: dict[str, tuple[str, ...]] = {
    "keel_client": ("keel_client",),
    "keel_tools": ("keel_tools",),
}
ALONE_MAY_IMPORT = ("contracts",)
ALONE_IMPORTED_BY = ("bench", "tests")
# Packages that only hold parts (their __init__ imports nothing).
HOLDERS = ("services",)

# (importing module, imported module prefix) -> why it may point up.
# (`keel bench …` is mounted through its entry point, not an import.)
INTENDED_UPWARD: dict[tuple[str, str], str] = {}

PARTS: dict[str, tuple[str, ...]] = {**dict(LAYERS), **ALONE}
RANK = {part: rank for rank, (part, _) in enumerate(LAYERS)}
SOURCE_DIRS = (
    "keel_client",
    "keel_tools",
    "services",
    "kernel",
    "compaction",
    "agent_io",
    "edge",
    "bench",
    "tests",
)


def part_of(module: str) -> str | None:
    """The part `module` belongs to (longest prefix), or None if none of ours."""
    best: tuple[int, str] | None = None
    for part, prefixes in PARTS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), part)
    return None if best is None else best[1]


def imports(module: str, source: str, *, is_package: bool = False) -> Iterator[str]:
    """Every module name `source` (the text of `module`) imports, wherever."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base:
                yield base
            # `from services import runner` names the module in the alias.
            yield from (f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value


@dataclass(frozen=True)
class Violation:
    module: str
    imported: str
    reason: str

    def __str__(self) -> str:
        return f"{self.module} imports {self.imported}: {self.reason}"


def _intended(module: str, imported: str) -> bool:
    return any(
        module == importer and (imported == target or imported.startswith(target + "."))
        for importer, target in INTENDED_UPWARD
    )


def check(module: str, source: str, *, is_package: bool = False) -> list[Violation]:
    """What in `source` (the text of `module`) breaks the layer contract."""
    own = part_of(module)
    if own is None:
        if module in HOLDERS:
            return []
        return [Violation(module, "", "belongs to no part of the layer contract")]
    found: list[Violation] = []
    for imported in sorted(set(imports(module, source, is_package=is_package))):
        target = part_of(imported)
        if target is None or target == own or _intended(module, imported):
            continue
        if own in ALONE:
            if target not in ALONE_MAY_IMPORT:
                found.append(Violation(module, imported, f"{own} is shipped alone"))
        elif target in ALONE:
            if own not in ALONE_IMPORTED_BY:
                found.append(Violation(module, imported, f"{target} is shipped alone"))
        elif RANK[target] > RANK[own]:
            found.append(Violation(module, imported, f"{own} is below {target}"))
    return found


def _module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _sources() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def test_every_import_points_down_the_layers() -> None:
    broken: list[str] = []
    for path in _sources():
        module, is_package = _module_name(path)
        broken += map(str, check(module, path.read_text(), is_package=is_package))
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("part", [*RANK, *ALONE])
def test_every_part_has_modules(part: str) -> None:
    modules = [path for path in _sources() if part_of(_module_name(path)[0]) == part]
    if part == "contracts":
        return  # generated; its directory is not read for imports but exists
    assert modules, f"{part} has no modules: the rule checks nothing"


def test_every_intended_upward_import_exists() -> None:
    """An exception that no longer happens is removed, not left to excuse a
    new import of the same name."""
    for importer, target in INTENDED_UPWARD:
        path = ROOT / (importer.replace(".", "/") + ".py")
        seen = set(imports(importer, path.read_text()))
        assert any(m == target or m.startswith(target + ".") for m in seen), (importer, target)


@pytest.mark.parametrize(
    ("module", "source", "imported"),
    [
        # A deferred import from the kernel up to the runner.
        (
            "kernel.fake",
            "def f():\n    from services.runner.attempt import Attempt\n",
            "services.runner.attempt",
        ),
        # agent_io may use the policy, never the compaction service.
        ("agent_io.fake", "import compaction.service\n", "compaction.service"),
        # The ledger knows nothing of the kernel, even for type hints.
        (
            "services.ledger.fake",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kernel import Lease\n",
            "kernel",
        ),
        # A service's entry point does not import the CLI.
        ("kernel.__main__", "from services.cli.main import main\n", "services.cli.main"),
        # Nothing below bench imports it, deferred or by name.
        (
            "services.cli.up",
            "import importlib\nimportlib.import_module('bench.turns')\n",
            "bench.turns",
        ),
        # The shipped client imports only the contracts.
        ("keel_client.fake", "from services.common import Settings\n", "services.common"),
        # And no service imports the shipped client.
        ("edge.fake", "from keel_client import KeelClient\n", "keel_client"),
    ],
)
def test_the_checker_reports_an_upward_import(module: str, source: str, imported: str) -> None:
    reported = {violation.imported for violation in check(module, source)}
    assert imported in reported


def test_the_checker_accepts_downward_imports() -> None:
    source = (
        "from compaction.policy import estimate_text_tokens\n"
        "from services.common.config import Settings\n"
        "from keel.tools.v1 import tools_pb2\n"
    )
    assert check("agent_io.fake", source) == []
    assert check("bench.fake", "from services.cli.up import bootstrap_tenant\n") == []


def test_a_relative_import_is_resolved() -> None:
    assert set(imports("kernel.fake", "from ..edge import app\n")) >= {"edge.app"}
    assert check("kernel.fake", "from ..edge import app\n")

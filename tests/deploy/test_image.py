"""deploy/Dockerfile: its structure, and its install steps really run.

No container engine works here, so the builder stage's RUN steps are run
as written in a temporary directory: the build context `docker build`
would send (.dockerignore applied) stands in for WORKDIR, a temporary
virtual environment for /opt/keel. The result must run `keel` and import
every service with runtime dependencies only.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dockerfile import (
    DOCKERFILE,
    Stage,
    export_context,
    ignored_by,
    is_ignored,
    parse,
    run_stage,
)
from tests.support.processes import ROOT

BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|cc|clang|make|build-essential|python3?-dev|libc6?-dev)\b")
PACKAGE_MANAGERS = re.compile(r"\b(apt-get|apt|apk|dnf|yum)\b")
# Every process the manifests start, imported the way `keel <service>` does.
SERVICE_MODULES = (
    "services.ledger.server",
    "kernel",
    "compaction.server",
    "services.runner.server",
    "edge.server",
    "services.cli.main",
)
TEST_ONLY = ("pytest", "mypy", "ruff", "grpc_tools", "hypothesis", "playwright")


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse(DOCKERFILE)


def test_two_stages_and_a_slim_python_final_stage(stages: list[Stage]) -> None:
    assert len(stages) >= 2, "multi-stage: the builder's tools stay out of the image"
    assert stages[0].name == "builder"
    assert stages[-1].base == "python:3.11-slim"
    assert stages[0].base == stages[-1].base, "the venv's python links to the same interpreter"


def test_final_stage_runs_keel_as_a_numeric_non_root_user(stages: list[Stage]) -> None:
    final = stages[-1]
    users = final.values("USER")
    assert users, "the final stage sets USER"
    uid, _, gid = users[-1].partition(":")
    # runAsNonRoot can only verify a numeric user.
    assert uid.isdigit() and int(uid) > 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) > 0), users[-1]
    entrypoints = [i.exec_form for i in final.instructions if i.keyword == "ENTRYPOINT"]
    assert entrypoints[-1] == ["keel"]


def test_final_stage_ships_no_build_tools_or_sources(stages: list[Stage]) -> None:
    final = stages[-1]
    for command in final.values("RUN"):
        assert not BUILD_TOOLS.search(command), command
        assert not PACKAGE_MANAGERS.search(command), command
        assert "pip" not in command, "the final stage installs nothing: it copies the venv"
    copies = final.values("COPY") + final.values("ADD")
    assert copies, "the final stage copies the builder's venv"
    for copy in copies:
        assert copy.startswith("--from="), f"the final stage copies only from the builder: {copy}"


def test_read_only_root_needs_a_data_volume(stages: list[Stage]) -> None:
    final = stages[-1]
    env = final.env()
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    volumes = [v.strip('[]" ') for value in final.values("VOLUME") for v in value.split(",")]
    data_dir = env["KEEL_DATA_DIR"]
    assert any(data_dir.startswith(v.rstrip("/") + "/") for v in volumes), (data_dir, volumes)


def test_dockerignore_keeps_local_state_and_tests_out() -> None:
    rules = ignored_by(ROOT / ".dockerignore")
    for path in (
        ".git/config",
        ".venv/bin/python",
        ".keel/ledger.sqlite3",
        "tests/conftest.py",
        "edge/__pycache__/app.cpython-311.pyc",
        ".env",
    ):
        assert is_ignored(path, rules), path
    for path in ("pyproject.toml", "README.md", "edge/static/index.html", "keel/__init__.py"):
        assert not is_ignored(path, rules), path


@pytest.mark.slow
def test_builder_steps_install_a_working_keel(stages: list[Stage], tmp_path: Path) -> None:
    builder = stages[0]
    for command in builder.values("RUN"):
        # Run here as written: they must not need the system's package manager.
        assert not PACKAGE_MANAGERS.search(command), command
    context = tmp_path / "context"
    files = export_context(context)
    assert "pyproject.toml" in files and not any(f.startswith("tests/") for f in files)
    workdir = builder.values("WORKDIR")[-1]
    venv_path = builder.env()["VIRTUAL_ENV"]
    venv = tmp_path / "venv"
    run_stage(builder, {venv_path: venv, workdir: context}, Path(sys.executable).parent)

    keel = subprocess.run(
        [str(venv / "bin" / "keel"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert keel.returncode == 0, keel.stderr
    assert "ledger" in keel.stdout and "runner" in keel.stdout and "edge" in keel.stdout
    absent = (*TEST_ONLY, "pip", "setuptools")
    probe = (
        "import importlib, importlib.util\n"
        f"for name in {SERVICE_MODULES!r}: importlib.import_module(name)\n"
        f"print([n for n in {absent!r} if importlib.util.find_spec(n)])\n"
    )
    imported = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]", f"not runtime dependencies: {imported.stdout}"

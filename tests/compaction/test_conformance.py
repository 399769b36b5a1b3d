"""Every shared conformance case through `compaction.conformance.run_case`.

The cases live beside COMPACTION.md in the shared directory
(`$KEEL_SHARED_DIR`, default `<repo>/../shared`). A missing file is a
failure, not a skip: without it the policy is untested.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from compaction.conformance import run_case

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES_RELATIVE_PATH = Path("conformance") / "compaction-cases.json"


def cases_path() -> Path:
    shared_dir = os.environ.get("KEEL_SHARED_DIR") or str(REPO_ROOT.parent / "shared")
    return Path(shared_dir) / CASES_RELATIVE_PATH


def load_cases() -> list[Any]:
    path = cases_path()
    if not path.is_file():
        # One failing placeholder instead of an empty (silently skipped) set.
        return [pytest.param(None, id="cases-file-missing")]
    cases = json.loads(path.read_text(encoding="utf-8"))["cases"]
    return [pytest.param(case, id=case["name"]) for case in cases]


@pytest.mark.parametrize("case", load_cases())
def test_conformance_case(case: dict[str, Any] | None) -> None:
    if case is None:
        pytest.fail(
            f"compaction conformance cases not found at {cases_path()}; "
            "set KEEL_SHARED_DIR to the directory holding conformance/compaction-cases.json"
        )
    assert run_case(case) == case["expect"]


def test_case_names_are_unique() -> None:
    path = cases_path()
    if not path.is_file():
        pytest.fail(f"compaction conformance cases not found at {path}")
    names = [case["name"] for case in json.loads(path.read_text(encoding="utf-8"))["cases"]]
    assert len(names) == len(set(names))

"""Every shared conformance case through `compaction.conformance.run_case`.

The cases are a copy of the shared conformance file kept in the repository
(`tests/compaction/conformance/`), so a clone alone runs them;
`$KEEL_SHARED_DIR` points at another copy (a newer shared directory). A
missing file is a failure, not a skip: without it the policy is untested.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from compaction.conformance import run_case

HERE = Path(__file__).resolve().parent
CASES_RELATIVE_PATH = Path("conformance") / "compaction-cases.json"


def cases_path() -> Path:
    shared_dir = os.environ.get("KEEL_SHARED_DIR")
    return Path(shared_dir or HERE) / CASES_RELATIVE_PATH


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

"""The committed generated code is exactly what the protos produce."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "keel").rglob("*") if p.is_file())
    committed = sorted(
        p.relative_to(ROOT)
        for p in (ROOT / "keel").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh == committed, "run scripts/gen_protos.py: the file set changed"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert stale == [], f"run scripts/gen_protos.py: stale generated files {stale}"


def test_every_service_has_a_versioned_contract() -> None:
    for service in ("ledger", "kernel", "runner", "compaction"):
        protos = list((ROOT / "protos" / "keel" / service / "v1").glob("*.proto"))
        assert protos, f"no contract for {service}"
        text = protos[0].read_text()
        assert f"package keel.{service}.v1;" in text

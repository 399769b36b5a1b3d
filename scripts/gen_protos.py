"""Regenerate the fenced-off contract package `keel/` from `protos/`.

Everything under `keel/` is generated: Python messages, gRPC stubs and mypy
stubs for every `protos/keel/<service>/v1/*.proto`. Run this after editing a
contract; `tests/test_contracts.py` fails when the committed code is stale.

    python scripts/gen_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
HEADER = '"""Generated contracts of Keel. Do not edit: run scripts/gen_protos.py."""\n'


def proto_files() -> list[Path]:
    return sorted(PROTOS.rglob("*.proto"))


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).resolve().parent / "_proto")
    # The mypy plugins are console scripts beside this interpreter.
    bindir = Path(sys.executable).parent
    for proto in proto_files():
        args = [
            "protoc",
            f"-I{PROTOS}",
            f"-I{include}",
            f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto.relative_to(ROOT)}")
    # Packages for every generated directory, so imports work without
    # namespace-package lookups.
    for directory in [out / "keel", *sorted((out / "keel").rglob("*"))]:
        if directory.is_dir() and directory.name != "__pycache__":
            (directory / "__init__.py").write_text(HEADER)
    (out / "keel" / "py.typed").write_text("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo)")
    args = parser.parse_args()
    generate(args.out)
    print(f"generated {len(proto_files())} contracts into {args.out / 'keel'}", file=sys.stderr)


if __name__ == "__main__":
    main()

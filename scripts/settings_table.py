"""Writes the README's configuration table from the settings registry.

    .venv/bin/python scripts/settings_table.py          # rewrite README.md
    .venv/bin/python scripts/settings_table.py --check  # exit 1 if it differs

The table sits between `<!-- settings:begin -->` and `<!-- settings:end -->`;
everything else in the README is left as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.settings_report import markdown_table  # noqa: E402

README = ROOT / "README.md"
BEGIN = "<!-- settings:begin -->\n"
END = "<!-- settings:end -->\n"


def with_table(readme: str, table: str) -> str:
    """`readme` with the block between the markers replaced by `table`."""
    head, begin, rest = readme.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not (begin and end):
        raise SystemExit(f"{README.name}: the settings markers are missing")
    return head + BEGIN + table + END + tail


def main(argv: list[str]) -> int:
    current = README.read_text()
    wanted = with_table(current, markdown_table())
    if "--check" in argv:
        if wanted != current:
            print("README.md's settings table is stale: run scripts/settings_table.py")
            return 1
        return 0
    if wanted != current:
        README.write_text(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

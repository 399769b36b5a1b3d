"""`python -m compaction …`: the same command as `keel compaction …`, with the
same start-up checks (internal credentials, private files)."""

from __future__ import annotations

import sys

from services.cli.main import main

if __name__ == "__main__":
    sys.argv[1:1] = ["compaction"]
    main()

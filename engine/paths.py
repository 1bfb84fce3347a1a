"""Where kvlease keeps what it builds and records: one root, `KVLEASE_HOME`."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "KVLEASE_HOME"


def kvlease_home() -> Path:
    """`$KVLEASE_HOME`, else `~/.cache/kvlease` (demo model, ledger, run files)."""
    root = os.environ.get(HOME_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvlease"

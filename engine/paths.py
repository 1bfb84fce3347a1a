"""Where kvlease keeps what it builds and records: one root, `KVLEASE_HOME`."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

HOME_ENV = "KVLEASE_HOME"


def kvlease_home() -> Path:
    """`$KVLEASE_HOME`, else `~/.cache/kvlease` (demo model, ledger, run files)."""
    root = os.environ.get(HOME_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvlease"


def private_dir(path: Path) -> Path:
    """`path` made (with its parents) readable by this user only, 0700: it holds the
    ledger, its dead letters and run files, which name tenants and what they spent.
    A folder that exists already keeps its mode: an operator chose it."""
    if not path.is_dir():
        path.mkdir(parents=True, mode=0o700, exist_ok=True)
        path.chmod(0o700)  # mkdir's mode is masked by the umask
    return path


def private_file(path: Path) -> Path:
    """`path` created empty with mode 0600 if it does not exist yet (before a database
    or an appender opens it with the umask's 0644)."""
    private_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path

"""A throwaway PostgreSQL cluster for tests and benches: Debian's server, a temporary folder,
a free port.

initdb refuses to run as root, so as root the cluster runs as the `postgres` user.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    """A loopback port free now (the tests' and benches' servers start on one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(*command: str) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.getuid() == 0 else list(command)


@contextmanager
def postgres_cluster():
    """Yields a `postgresql://` URL of a fresh database; removes everything afterwards."""
    bindirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    if not bindirs:
        raise RuntimeError("PostgreSQL is not installed (make test installs Debian's postgresql)")
    bindir = Path(bindirs[-1])
    root = Path(tempfile.mkdtemp(prefix="kvlease-pg-"))
    data, port = root / "data", free_port()
    if os.getuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    try:
        subprocess.run(
            _as_postgres(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"),
            check=True,
            capture_output=True,
        )
        subprocess.run(
            _as_postgres(
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(root / "log"),
                "-w",
                "start",
                "-o",
                f"-p {port} -k {root} -c listen_addresses=127.0.0.1",
            ),
            check=True,
            capture_output=True,
        )
        subprocess.run(
            _as_postgres(
                str(bindir / "createdb"),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-U",
                "postgres",
                "kvlease",
            ),
            check=True,
            capture_output=True,
        )
        yield f"postgresql://postgres@127.0.0.1:{port}/kvlease"
    finally:
        subprocess.run(
            _as_postgres(str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"),
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)

"""mypy over the modules that import nothing from vLLM and hold the scheduling policy,
strict: the victim order, fair share, leases and the free queue.

mypy does not follow setuptools' package-dir mapping, so it reads a tree of symlinks that
is the installed shape (`kvlease/engine` -> `engine/`, ...)."""

from __future__ import annotations

import subprocess
import sys

from layout import FOLDERS, ROOT

STRICT = ("engine/policy.py", "engine/fairness.py", "engine/leases.py", "engine/free_queue.py")


def test_the_policy_modules_type_check_strictly(tmp_path):
    package = tmp_path / "kvlease"
    package.mkdir()
    for name in ("__init__.py", "__main__.py"):
        (package / name).symlink_to(ROOT / "kvlease" / name)
    for folder in FOLDERS:
        (package / folder).symlink_to(ROOT / folder)
    ran = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         "--cache-dir", str(tmp_path / ".mypy_cache"), *(f"kvlease/{m}" for m in STRICT)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr

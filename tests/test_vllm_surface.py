"""Every vLLM name, container and behaviour the scheduler adapter relies on
(`kvlease.engine.vllm_scheduler.VLLM_SURFACE`) is still there, on the vLLM this runs
against: 0.32.0 in `make test`, 0.33.0 in `make test-vllm-next`. A failure names the
row, and the row says why kvlease needs it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from vllm.config import ParallelConfig
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
from vllm.v1.core.sched import request_queue
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.request import Request

from kvlease.engine.vllm_scheduler import VLLM_SURFACE
from kvlease.replay.synthetic import make_scheduler

CLASSES = {
    "Scheduler": Scheduler,
    "KVCacheManager": KVCacheManager,
    "FreeKVCacheBlockQueue": FreeKVCacheBlockQueue,
    "ParallelConfig": ParallelConfig,
    "request_queue": request_queue,
    "SchedulerOutput": SchedulerOutput,
    "NewRequestData": NewRequestData,
    "CachedRequestData": CachedRequestData,
    "SingleTypeKVCacheManager": SingleTypeKVCacheManager,
    "Request": Request,
}


@pytest.fixture(scope="module")
def built(demo_model):
    """A stock scheduler, built as vLLM builds one: its instance attributes are real."""
    scheduler = make_scheduler(Scheduler, demo_model, 64)
    manager = scheduler.kv_cache_manager
    return {"scheduler": scheduler, "kv_cache_manager": manager, "block_pool": manager.block_pool}


def _row_id(row) -> str:
    where, what, _, _ = row
    return f"{where}.{what}"


def test_the_table_names_every_private_vllm_name_the_adapter_reads():
    """Each `self._x` the adapter calls on vLLM, and each vLLM class it names, is a row."""
    import kvlease.engine.vllm_scheduler as adapter

    source = inspect.getsource(adapter)
    rows = {what for _, what, _, _ in VLLM_SURFACE}
    for name in ("_preempt_request", "_free_request", "_free_request_blocks"):
        assert name in rows
    assert "_request_blocks_can_be_freed" in source and "_request_blocks_can_be_freed" in rows
    assert "_api_process_count" in source and "_api_process_count" in rows


@pytest.mark.parametrize("row", VLLM_SURFACE, ids=_row_id)
def test_each_row_of_the_vllm_surface_holds(row, built):
    where, what, expected, why = row
    if what == "behaviour":
        owner, _, method = where.partition(".")
        source = inspect.getsource(getattr(CLASSES[owner], method) if method else CLASSES[owner])
        assert all(text in source for text in expected), f"{where}: {why}"
    elif where in built:
        assert hasattr(built[where], what), f"{where}.{what}: {why}"
    else:
        owner = CLASSES[where]
        if dataclasses.is_dataclass(owner) and what in {f.name for f in dataclasses.fields(owner)}:
            return  # a field (without a default, a dataclass field is no class attribute)
        if where == "ParallelConfig":
            assert what in inspect.signature(owner).parameters or hasattr(owner, what), why
            return
        attribute = getattr(owner, what, None)
        assert attribute is not None, f"{where}.{what}: {why}"
        if expected:
            params = [p for p in inspect.signature(attribute).parameters if p != "self"]
            assert params[: len(expected)] == list(expected), f"{where}.{what}: {why}"

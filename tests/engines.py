"""Real in-process vLLM engines for tests, built once per test session.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so
tests can read the scheduler's state and move its clock. Each start costs
about 30 s on two cores; every engine test shares these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from clocks import OffsetClock
from vllm.v1.core.sched.scheduler import Scheduler

from kvlease.engine.tenancy import TierTable

POOL_BLOCKS = 24  # 23 usable: vLLM keeps one null block
BLOCK_SIZE = 32
# The longest request the shipped lease caps leave room for (kvlease refuses more).
MAX_MODEL_LEN = TierTable.shipped().max_request_tokens(POOL_BLOCKS - 1, BLOCK_SIZE)


class RecordingScheduler(Scheduler):
    """Stock vLLM scheduling, plus a record of who was preempted and who else was running."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.preemptions: list[tuple[str | None, list[str | None]]] = []

    def _preempt_request(self, request, *args, **kwargs):
        tier = (request.sampling_params.extra_args or {}).get("tier")
        others = [(r.sampling_params.extra_args or {}).get("tier") for r in self.running]
        self.preemptions.append((tier, others))
        return super()._preempt_request(request, *args, **kwargs)


@dataclass
class Engine:
    llm: Any
    scheduler: Any
    records: list = field(default_factory=list)


def start_engine(model: str, scheduler_cls: Any, **kwargs: Any) -> Engine:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm import LLM

    llm = LLM(
        model=model,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=POOL_BLOCKS,
        enable_prefix_caching=True,
        seed=0,
        scheduler_cls=scheduler_cls,
        **kwargs,
    )
    return Engine(llm, llm.llm_engine.engine_core.engine_core.scheduler)


def recording(cls: type) -> type:
    """A kvlease scheduler class that also records each victim's tier and who else was running."""

    class Recording(cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.preemptions: list[tuple[str | None, list[str | None]]] = []

        def _preempt_request(self, request, *args, **kwargs):
            others = [self.kvlease.tenancy[r.request_id].tier for r in self.running]
            self.preemptions.append((self.kvlease.tenancy[request.request_id].tier, others))
            return super()._preempt_request(request, *args, **kwargs)

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


def settle(engine: Engine) -> None:
    """Expire every lease, forget every think time and reservation payback and empty the
    prefix cache, so tests do not see each other (one test's one-shot sessions would end
    another's reservations)."""
    scheduler = engine.scheduler
    if hasattr(scheduler, "kvlease"):
        if not isinstance(scheduler.kvlease.clock, OffsetClock):
            scheduler.kvlease.clock = OffsetClock()
        scheduler.kvlease.clock.offset += 10_000
        scheduler._expire_leases()
        scheduler.forget_history()
    assert engine.llm.reset_prefix_cache()

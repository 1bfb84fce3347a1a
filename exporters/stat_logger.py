"""The stat-logger plugin (`vllm.stat_logger_plugins`: kvlease_stats): a vLLM adapter.

One of the modules that import vLLM (the README's architecture lists them;
tests/test_layers.py keeps the list true). vLLM calls `record()` in the API process
after each engine step with `FinishedRequestStats` for the requests that just finished: prompt,
cached and generated tokens, latencies. kvlease attributes each to the tenant
the middleware verified for that request id, and feeds the metrics and the
request join behind spans and the usage ledger (`kvlease.exporters.telemetry`).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from kvlease.engine import processes
from kvlease.exporters.telemetry import TELEMETRY


class KvleaseStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.telemetry = TELEMETRY.start()

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is None:
            return
        metrics, join = self.telemetry.metrics, self.telemetry.join
        assert metrics is not None  # TELEMETRY.start() registered them
        for stats in iteration_stats.finished_requests:
            entry = join.entry(stats.request_id)
            ctx = entry.ctx if entry else None
            tenant, tier = (ctx.tenant_id, ctx.tier) if ctx else (None, None)
            metrics.request_finished(tenant, tier, stats)
            join.request_stats(stats, entry)

    def log_engine_initialized(self) -> None:
        """The engine is up: under `kvlease serve`, a stop may now take its drain."""
        processes.mark_ready()

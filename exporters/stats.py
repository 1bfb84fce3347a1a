"""The stat-logger plugin (`vllm.stat_logger_plugins`: kvlease_stats).

vLLM calls `record()` in the API process after each engine step with
`FinishedRequestStats` for the requests that just finished: prompt, cached
and generated tokens, latencies. kvlease attributes each to the tenant that
TenantMiddleware verified for that request id and feeds kvlease's metrics,
and the request join behind spans and the usage ledger (exporters.requests).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from exporters import ledger, metrics, tracing
from exporters.engine_view import VIEW
from exporters.requests import JOIN


class KvleaseStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.metrics = metrics.install()
        tracing.install()  # a span per finished request, when tracing is on
        ledger.install()  # a usage record per finished request, when a ledger is set
        if JOIN.consumers:
            VIEW.add_listener(JOIN.engine_event)
            JOIN.start()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if iteration_stats is None:
            return
        for stats in iteration_stats.finished_requests:
            entry = metrics.in_flight(stats.request_id)
            ctx = entry.ctx if entry else None
            self.metrics.request_finished(
                ctx.tenant_id if ctx else None, ctx.tier if ctx else None, stats
            )
            if JOIN.consumers:
                JOIN.request_stats(stats, entry)

    def log_engine_initialized(self) -> None:
        pass

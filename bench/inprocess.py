"""The in-process vLLM engines bench/policy.py drives, and kvlease's telemetry beside them.

`start_engine` builds a real `LLMEngine` with its EngineCore in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the benchmark can step it and read its
scheduler. `observed` wraps any scheduler class to count, without deciding
anything, the tokens each request was scheduled and each preemption.
`Telemetry` runs what `kvlease serve`'s API process runs, in this process.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvlease.demo.workload import TIERS, Turn
from kvlease.engine.tenancy import TenantContext, TierTable
from kvlease.exporters.ledger import DB_ENV
from kvlease.exporters.tracing import ENABLE_ENV as OTEL_ENV

BLOCK_SIZE = 32


def max_model_len(pool: int) -> int:
    """The longest request the lease caps ($KVLEASE_TIERS, else the shipped table) leave
    room for on `pool` blocks (vLLM keeps one back); every way of a benchmark gets it."""
    return min(TierTable.load().max_request_tokens(pool - 1, BLOCK_SIZE), 4096)  # the model


@dataclass
class Observations:
    """What the observing subclass saw: tokens computed per request, and each preemption."""

    computed: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    preemptions: list[tuple[str, str | None, int, bool]] = field(default_factory=list)
    steps: int = 0


def observed(cls: type) -> type:
    """`cls` plus counting: tokens scheduled per request and each victim. Decides nothing."""
    rank = {tier: i for i, tier in enumerate(TIERS)}

    class Observed(cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.bench = Observations()

        def schedule(self, *args: Any, **kwargs: Any):
            out = super().schedule(*args, **kwargs)
            self.bench.steps += 1
            for rid, n in out.num_scheduled_tokens.items():
                self.bench.computed[_external(rid)] += n
            return out

        def _preempt_request(self, request, *args: Any, **kwargs: Any):
            tier = _tier(request)
            lower = any(rank.get(_tier(r), 9) > rank.get(tier, 9) for r in self.running)
            self.bench.preemptions.append(
                (_external(request.request_id), tier, request.num_computed_tokens, lower)
            )
            return super()._preempt_request(request, *args, **kwargs)

    Observed.__name__ = f"Observed{cls.__name__}"
    return Observed


def _external(request_id: str) -> str:
    """The id given to `add_request`: vLLM appends "-" and 8 random characters."""
    return request_id.rsplit("-", 1)[0]


def _tier(request: Any) -> str | None:
    return (request.sampling_params.extra_args or {}).get("tier")


@dataclass
class Engine:
    name: str
    llm: Any  # vllm.v1.engine.llm_engine.LLMEngine, in-process
    telemetry: Telemetry | None = None

    @property
    def scheduler(self) -> Any:
        return self.llm.engine_core.engine_core.scheduler


def start_engine(
    name: str,
    model: str,
    scheduler_cls: type,
    policy: str,
    pool: int,
    kvlease: dict[str, Any] | None = None,
    max_len: int | None = None,
    **kw: Any,
) -> Engine:
    """A started engine whose scheduler is `observed(scheduler_cls)`; `kvlease` is the
    scheduler's `additional_config.kvlease` (e.g. the victim rule); `max_len` overrides
    the longest request the lease caps allow (`max_model_len`)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    started = time.perf_counter()
    args = EngineArgs(
        model=model,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=max_len or max_model_len(pool),
        num_gpu_blocks_override=pool,
        enable_prefix_caching=True,
        seed=0,
        scheduler_cls=observed(scheduler_cls),
        scheduling_policy=policy,
        disable_log_stats=kw.pop("disable_log_stats", True),
        additional_config={"kvlease": kvlease or {}},
    )
    llm = LLMEngine.from_engine_args(args, **kw)
    print(f"  engine {name}: ready in {time.perf_counter() - started:.0f} s", flush=True)
    return Engine(name, llm)


class Telemetry:
    """kvlease's API-process telemetry, in this process: what `kvlease serve` runs.

    The scheduler publishes over the ZeroMQ channel to the engine view; the
    stat-logger plugin feeds metrics, the request join, OTLP spans (to a local
    HTTP sink) and a SQLite usage ledger; a thread renders /metrics every second
    as a Prometheus scrape would. Each request gets the InFlight entry that
    TenantMiddleware would give it, under a `kvl-` id.
    """

    def __init__(self, workdir: Path) -> None:
        from kvlease.engine.channel import ADDRESS_ENV, new_address

        self.sink = _OtlpSink()
        self.db = workdir / "usage.db"
        os.environ[ADDRESS_ENV] = new_address()
        os.environ[DB_ENV] = f"sqlite:///{self.db}"
        os.environ[OTEL_ENV] = "1"
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"{self.sink.url}/v1/traces"
        from kvlease.exporters.telemetry import TELEMETRY

        self.telemetry = TELEMETRY.start()
        self.scrapes = 0
        self._stop = threading.Event()
        threading.Thread(target=self._scrape, name="bench-scrape", daemon=True).start()

    @staticmethod
    def stat_loggers() -> list:
        from kvlease.exporters.stat_logger import KvleaseStatLogger

        return [KvleaseStatLogger]

    def engine_started(self) -> None:
        """Only the telemetry engine publishes: later engines find no channel address."""
        from kvlease.engine.channel import ADDRESS_ENV

        del os.environ[ADDRESS_ENV]

    def request_id(self, turn: Turn) -> str:
        from kvlease.exporters.join import InFlight, new_request_id

        rid = new_request_id()
        ctx = TenantContext(turn.tenant_id, turn.tier, session_id=turn.session_id)
        entry = InFlight(ctx, "/v1/completions", time.time_ns(), None, "kvlease-demo")
        self.telemetry.join.in_flight[rid] = entry
        return rid

    def request_done(self, rid: str) -> None:
        self.telemetry.join.in_flight.pop(rid, None)

    def close(self) -> int:
        """Flush spans and usage records as `kvlease serve` does on exit; the ledger's
        request records (its KV retention records are not requests)."""
        from kvlease.exporters.ledger import UsageLedger

        self._stop.set()
        time.sleep(0.5)  # let the channel deliver the engine's last events
        self.telemetry.stop()
        return UsageLedger(f"sqlite:///{self.db}").count(requests_only=True)

    def _scrape(self) -> None:
        from prometheus_client import REGISTRY, generate_latest

        while not self._stop.wait(1.0):
            generate_latest(REGISTRY)
            self.scrapes += 1


class _OtlpSink:
    """Accepts OTLP/HTTP span exports and counts them: a collector that keeps nothing."""

    def __init__(self) -> None:
        sink = self
        self.exports = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                sink.exports += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

"""kvlease's Prometheus metrics: every family declared here, once, with its help text.

They join vLLM's own on the server's `/metrics` (vLLM's families are named
`vllm:...`, kvlease's `vllm_tenant_...`). Engine-side numbers (blocks,
leases, preemptions, evictions, block-seconds, recomputed tokens) are the
scheduler's cumulative totals from its latest snapshot (`kvlease.engine.channel`),
so they are exact, whatever happens to individual events. Per-request numbers
(tokens, outcomes, latencies) come from vLLM's own `FinishedRequestStats`
through the stat-logger plugin (`kvlease.exporters.stat_logger`), so they equal vLLM's own
counters. Tenant labels are bounded by `kvlease.engine.labels.TenantLabels`.

Dashboards, alert rules and the Streamlit page take these names from here
(`Family.name`, `Family.series`): no other file types a metric name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram, Summary
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from kvlease.engine import retention
from kvlease.engine.accounting import LEASE_OUTCOMES as LEASE_OUTCOMES  # LEASE_REUSE outcomes
from kvlease.engine.budgets import ALERT_RATIO
from kvlease.engine.events import EngineState, RequestDone, TenantHolding
from kvlease.engine.labels import UNCLASSIFIED, TenantLabels
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.join import finish_outcome
from kvlease.exporters.ranks import merge_states
from kvlease.exporters.view import EngineView

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's; vLLM sets it


@dataclass(frozen=True)
class Family:
    name: str  # as scraped; counters end in _total
    kind: str  # "counter", "gauge", "histogram" or "summary" (count and sum)
    help: str
    labels: tuple[str, ...] = ()
    process: bool = False  # arises in an API process (ProcessMetrics), not in the engine

    @property
    def family(self) -> str:
        """The family name a text-format parser gives (a counter's loses `_total`)."""
        return self.name.removesuffix("_total")

    @property
    def bucket(self) -> str:
        """A histogram's bucket series, for `histogram_quantile`."""
        return f"{self.name}_bucket"


KV_BLOCKS = Family(
    "vllm_tenant_kv_blocks",
    "gauge",
    "KV blocks a tenant holds now, by state: running (referenced by its requests), "
    "cached_leased (its cached prefixes protected by a lease), cached (its evictable prefixes).",
    ("tenant_id", "state", "engine"),
)
BLOCK_STATES = TenantHolding.__struct_fields__  # KV_BLOCKS's `state` values, in stack order
RETENTION_STATES = retention.STATES  # RETENTION_BLOCK_SECONDS's `state` values
POOL_BLOCKS = Family(
    "vllm_tenant_kv_pool_blocks", "gauge", "Usable KV blocks in the pool.", ("engine",)
)
FREE_BLOCKS = Family(
    "vllm_tenant_kv_free_blocks",
    "gauge",
    "Free KV blocks: empty ones plus cached prefixes that may be evicted.",
    ("engine",),
)
LEASES_ACTIVE = Family(
    "vllm_tenant_lease_active",
    "gauge",
    "Sessions of the tenant whose lease is running.",
    ("tenant_id", "engine"),
)
LEASE_SECONDS_LEFT = Family(
    "vllm_tenant_lease_seconds_left",
    "gauge",
    "Longest time left on any of the tenant's leases, in seconds (a full lease while a "
    "request is in flight).",
    ("tenant_id", "engine"),
)
PREEMPTIONS = Family(
    "vllm_tenant_preemptions_total",
    "counter",
    "Running requests preempted, by tenant, tier, reason (kv_pressure, admit_higher_tier, "
    "cache_reset), mode (recompute, offload) and by_tier: the tier whose allocation (or "
    "admission) took the blocks (none: a prefix-cache reset).",
    ("tenant_id", "tier", "reason", "mode", "by_tier"),
)
KV_EVICTIONS = Family(
    "vllm_tenant_kv_cache_evictions_total",
    "counter",
    "KV blocks taken from a tenant by kvlease's policy: blocks of its preempted requests "
    "(preemption_reason = the preemption's reason) and its evicted cached prefix blocks "
    "(cache_eviction, leased_cache_eviction). priority is the tier's priority.",
    ("tenant_id", "priority", "preemption_reason"),
)
CACHED_EVICTIONS = Family(
    "vllm_tenant_cached_block_evictions_total",
    "counter",
    "Cached prefix blocks evicted to make room, by tenant, tier, whether a lease "
    "protected them, and by_tier: the tier whose allocation took them (who evicted "
    "whose prefix).",
    ("tenant_id", "tier", "leased", "by_tier"),
)
SWAPPED_BLOCKS = Family(
    "vllm_tenant_active_swapped_blocks",
    "gauge",
    "KV blocks of the tenant's requests preempted in offload mode and not yet resumed "
    "(always 0 where vLLM has no KV offloading, such as on CPU).",
    ("tenant_id", "engine"),
)
LEASE_REUSE = Family(
    "vllm_tenant_lease_reuse_tokens_total",
    "counter",
    "Prefix tokens a running lease was keeping when its session's next turn arrived, by tier, "
    "outcome (reused: served from the prefix cache; lost: computed again) and reserved (true: "
    "the turn came back inside its reservation window, when lower tiers could not take the "
    "blocks; false: after it, when only eviction order kept them).",
    ("tier", "outcome", "reserved"),
)
# A tier's lease hit ratio of turns back inside their reservation window under this for 10
# min fires the alert (after the window a miss is the price of not reserving, not a fault)
LEASE_HIT_ALERT = 0.90
FAIR_VIRTUAL_TOKENS = Family(
    "vllm_tenant_fair_virtual_tokens",
    "gauge",
    "Virtual token counter of a tenant in its tier: weighted tokens served (prompt 1, "
    "generated 2) over its weight; of the tenants waiting, the smallest is admitted next. "
    "Idle tenants at the floor are forgotten.",
    ("tenant_id", "tier", "engine"),
)
FAIR_SERVED = Family(
    "vllm_tenant_fair_served_tokens_total",
    "counter",
    "Weighted tokens (prompt 1, generated 2) a tenant was served while it had requests "
    "waiting, the admission of the last one included. Over "
    "vllm_tenant_fair_entitled_tokens_total: its fair-share ratio.",
    ("tenant_id", "tier"),
)
FAIR_ENTITLED = Family(
    "vllm_tenant_fair_entitled_tokens_total",
    "counter",
    "A tenant's weight's part of the weighted tokens served to every tenant of its tier "
    "with requests waiting, over the same time.",
    ("tenant_id", "tier"),
)
FAIR_SHARE_ALERT = 0.5  # served / entitled under this for 10 min fires the alert
BLOCK_SECONDS = Family(
    "vllm_tenant_kv_block_seconds_total",
    "counter",
    "KV block-seconds held by the tenant (running plus lease-protected cached blocks).",
    ("tenant_id",),
)
RETENTION_BLOCK_SECONDS = Family(
    "vllm_tenant_kv_retention_block_seconds_total",
    "counter",
    "KV block-seconds a tenant's leased sessions held between their turns (the KV retention "
    f"SKU), by tier and state ({' or '.join(RETENTION_STATES)}): reserved blocks keep lower "
    "tiers out, retained ones are only evicted last.",
    ("tenant_id", "tier", "state"),
)
TOKENS = Family(
    "vllm_tenant_tokens_total",
    "counter",
    "Tokens by tenant and kind: input (prompt), cached_input (prompt tokens served from the "
    "prefix cache), output, recomputed (computed tokens discarded by preemption).",
    ("tenant_id", "kind"),
    process=True,
)
REQUESTS = Family(
    "vllm_tenant_requests_total",
    "counter",
    "Finished requests by tenant and outcome (completed, aborted, failed; refused: vLLM "
    "answered 4xx before any engine work, so the request has no usage record).",
    ("tenant_id", "outcome"),
    process=True,
)
TTFT = Family(
    "vllm_tenant_time_to_first_token_seconds",
    "histogram",
    "Engine time to first token (queued plus prefill), by tier.",
    ("tier",),
    process=True,
)
TENANT_TTFT = Family(
    "vllm_tenant_tenant_time_to_first_token_seconds",
    "summary",
    "Engine time to first token by tenant: a count and a sum (rate(sum) / rate(count) is "
    "its mean), two series a tenant where a histogram would take sixteen.",
    ("tenant_id",),
    process=True,
)
E2E = Family(
    "vllm_tenant_e2e_request_latency_seconds",
    "histogram",
    "End-to-end request latency in the engine, by tier.",
    ("tier",),
    process=True,
)
QUEUE_TIME = Family(
    "vllm_tenant_request_queue_time_seconds",
    "histogram",
    "Time a request waited in the scheduler's queue before it first ran, by tier.",
    ("tier",),
    process=True,
)
TIME_PER_OUTPUT_TOKEN = Family(
    "vllm_tenant_request_time_per_output_token_seconds",
    "histogram",
    "Each request's mean inter-token latency (decode time over output tokens after the "
    "first), by tier; requests with one output token have none.",
    ("tier",),
    process=True,
)
WAITING = Family(
    "vllm_tenant_waiting_requests",
    "gauge",
    "Requests in the scheduler's waiting queue, by tier (unclassified: no tenant fields).",
    ("tier", "engine"),
)
RUNNING = Family(
    "vllm_tenant_running_requests", "gauge", "Requests the scheduler is running.", ("engine",)
)
RESERVED_CAP = Family(
    "vllm_tenant_kv_reserved_cap_blocks",
    "gauge",
    "KV blocks a leasing tier's reservations may hold now: the tier table's leased_cache_cap, "
    "lowered while the reservation does not pay for the work it turns away (reserve_min_payback).",
    ("tier", "engine"),
)
LEDGER_RECORDS = Family(
    "vllm_tenant_ledger_records_total",
    "counter",
    "Usage records this API process committed to the ledger.",
    process=True,
)
LEDGER_ERRORS = Family(
    "vllm_tenant_ledger_write_errors_total",
    "counter",
    "Failed ledger commits by this API process (the batch is retried, never dropped).",
    process=True,
)
LEDGER_DEAD_LETTERS = Family(
    "vllm_tenant_ledger_dead_letters_total",
    "counter",
    "Usage records the ledger database refused for their data, set aside to the "
    "dead-letter file instead of blocking the others.",
    process=True,
)
JOIN_OVERFLOWS = Family(
    "vllm_tenant_join_overflows_total",
    "counter",
    "Requests recorded before both halves arrived because the request join was full "
    "(their usage records are flagged partial).",
    process=True,
)
TENANT_INFO = Family(
    "vllm_tenant_info",
    "gauge",
    "1 per tenant label, with the tier its requests last came with; join on tenant_id to "
    "break per-tenant series down by tier.",
    ("tenant_id", "tier"),
)
BUDGET_USED = Family(
    "vllm_tenant_budget_used_ratio",
    "gauge",
    "Month-to-date spend over the tenant's monthly budget (budgeted tenants only; spend is "
    "the usage ledger's, fleet-wide on a shared ledger, refreshed every refresh_seconds). "
    "1 is the budget spent.",
    ("tenant_id",),
)
BUDGET_ALERT = ALERT_RATIO  # the used ratio at which KvleaseBudgetNearlySpent fires
EVENTS_DROPPED = Family(
    "vllm_tenant_events_dropped_total",
    "counter",
    "Scheduler events dropped because the bounded event buffer was full.",
)
# Every family above, in declaration order: the one list, built from the declarations.
FAMILIES = tuple(dict.fromkeys(v for v in list(globals().values()) if isinstance(v, Family)))
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


Collected = CounterMetricFamily | GaugeMetricFamily  # what a scrape of the engines yields


def _family(f: Family) -> Collected:
    """An engine family, collected at each scrape (process families are live metrics)."""
    if f.kind == "counter":
        return CounterMetricFamily(f.family, f.help, labels=f.labels)
    if f.kind == "gauge":
        return GaugeMetricFamily(f.name, f.help, labels=f.labels)
    raise ValueError(f"{f.name}: an engine family is a counter or a gauge, not a {f.kind}")


def multiprocess() -> bool:
    """True under vLLM's `--api-server-count` > 1, which sets PROMETHEUS_MULTIPROC_DIR."""
    return MULTIPROC_ENV in os.environ


class ProcessMetrics:
    """The figures that arise in one API process, as prometheus_client's own Counter and
    Histogram: tokens and outcomes of the requests it served, their latencies, its ledger
    commits and join overflows. With one API process they live in memory; with several
    (`multiprocess()`), every process writes its values to files in that folder and a
    scrape of any process sums them (prometheus_client's MultiProcessCollector), so a
    scrape sees each process once. inc/observe are O(1)."""

    FAMILIES = tuple(f for f in FAMILIES if f.process)

    def __init__(self) -> None:
        def make(f: Family) -> Any:
            if f.kind == "histogram":
                return Histogram(f.name, f.help, f.labels, buckets=LATENCY_BUCKETS, registry=None)
            if f.kind == "summary":
                return Summary(f.name, f.help, f.labels, registry=None)
            return PromCounter(f.family, f.help, f.labels, registry=None)

        self._made = {f: make(f) for f in self.FAMILIES}
        self._all = list(self._made.values())

    def __getitem__(self, family: Family) -> Any:
        """The prometheus_client metric of `family` (one of `FAMILIES`)."""
        return self._made[family]

    def collect(self) -> Iterator[Metric]:
        for metric in self._all:
            yield from metric.collect()


class TenantMetrics:
    """The collector: engine numbers read from the view, per-request numbers kept in
    `process` (which a multiprocess scrape reads from its files instead)."""

    def __init__(
        self,
        view: EngineView,
        tiers: TierTable,
        labels: TenantLabels,
        budget_used: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.view, self.tiers, self.labels = view, tiers, labels
        self.budget_used = budget_used  # tenant -> month-to-date spend / budget
        self.process = ProcessMetrics()

    def request_finished(self, tenant: str | None, tier: str | None, stats: Any) -> None:
        """One vLLM FinishedRequestStats, attributed to its tenant."""
        label, tier_label = self.labels(tenant), tier or UNCLASSIFIED
        tokens = self.process[TOKENS]
        tokens.labels(label, "input").inc(stats.num_prompt_tokens)
        tokens.labels(label, "cached_input").inc(stats.num_cached_tokens)
        tokens.labels(label, "output").inc(stats.num_generation_tokens)
        self.process[REQUESTS].labels(label, finish_outcome(stats.finish_reason)).inc()
        ttft = stats.queued_time + stats.prefill_time
        self.process[TTFT].labels(tier_label).observe(ttft)
        self.process[TENANT_TTFT].labels(label).observe(ttft)
        self.process[E2E].labels(tier_label).observe(stats.e2e_latency)
        self.process[QUEUE_TIME].labels(tier_label).observe(stats.queued_time)
        if stats.num_generation_tokens > 1:
            tpot = self.process[TIME_PER_OUTPUT_TOKEN]
            tpot.labels(tier_label).observe(stats.mean_time_per_output_token)

    def request_refused(self, tenant: str) -> None:
        """vLLM refused a tenant's request (HTTP 4xx: validation, an unknown model) before
        any engine work: nothing to bill, so no usage record; counted here."""
        self.process[REQUESTS].labels(self.labels(tenant), "refused").inc()

    def engine_event(self, event: object) -> None:
        """A request of this process left the engine: count its recomputed tokens (the
        view hands each API process only the events of its own requests)."""
        if isinstance(event, RequestDone) and event.recomputed_tokens:
            label = self.labels(event.tenant_id)
            self.process[TOKENS].labels(label, "recomputed").inc(event.recomputed_tokens)

    def collect(self) -> Iterator[Metric]:
        fam = {f.name: _family(f) for f in FAMILIES if not f.process}
        engines = self.view.engines()
        if engines:
            self._engine_families(fam, engines)
        used: dict[str, float] = {}
        for tenant, ratio in self.budget_used().items():
            label = self.labels(tenant)
            used[label] = max(ratio, used.get(label, 0.0))
        for label, ratio in sorted(used.items()):
            fam[BUDGET_USED.name].add_metric([label], ratio)
        yield from fam.values()
        if not multiprocess():  # else the scrape reads every process's files
            yield from self.process.collect()

    def _engine_families(self, fam: dict[str, Collected], engines: dict[int, EngineState]) -> None:
        """Gauges per data-parallel rank (label `engine`); counters as the ranks' sums."""
        for rank, state in engines.items():
            e = str(rank)
            fam[POOL_BLOCKS.name].add_metric([e], state.pool_blocks)
            fam[FREE_BLOCKS.name].add_metric([e], state.free_blocks)
            fam[RUNNING.name].add_metric([e], state.running)
            for tier, n in state.waiting_by_tier.items():
                fam[WAITING.name].add_metric([tier, e], n)
            for tier, n in state.reserved_caps.items():
                fam[RESERVED_CAP.name].add_metric([tier, e], n)
            offloaded = dict(state.totals.offloaded_blocks)
            for tenant, held in sorted(state.tenants.items()):
                for kind in BLOCK_STATES:
                    fam[KV_BLOCKS.name].add_metric([tenant, kind, e], getattr(held, kind))
                fam[SWAPPED_BLOCKS.name].add_metric([tenant, e], offloaded.get(tenant, 0))
            for tenant, lease in sorted(state.lease_summary.items()):
                fam[LEASES_ACTIVE.name].add_metric([tenant, e], lease.active)
                fam[LEASE_SECONDS_LEFT.name].add_metric([tenant, e], lease.seconds_left_max)
            for row in state.fair_share:
                fam[FAIR_VIRTUAL_TOKENS.name].add_metric([row.tenant_id, row.tier, e], row.counter)
        self._totals(fam, merge_states(list(engines.values())))

    def _totals(self, fam: dict[str, Collected], whole: EngineState) -> None:
        """The engines' counters, summed over ranks."""
        totals = whole.totals
        fam[EVENTS_DROPPED.name].add_metric([], whole.events_dropped)
        for pair in sorted(whole.tenant_tiers.items()):
            fam[TENANT_INFO.name].add_metric(list(pair), 1)
        for tenant, tier, reason, mode, by_tier, n in totals.preemptions:
            fam[PREEMPTIONS.name].add_metric([tenant, str(tier), reason, mode, by_tier], n)
        for tenant, tier, reason, n in totals.preempted_blocks:
            fam[KV_EVICTIONS.name].add_metric([tenant, self._priority(tier), reason], n)
        taken: dict[tuple[str, str, str], int] = {}  # KV_EVICTIONS sums over by_tier
        for tenant, tier, leased, by_tier, n in totals.evicted_blocks:
            fam[CACHED_EVICTIONS.name].add_metric(
                [tenant, str(tier), str(leased).lower(), by_tier], n
            )
            reason = "leased_cache_eviction" if leased else "cache_eviction"
            key = (tenant, self._priority(tier), reason)
            taken[key] = taken.get(key, 0) + n
        for labels, n in sorted(taken.items()):
            fam[KV_EVICTIONS.name].add_metric(list(labels), n)
        for tenant, seconds in totals.block_seconds:
            fam[BLOCK_SECONDS.name].add_metric([tenant], seconds)
        for tenant, tier, held_as, seconds in sorted(totals.retention_block_seconds):
            fam[RETENTION_BLOCK_SECONDS.name].add_metric([tenant, tier, held_as], seconds)
        # Every outcome, inside and after the window, of a tier with a leased next turn: a
        # series that starts at 0 lets increase() see its first turns and the ratios exist
        reuse = {(t, outcome, reserved): n for t, outcome, reserved, n in totals.lease_reuse_tokens}
        for tier in sorted({key[0] for key in reuse}):
            for outcome in LEASE_OUTCOMES:
                for reserved in (True, False):
                    n = reuse.get((tier, outcome, reserved), 0)
                    fam[LEASE_REUSE.name].add_metric([tier, outcome, str(reserved).lower()], n)
        for tenant, tier, served, entitled in sorted(totals.fair_share_tokens):
            fam[FAIR_SERVED.name].add_metric([tenant, tier], served)
            fam[FAIR_ENTITLED.name].add_metric([tenant, tier], entitled)

    def _priority(self, tier: str | None) -> str:
        return str(self.tiers[tier].priority) if tier is not None and tier in self.tiers else "none"

"""`make bench --quick`, as CI runs it: every benchmark end to end on the real engine.

These check that each benchmark runs and that its figures are consistent, not
how fast anything is: timings belong to the benchmark results, not to tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
ROOT = Path(__file__).parent.parent
NO_PLOT = {"ledger", "calibrate", "replay", "ablations", "dashboard", "seeds"}  # tables, no picture


def _bench(name: str, out: Path, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEASE_", "VLLM_"))}
    env["KVLEASE_HOME"] = str(home)
    argv = [sys.executable, "-m", f"bench.{name}", "--quick", "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (out / f"{name}-quick.md").read_text().startswith("Machine: ")
    if name not in NO_PLOT:
        assert (out / f"{name}-quick.png").stat().st_size > 1000
    return json.loads((out / f"{name}-quick.json").read_text())


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench")


def test_policy_benchmark_plays_the_trace_every_way_and_accounts_for_every_token(out, kvlease_home):
    result = _bench("policy", out, kvlease_home)
    ways = result["ways"]
    assert set(ways) == {
        "alone", "fcfs", "priority", "priority-stats", "kvlease", "kvlease-quiet",
        "reserve-never", "reserve-lease", "no-lease-order", "no-admission", "fifo",
        "strict-fair", "fcfs-service", "lru", "no-payback",
    }  # fmt: skip
    table = (out / "policy-quick.md").read_text()
    assert all(f"| {way} | " in table for way in ways)
    full = {w: ways[w]["requests"] for w in ways if w != "alone"}
    assert len(set(full.values())) == 1, full  # every way replays the same requests
    # Premium alone never runs short here: nothing preempted, so nothing recomputed.
    assert ways["alone"]["recomputed_tokens"] == 0
    assert all(w["recomputed_tokens"] >= 0 for w in ways.values())
    assert result["sample_steps"] == 100  # the occupancy sample paced as when serving
    # Telemetry changes no decision, kvlease's or vLLM's: the step clock gives identical
    # figures.
    for key in ("engine_steps", "recomputed_tokens", "output_tokens"):
        assert ways["kvlease"][key] == ways["kvlease-quiet"][key], key
        assert ways["priority"][key] == ways["priority-stats"][key], key
    assert ways["kvlease"]["tiers"] == {
        tier: {**v, "ttft_seconds": ways["kvlease"]["tiers"][tier]["ttft_seconds"],
               "tpot_ms": ways["kvlease"]["tiers"][tier]["tpot_ms"]}
        for tier, v in ways["kvlease-quiet"]["tiers"].items()
    }  # fmt: skip
    # The telemetry run left one usage record per request, and spans and scrapes.
    assert ways["kvlease"]["ledger_records"] == ways["kvlease"]["ledger_expected"] > 0
    assert ways["kvlease"]["span_exports"] > 0 and ways["kvlease"]["metric_scrapes"] > 0
    assert ways["kvlease"]["tiers"]["premium"]["preemptions_while_lower_tier_ran"] == 0
    # Wall ratios pair each round with stock PRIORITY's own round (same machine, same time).
    base = ways["priority"]["wall_seconds_runs"]
    assert ways["priority"]["wall_ratio"] == 1.0
    for way in full:
        runs = ways[way]["wall_seconds_runs"]
        paired = [a / b for a, b in zip(runs, base, strict=True)]
        assert ways[way]["wall_ratio_runs"] == pytest.approx(paired, abs=1e-4), way
    assert {t["target"] for t in result["targets"]} >= {
        "Wasted prefill (both recompute columns) vs stock PRIORITY",
        "Premium preemptions while a lower tier runs",
    }
    assert all(w["wasted_prefill_tokens"] >= w["recomputed_tokens"] for w in ways.values())
    # What the caps allow a leased next turn at best: a fraction wherever a tier leased.
    bounds = [t["leased_prefix_cap_bound"] for t in ways["kvlease"]["tiers"].values()]
    assert all(0 < b <= 1 for b in bounds if b is not None)
    _assert_sharing_bounds_below_the_cap_bound(ways["kvlease"])
    # kvlease's own count of its leased next turns (its metric's, split by whether the turn
    # came back inside its reservation window) is the benchmark's count, token for token
    for way in ("kvlease", "reserve-never", "reserve-lease"):
        for t in ways[way]["tiers"].values():
            inside, after = t["lease_reuse_in_window"], t["lease_reuse_after_window"]
            if t["leased_prefix_hit"] is not None and sum(inside) + sum(after):
                hit = (inside[0] + after[0]) / (sum(inside) + sum(after))
                assert hit == pytest.approx(t["leased_prefix_hit"]), way
    # Reserved for the whole lease: no leased turn comes back after its window.
    assert all(
        sum(t["lease_reuse_after_window"]) == 0 for t in ways["reserve-lease"]["tiers"].values()
    )
    assert sum(sum(t["lease_reuse_in_window"]) for t in ways["reserve-lease"]["tiers"].values())


def _assert_sharing_bounds_below_the_cap_bound(way: dict) -> None:
    """With the cap shared by the tier's sessions, even a clairvoyant keeps no more than
    when each session has the whole cap."""
    for t in way["tiers"].values():
        if t["leased_prefix_cap_bound"] is not None:
            assert 0 <= t["leased_prefix_shared_bound"] <= t["leased_prefix_cap_bound"]


def test_frontier_benchmark_plays_every_reservation_setting_on_the_same_requests(out, kvlease_home):
    from bench.frontier import QUANTILES

    result = _bench("frontier", out, kvlease_home)
    ways = result["pools"]["64"]
    settings = {f"q={q}" for q in QUANTILES} | {"reserve-never", "reserve-lease", "priority"}
    assert set(ways) == settings
    assert len({w["requests"] for w in ways.values()}) == 1
    table = (out / "frontier-quick.md").read_text()
    assert all(f"| {way} | " in table for way in settings)
    for way in ways.values():
        _assert_sharing_bounds_below_the_cap_bound(way)


def test_ablations_replay_the_same_requests_every_way_at_scale(out, kvlease_home):
    from bench.ablations import WAYS

    result = _bench("ablations", out, kvlease_home)
    ways = result["ways"]
    assert tuple(ways) == WAYS
    # Every way serves the same requests; the trace's turns past the context limit are
    # left out alike.
    assert len({(w["requests"], w["dropped_turns"]) for w in ways.values()}) == 1
    assert all(w["requests"] + w["dropped_turns"] == result["requests"] for w in ways.values())
    assert all(w["engine_steps"] > 0 and w["clock_seconds"] > 0 for w in ways.values())
    # The trace puts the pool under pressure, or the table would measure nothing.
    assert all(sum(t["preemptions"] for t in w["tiers"].values()) > 0 for w in ways.values())
    table = (out / "ablations-quick.md").read_text()
    assert all(f"| {way} | " in table for way in WAYS)


def test_seeds_benchmark_replays_every_way_on_every_seed_and_counts_the_targets_met(
    out, kvlease_home
):
    from bench.seeds import WAYS

    result = _bench("seeds", out, kvlease_home)
    seeds = [str(s) for s in result["seeds"]]
    assert len(seeds) == 2 and set(result["runs"]) == set(WAYS)
    for seed in seeds:  # on one seed every way serves the same requests
        assert len({result["runs"][way][seed]["requests"] for way in WAYS}) == 1
        # premium alone plays exactly that seed's premium requests (a seed may have none)
        alone = result["alone"][seed]
        premium = result["runs"]["kvlease"][seed]["tiers"].get("premium", {"requests": 0})
        assert set(alone["tiers"]) <= {"premium"}
        assert alone["requests"] == premium["requests"]
    stock = result["aggregate"]["priority"]
    assert all(stock[key]["median"] == 1.0 for key in ("engine_steps", "free_worst"))
    for row in result["aggregate"].values():
        assert all(0 <= row[key]["met"] <= len(seeds) for key in ("engine_steps", "free_worst"))
        assert row["engine_steps"]["min"] <= row["engine_steps"]["median"]
        assert row["premium_hit_of_caps"] >= 0  # the hit against what the caps allow
        assert 0 <= row["premium_hit_met"] <= len(seeds)
        assert 0 <= row["premium_over_alone"]["met"] <= len(seeds)
    table = (out / "seeds-quick.md").read_text()
    assert all(f"| {way} | " in table for way in WAYS)


def test_overhead_benchmark_times_both_schedulers_at_every_size(out, kvlease_home):
    result = _bench("overhead", out, kvlease_home)
    rows = {(r["running"], r["pressure"], r["chat"]) for r in result["rows"]}
    loads = ((False, False), (True, False), (True, True))
    assert rows == {(n, p, c) for n in (64, 256, 1024) for p, c in loads}
    from bench.overhead import series

    lines = series(result["rows"])  # the picture: one line per load, a point per size
    assert len(lines) == 3 and all(xs == [64, 256, 1024] for xs, _ in lines.values())
    for r in result["rows"]:
        if r["chat"]:  # sessions end turns and come back: reservations are at work
            assert min(r["turns_back"].values()) > 0 and r["reserved_most"] > 0
            assert all(0 <= hit <= 1 for h in r["next_turn_hit"].values() for hit in h.values())
        else:  # one session per tenant, always in flight: no turn ends, nothing reserved
            assert set(r["turns_back"].values()) == {0} and r["reserved_most"] == 0
        assert r["stock_us"] > 0 and r["kvlease_us"] > 0
        assert all(us > 0 for us in r["add_us"].values())  # arrivals were added, and timed
        assert min(r["requests_sent"].values()) > r["running"] * 5 // 4  # requests finished
        if not r["pressure"]:
            assert set(r["preemptions"].values()) == {0}  # every scheduler
        elif not r["chat"]:  # the same pool, smaller chat requests: stock may not run short
            assert min(r["preemptions"].values()) > 0
        assert r["stock_again_ratio"] > 0  # the noise floor: stock against itself
        # Stock keeps most of the n slots busy (of the chat load's, returning turns' prefills
        # take more of the token budget); under the chat load kvlease's leases reserve part of
        # the pool, so it may run fewer, and the per-request ratio compares the cost.
        assert r["scheduled_per_step"]["stock"] >= (0.6 if r["chat"] else 0.7) * r["running"]
        assert r["scheduled_per_step"]["kvlease"] >= 0.4 * r["running"]
        assert r["scheduled_per_step"]["kvlease-off"] >= 0.4 * r["running"]
        assert r["ratio_per_request"] > 0 and r["unreserved_ratio_per_request"] > 0
        low, high = r["ratio_per_request_range"]  # the repeats' spread around their median
        assert low <= r["ratio_per_request"] <= high
        assert r["off_ratio_per_request"] > 0  # every mechanism off, timed alike
        # stock PRIORITY, the tiered baseline, in the same rotation
        assert r["priority_ratio_per_request"] > 0 and r["priority_over_stock_per_request"] > 0
        assert r["scheduled_per_step"]["stock-priority"] >= 0.4 * r["running"]


def test_the_overhead_benchmark_times_each_mechanism_off_in_the_same_rotation(demo_model):
    """`--mechanisms`: beside the six schedulers, kvlease with each mechanism off in turn,
    stepped in the same rotation; its table has a column per mechanism."""
    from bench.overhead import MECHANISMS_OFF, measure, mechanisms

    row = measure(demo_model, 16, pressure=True, steps=5, repeats=1, mechanisms=True)
    assert set(row["mechanism_off_ratio_per_request"]) == set(MECHANISMS_OFF)
    assert all(ratio > 0 for ratio in row["mechanism_off_ratio_per_request"].values())
    assert {f"kvlease-{name}" for name in MECHANISMS_OFF} <= set(row["requests_sent"])
    header, _, line = mechanisms([row]).splitlines()
    assert line.count("|") == header.count("|") == len(MECHANISMS_OFF) + 6
    assert "mechanism_off_ratio_per_request" not in measure(demo_model, 16, True, 5, 1)


def test_the_overhead_benchmarks_chat_figures_repeat_to_the_token(demo_model):
    """In bench/overhead kvlease's clock follows the steps, not the machine's speed, so what
    it decides on that clock (reservation windows, from the think times it measures) repeats:
    two chat loads schedule and hit alike, step by step. Its occupancy sample, which decides
    nothing, is the bench's to take, on the scheduler's busy time."""
    from bench.overhead import SAMPLE_SECONDS, TICK, build, time_steps
    from kvlease.engine.vllm_scheduler import TenantAwareScheduler

    runs = []
    for _ in range(2):
        load = build(TenantAwareScheduler, demo_model, 16, pressure=True, chat=True)
        scheduled = [time_steps(load, 1)[1] for _ in range(80)]
        runs.append(
            (scheduled, load.turns_back, load.cached, load.reserved_most, load.preemptions())
        )
    assert runs[0] == runs[1]
    assert runs[0][1] > 0 and runs[0][3] > 0  # turns came back; blocks were reserved
    kv = load.scheduler.kvlease
    start = kv.clock()
    load.sampled = float("inf")  # no sample due on busy time: kvlease's own clock takes none
    last = kv.last_sample
    time_steps(load, 3)
    assert kv.clock() == pytest.approx(start + 3 * TICK) and kv.last_sample == last
    load.sampled = load.busy - SAMPLE_SECONDS  # one due: taken as the step begins
    time_steps(load, 1)
    assert kv.last_sample == pytest.approx(start + 3 * TICK)


def test_fair_share_serves_a_heavy_and_light_tenants_of_one_tier_alike(out, kvlease_home):
    """The real engine, one tier, a tenant keeping ten times the others' requests queued:
    stock FCFS serves it by demand, strict fair share within about one request of the
    others, kvlease (with its slack) within that plus the slack."""
    result = _bench("fairness", out, kvlease_home)
    ways = result["ways"]
    fcfs, fair = ways["fcfs"], ways["kvlease"]
    assert fcfs["jain"] < 0.6 and fcfs["heavy_share"] > 0.5 and fcfs["worst_gap_requests"] > 10
    assert ways["strict"]["jain"] >= 0.95 and ways["strict"]["worst_gap_requests"] <= 6
    # The heavy tenant's older requests pass with the slack, within it and no further.
    from bench.fairness import REQUEST_COST
    from kvlease.engine.settings import FAIR_SLACK

    assert fair["jain"] >= 0.95 and fair["worst_gap_requests"] <= 6 + FAIR_SLACK / REQUEST_COST
    assert fair["service_per_step"] >= 0.97 * fcfs["service_per_step"]  # work-conserving
    # Alone with an idle tier, a tenant takes most of the pool; capped, never past its cap.
    assert ways["hog"]["most_blocks_held_by_heavy"] > ways["capped"]["cap_blocks"]
    assert 0 < ways["capped"]["most_blocks_held_by_heavy"] <= ways["capped"]["cap_blocks"]


def test_soak_has_no_errors_and_one_ledger_record_per_completed_request(out, kvlease_home):
    result = _bench("soak", out, kvlease_home)
    assert result["errors"] == 0, result["last_errors"]
    assert result["completed"] >= 2 * result["clients"]  # the load runs until then
    assert result["ledger_records"] == result["completed"]
    assert len(result["rss_samples"]) >= 3
    assert all(s["total"] > s["api"] > 0 for s in result["rss_samples"])


def test_ledger_benchmark_ingests_and_exports_every_record(out, kvlease_home):
    result = _bench("ledger", out, kvlease_home)
    runs = {r["backend"]: r for r in result["runs"]}
    assert set(runs) == {"sqlite", "postgresql"}  # a real PostgreSQL, as the tests use
    for run in runs.values():
        assert run["records"] == 20_000 and run["export_rows"] > 0
        assert run["ingest_ratio"] > 0 and run["reference_export_seconds"] > 0


def test_calibration_fits_a_step_cost_no_term_of_which_is_negative(out, kvlease_home):
    """How much each term weighs depends on this machine's speed and load; that none is
    negative and the step costs something does not (bench/calibrate.fit)."""
    result = _bench("calibrate", out, kvlease_home)
    fit = result["fit"]
    terms = (fit["base"], fit["prefill_token"], fit["decode_request"])
    assert min(terms) >= 0 and sum(terms) > 0
    assert len(result["points"]) == 7 and result["mean_abs_error"] >= 0


def test_replay_benchmark_matches_the_real_engine_and_replays_both_sides(out, kvlease_home):
    result = _bench("replay", out, kvlease_home)
    fidelity = result["fidelity"]
    # The real run may end with one more step: vLLM hands its last finished ids on.
    assert 0 <= fidelity["engine_steps"]["real"] - fidelity["engine_steps"]["replay"] <= 1
    wasted = fidelity["wasted_prefill_tokens"]  # one rule, so the benches' figures compare
    assert wasted["real"] == wasted["replay"]
    errors = [row["error"] for row in fidelity["rows"] if row["error"] is not None]
    assert errors and max(errors) <= 0.10
    speed = result["speed"]
    assert speed["requests"] > 500 and speed["wall_seconds"] > 0


def test_dashboard_benchmark_times_the_live_pages_headline_and_charts(out, kvlease_home):
    result = _bench("dashboard", out, kvlease_home)
    for state in ("loaded", "quiet"):
        assert 0 < result[state]["headline_s"] <= result[state]["charts_s"]
        assert result[state]["main_thread_s"] > 0
        assert len(result["rounds"][state]) == 1


def test_the_solo_overhead_benchmark_runs_each_scheduler_alone_in_its_own_process(demo_model):
    """`--solo`: stock and kvlease each in a process of their own, as an engine core runs
    one scheduler; a pair of processes gives a ratio, and the table shows it."""
    from bench.overhead import solo, solo_table

    row = solo(demo_model, 16, pressure=True, chat=False, steps=5, repeats=1, pairs=2)
    assert row["processes"] == 4  # two pairs, each scheduler in a process of its own
    assert all(us > 0 for us in row["us_per_request"].values())
    low, high = row["ratio_per_request_range"]
    assert 0 < low <= row["ratio_per_request"] <= high
    header, _, line = solo_table([row]).splitlines()
    assert line.count("|") == header.count("|") and "pressure" in line


def test_the_instruction_count_benchmark_counts_only_each_schedulers_own_calls(demo_model):
    """bench.instructions: each scheduler alone under callgrind, which counts only inside
    the scheduler's own calls, on the caches of one of this machine's cores; both schedule
    the same requests there, and kvlease's bookkeeping shows as instructions stock does
    not execute."""
    from bench.instructions import core_caches, row, table

    r = row(demo_model, 16, pressure=False, chat=False, steps=5)
    assert r["scheduled"]["stock"] == r["scheduled"]["kvlease"] > 0
    for figures in r["per_request"].values():
        assert figures["Ir"] > figures["L1 misses"] > figures["LL misses"] >= 0
        assert figures["cycles (est.)"] > figures["Ir"]
    assert r["ratio"]["Ir"] > 1
    last_level = core_caches().get("LL")
    if last_level:  # the core's L2 is what callgrind simulated as its last level
        assert f"LL cache: {last_level.split(',')[0]} B" in " ".join(r["caches"])
    header, _, line = table([r]).splitlines()
    assert line.count("|") == header.count("|") and "no pressure" in line


def test_the_bytecode_map_counts_each_schedulers_functions_and_puts_kvleases_code_in_its_own(
    demo_model,
):
    """bench.bytecodes: each of the three schedulers alone in a process, its own calls
    traced; stock runs none of kvlease's code, both kvleases run it, every function's
    bytecodes add up to the total, and the table lists the functions kvlease adds."""
    from bench.bytecodes import SCHEDULERS, is_kvleases, row, table

    r = row(demo_model, 16, pressure=False, chat=False, steps=3)
    assert set(r["scheduled"]) == set(SCHEDULERS) and len(set(r["scheduled"].values())) == 1
    per = r["per_request"]
    assert r["kvleases_own"]["stock"] == 0 and not any(map(is_kvleases, per["stock"]))
    assert r["kvleases_own"]["kvlease"] > r["kvleases_own"]["every mechanism off"] > 0
    for name, functions in per.items():
        assert abs(sum(functions.values()) - r["total"][name]) < 1e-6
        assert any(f.startswith("vllm/v1/core/sched/scheduler.py:") for f in functions)
    assert "engine/vllm_scheduler.py:TenantSchedulingMixin.schedule" in per["kvlease"]
    lines = table(r, top=5).splitlines()
    header, _, *body = lines[2:]
    assert len(body) == 2 + 5 and all(line.count("|") == header.count("|") for line in body)


def test_the_instruction_count_simulates_one_cores_caches_as_sysfs_describes_them(tmp_path):
    """Level 1 instruction and data caches and the core's unified L2 become callgrind's
    I1, D1 and LL; the shared L3 is left out; a machine that does not say all three, or
    says a geometry callgrind refuses, gets valgrind's own detection (no options)."""
    from bench.instructions import core_caches

    def cache(index: int, level: int, kind: str, size: str, ways: int) -> None:
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (
            ("level", level),
            ("type", kind),
            ("size", size),
            ("ways_of_associativity", ways),
            ("coherency_line_size", 64),
        ):
            (folder / name).write_text(f"{value}\n")

    cache(0, 1, "Data", "48K", 12)
    cache(1, 1, "Instruction", "32K", 8)
    assert core_caches(tmp_path) == {}
    cache(2, 2, "Unified", "2048K", 16)
    cache(3, 3, "Unified", "8192K", 16)
    assert core_caches(tmp_path) == {
        "D1": "49152,12,64", "I1": "32768,8,64", "LL": "2097152,16,64"
    }  # fmt: skip
    (tmp_path / "index2" / "size").write_text("768K\n")  # 768 sets: callgrind refuses it
    assert core_caches(tmp_path) == {}

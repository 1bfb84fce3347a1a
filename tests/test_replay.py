"""`kvlease replay`: recorded traffic through the real scheduler offline, against the real
engine on the same traffic.

The real engine is the shared in-process kvlease engine (24 blocks), driven on a step
clock by bench/policy.py's player; its requests are recorded into a usage ledger with
step-clock times, and `kvlease replay` replays that ledger with the same step clock.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import procs
import pytest
from engines import POOL_BLOCKS, settle
from hypothesis import given
from hypothesis import strategies as st
from records import NOV, rec
from waiting import until

from bench.inprocess import Engine
from bench.policy import play
from bench.workload import load
from kvlease.demo.workload import Turn, WorkloadSpec, generate, save_trace
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.ledger import UsageLedger, UsageRecord
from kvlease.replay import traffic
from kvlease.replay.clock import tick_seconds
from kvlease.replay.report import percentile
from kvlease.server.cli import main

SPS = 10.0  # steps per second of both clocks
SPEC = WorkloadSpec(
    tenants=(2, 3, 6),
    duration=20.0,
    sessions_per_second=0.8,
    mean_turns=2.0,
    mean_think_seconds=2.0,
    input_median=30,
    output_median=48,
    max_tokens=96,
    seed=8,  # its heaviest free tenant, made premium, costs premium 80+ steps of TTFT p99
)


def _record(real, t0: float) -> list[UsageRecord]:
    """The real run as the ledger would hold it, on the step clock: a request starts at
    its arrival step and ends when its finishing step does."""
    return [
        UsageRecord(
            request_id=f"kvl-{i:032x}",
            tenant_id=r.arrival.turn.tenant_id,
            tier=r.arrival.turn.tier,
            session_id=r.arrival.turn.session_id,
            model="kvlease-demo",
            started_at=t0 + r.arrival.step / SPS,
            ended_at=t0 + (r.finish_step + 1) / SPS,
            input_tokens=len(r.arrival.prompt),
            cached_input_tokens=r.cached,
            output_tokens=len(r.output),
            recomputed_tokens=0,
            preemptions=0,
            kv_block_seconds=0.0,
            outcome="completed",
        )
        for i, r in enumerate(real.requests)
    ]


def _ttft_p99(run, tier: str) -> float:
    return percentile(
        [r.first_step - r.arrival.step for r in run.requests if r.arrival.turn.tier == tier], 99
    )


def _heavy(turns: list[Turn]) -> str:
    """The non-premium tenant that asks for the most tokens."""
    tokens: dict[str, int] = {}
    for t in turns:
        if t.tier != "premium":
            tokens[t.tenant_id] = tokens.get(t.tenant_id, 0) + t.input_tokens + t.output_tokens
    return max(tokens, key=tokens.get)


@pytest.fixture(scope="module")
def what_if(kvlease_engine, tmp_path_factory):
    """Real runs of the trace as is and with its heaviest tenant moved to premium, and
    the replay of the first run's ledger with that move proposed."""
    folder = tmp_path_factory.mktemp("replay")
    turns = generate(SPEC)
    heavy = _heavy(turns)
    moved = traffic.assign(turns, {heavy: "premium"})
    tiers = TierTable.load()
    engine = Engine("real", kvlease_engine.llm.llm_engine)
    runs, preempted = {}, {}
    for name, trace in (("current", turns), ("proposed", moved)):
        settle(kvlease_engine)
        before = len(kvlease_engine.scheduler.preemptions)
        runs[name] = play(engine, trace, name, SPS, tiers)
        preempted[name] = len(kvlease_engine.scheduler.preemptions) - before
    settle(kvlease_engine)
    url = f"sqlite:///{folder / 'usage.db'}"
    UsageLedger(url).write(_record(runs["current"], NOV))
    (folder / "assign.toml").write_text(f'[tenants]\n"{heavy}" = "premium"\n')
    config = kvlease_engine.llm.llm_engine.vllm_config.scheduler_config
    report = folder / "report.json"
    argv = ["replay", "--usage-db", url, "--from", "2026-11-01", "--to", "2026-11-02"]
    argv += ["--assign", str(folder / "assign.toml"), "--steps-per-second", str(SPS)]
    argv += ["--pool-blocks", str(POOL_BLOCKS), "--max-num-seqs", str(config.max_num_seqs)]
    argv += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    assert main([*argv, "--json", str(report), "--quiet", "-o", str(folder / "r.html")]) == 0
    return runs, preempted, json.loads(report.read_text()), folder


@pytest.mark.engine
def test_a_replay_of_a_recorded_ledger_reproduces_the_real_engines_preemptions_and_tier_order(
    what_if,
):
    runs, preempted, report, _ = what_if
    current = report["current"]
    assert current["requests"] == len(runs["current"].requests)
    assert preempted["current"] > 0, "the trace must create pressure"
    assert sum(t["preemptions"] for t in current["tiers"].values()) == preempted["current"]
    real = {tier: _ttft_p99(runs["current"], tier) for tier in current["tiers"]}
    replayed = {tier: figures["ttft_p99_steps"] for tier, figures in current["tiers"].items()}
    assert sorted(real, key=real.get) == sorted(replayed, key=replayed.get)
    assert replayed == pytest.approx(real, rel=0.1, abs=1)


@pytest.mark.engine
def test_moving_a_heavy_tenant_to_premium_raises_premium_ttft_as_the_real_engine_shows(what_if):
    runs, _, report, _ = what_if
    real_before, real_after = (_ttft_p99(runs[side], "premium") for side in ("current", "proposed"))
    replay_before = report["current"]["tiers"]["premium"]["ttft_p99_steps"]
    replay_after = report["proposed"]["tiers"]["premium"]["ttft_p99_steps"]
    assert real_after >= real_before + 10
    assert replay_after >= replay_before + 10
    assert replay_after == pytest.approx(real_after, rel=0.1, abs=1)
    moved = report["movers"]["cost"][0]
    assert moved["tier"][1] == "premium" and moved["cost"][1] > moved["cost"][0]


@pytest.mark.engine
def test_the_json_report_has_every_figure_the_readme_promises_and_the_html_is_self_contained(
    what_if,
):
    _, _, report, folder = what_if
    wanted = {
        "requests", "ttft_p50_steps", "ttft_p99_steps", "ttft_p50_s", "ttft_p99_s",
        "preemptions", "recomputed_tokens", "leased_next_turn_hit", "kv_block_hours",
        "kv_retention_hours", "fair_share_ratio", "cost",
    }  # fmt: skip
    for side in ("current", "proposed"):
        for tier, figures in report[side]["tiers"].items():
            assert wanted <= set(figures), (side, tier)
        for tenant, figures in report[side]["tenants"].items():
            assert wanted | {"tier"} <= set(figures), (side, tenant)
        waited = [t for t in report[side]["tenants"].values() if t["fair_share_ratio"]]
        assert waited, "some tenant waited beside another of its tier"
    tiers = report["current"]["tiers"]
    assert tiers["premium"]["kv_retention_hours"] > 0 == tiers["free"]["kv_retention_hours"]
    page = (folder / "r.html").read_text()
    assert page.count("<script") >= 6 and "src=" not in page.split("<body>", 1)[0]
    assert "http://" not in page.split("plotly")[0]


def _fails(capsys, argv: list[str]) -> str:
    assert main(["replay", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvlease replay: error: "), err
    return err[0]


def test_a_malformed_trace_row_is_one_line_and_exit_2(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp,tenant,session,input_tokens,output_tokens\n0,acme,s1,40,x\n")
    assert "trace.csv:2: bad trace row" in _fails(capsys, ["--trace", str(trace)])


def test_an_unknown_tier_in_assign_is_one_line_and_exit_2(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    save_trace(generate(replace(SPEC, duration=3.0)), trace)
    assign = tmp_path / "assign.toml"
    assign.write_text('[tenants]\nacme = "platinum"\n')
    line = _fails(capsys, ["--trace", str(trace), "--assign", str(assign)])
    assert "unknown tier 'platinum'" in line and "acme" in line


def test_an_empty_window_is_one_line_and_exit_2(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'usage.db'}"
    UsageLedger(url).write([rec(0)])  # November 2026
    line = _fails(capsys, ["--usage-db", url, "--from", "2026-10-01", "--to", "2026-10-08"])
    assert "no usage records ended in the window" in line


def test_ledger_records_become_chat_turns_with_new_tokens_and_think_time():
    def r(i, started, ended, inp, out, session="s"):
        return UsageRecord(
            f"kvl-{i}", "acme", "standard", session, "m", started, ended, inp, 0, out, 0, 0,
            0.0, "completed",
        )  # fmt: skip

    turns = traffic.turns_of([r(1, 100.0, 104.0, 40, 60), r(2, 110.0, 113.0, 130, 20)])
    first, second = turns
    assert (first.at, first.turn, first.input_tokens, first.output_tokens) == (0.0, 0, 40, 60)
    # 130 prompt tokens less the 100 of context: 30 new; 6 s of think time after the reply.
    assert (second.at, second.turn, second.input_tokens) == (6.0, 1, 30)


@given(
    origin=st.integers(0, 2**31),
    ended=st.integers(0, 10**6),
    turn=st.integers(0, 10**6),
    think=st.integers(0, 10**5),
    ticks=st.sampled_from([10.0, 1024.0]),
)
def test_a_window_measured_in_ticks_ends_on_its_tick_whatever_the_clocks_origin(
    origin, ended, turn, think, ticks
):
    """A reservation window is a think time (two clock readings apart) added to a turn's
    end: it must land exactly on the reading `think` ticks after that end, or whether a
    session returning on that very step finds its window open depends on the origin's
    rounding (bench/policy.py's engine and the replay read the clock this way)."""
    tick = tick_seconds(ticks)

    def clock(n: int) -> float:
        return float(origin) + n * tick

    window = clock(turn + think) - clock(turn)
    assert clock(ended) + window == clock(ended + think)


def test_kv_gib_sizes_the_pool_from_the_models_config(demo_model):
    from kvlease.replay.pool import kv_bytes_per_token, pool_blocks

    # The demo model: 2 layers x 2 KV heads x 64 dims x 2 bytes, keys and values.
    assert kv_bytes_per_token(Path(demo_model)) == 2 * 2 * 2 * 64 * 2
    assert pool_blocks(1.0, Path(demo_model), 32) == 2**30 // (1024 * 32)


def test_a_stride_of_decode_steps_changes_no_figure(demo_model):
    from kvlease.replay.clock import CPU_DEMO, StepCost
    from kvlease.replay.simulate import simulate

    # On the policy benchmark's trace fair share admits free tenants right after strides:
    # the counters must be charged as if each of a stride's steps had been taken.
    chat = generate(replace(SPEC, tenants=(4, 8, 20), duration=30.0))
    tiers = TierTable.load()
    limits = {"max_num_seqs": 128, "max_num_batched_tokens": 2048}
    for cost, blocks, turns in (
        (StepCost.fixed(SPS), 64, load()),
        (StepCost.fixed(SPS), 64, chat),
        (CPU_DEMO, 96, chat),
    ):
        one, many = (
            simulate(turns, tiers, blocks, cost, demo_model, max_stride=k, **limits)
            for k in (1, 64)
        )
        assert many.calls < one.calls  # strides were taken
        assert one.steps == many.steps and one.seconds == pytest.approx(many.seconds)

        def seen(replay):
            return sorted(
                (
                    s.tenant,
                    s.turn,
                    s.arrival_step,
                    s.first_step,
                    s.cached_tokens,
                    s.preemptions,
                    s.computed_tokens,
                )
                for s in replay.served
            )

        assert seen(one) == seen(many)


def test_stock_vllm_replays_the_same_requests_and_kvlease_bills_its_retention(demo_model):
    """The ablation table's stock columns (bench/ablations.py): vLLM's own scheduler, by
    FCFS or by tier priority, replays every request; only kvlease's leases hold blocks
    between turns, and the replay bills that retention to premium and standard only."""
    from kvlease.replay.clock import StepCost
    from kvlease.replay.report import summarize
    from kvlease.replay.simulate import simulate

    turns = generate(replace(SPEC, tenants=(4, 8, 20), duration=30.0))
    tiers = TierTable.load()
    limits = {"max_num_seqs": 128, "max_num_batched_tokens": 2048}
    runs = {
        way: simulate(turns, tiers, 64, StepCost.fixed(SPS), demo_model, stock=stock, **limits)
        for way, stock in (("fcfs", "fcfs"), ("priority", "priority"), ("kvlease", None))
    }
    counts = {way: len(r.served) for way, r in runs.items()}
    assert len(set(counts.values())) == 1 and counts["kvlease"] > 0
    ttft = {
        way: max(s.ttft_steps for s in r.served if s.tier == "premium") for way, r in runs.items()
    }
    assert ttft["priority"] <= ttft["fcfs"]  # priority = tier does serve premium sooner
    assert all(s.reserved_seconds == s.retained_seconds == 0 for s in runs["priority"].served)
    figures = summarize(runs["kvlease"], tiers)["tiers"]
    assert figures["premium"]["kv_retention_hours"] > 0 == figures["free"]["kv_retention_hours"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_stopped_replay_ends_its_workers_and_says_how_it_ended(sig, tmp_path, demo_model):
    """What the What if page stops (and a terminal's Ctrl-C): SIGTERM and SIGINT end the
    replay's worker processes and exit 128 + N, writing no report; killed, its workers
    are told to stop by the kernel."""
    trace = tmp_path / "trace.csv"
    save_trace(generate(replace(SPEC, duration=3600.0)), trace)  # far longer than the test
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "kvlease", "replay", "--trace", str(trace), "--quiet"]
    proc = subprocess.Popen([*argv, "--model", demo_model, "--json", str(report)])

    def two_workers() -> bool:
        assert proc.poll() is None, f"the replay ended first: {proc.returncode}"
        return len(procs.children(proc.pid, b"spawn_main")) == 2

    until(two_workers, "the replay's two workers", 300, 0.1)
    workers = procs.children(proc.pid, b"spawn_main")
    proc.send_signal(sig)
    try:
        code = proc.wait(120)
    finally:  # a hang must not outlive the test
        if proc.poll() is None:
            proc.kill()
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig)
    until(lambda: not procs.running(workers), "the replay's workers to end", 120, 0.1)
    assert not report.exists()

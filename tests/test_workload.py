"""The seeded multi-tenant chat trace (demo/workload.py)."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace

import pytest

from kvlease.demo.workload import (
    WorkloadSpec,
    describe,
    generate,
    load_trace,
    save_trace,
    sessions,
    stream_sessions,
)


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    spec = WorkloadSpec(duration=120, seed=7)
    assert generate(spec) == generate(spec)
    assert generate(spec) != generate(WorkloadSpec(duration=120, seed=8))


def test_the_trace_has_the_shape_it_promises():
    spec = WorkloadSpec(duration=2000, sessions_per_second=0.5, seed=1)
    turns = generate(spec)
    info = describe(turns)
    assert info["tenants"] == sum(spec.tenants) == 32
    assert 850 < info["sessions"] < 1150  # Poisson: 1,000 expected
    by_session = sessions(turns)
    assert 2.7 < statistics.mean(len(s) for s in by_session.values()) < 3.3  # mean 3 turns
    outputs = [t.output_tokens for t in turns]
    assert 90 <= statistics.median(outputs) <= 110 and max(outputs) <= spec.max_tokens
    assert statistics.mean(outputs) > statistics.median(outputs)  # heavy right tail
    for session in by_session.values():
        assert [t.turn for t in session] == list(range(len(session)))
        assert all(a.at < b.at for a, b in itertools.pairwise(session))
        assert len({(t.tenant_id, t.tier) for t in session}) == 1
    assert [t.at for t in turns] == sorted(t.at for t in turns)


def test_sessions_stream_lazily_without_an_end():
    endless = stream_sessions(WorkloadSpec(duration=float("inf"), sessions_per_second=10))
    firsts = [next(endless)[0].at for _ in range(1000)]
    assert firsts == sorted(firsts) and firsts[-1] > 50


def test_a_trace_file_round_trips_and_bad_rows_name_their_line(tmp_path):
    turns = generate(WorkloadSpec(duration=30, seed=3))
    path = tmp_path / "trace.csv"
    save_trace(turns, path)
    origin = turns[0].at  # a loaded trace starts at 0
    assert load_trace(path) == [replace(t, at=round(t.at - origin, 3)) for t in turns]
    path.write_text("timestamp,tenant,session,input_tokens,output_tokens\n5,a,s,10,x\n")
    with pytest.raises(ValueError, match=r"trace\.csv:2: bad trace row"):
        load_trace(path)


def test_tenants_split_over_the_tiers():
    assert WorkloadSpec.for_tenants(12).tenants == (1, 3, 8)
    assert WorkloadSpec.for_tenants(3).tenants == (1, 1, 1)
    with pytest.raises(ValueError):
        WorkloadSpec.for_tenants(2)

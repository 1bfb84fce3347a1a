"""Session -> data-parallel rank: the same answer in every process, and little movement
when the number of ranks changes."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

from kvlease.engine.affinity import session_rank


def test_a_session_has_one_rank_in_every_process():
    sessions = [("acme", f"chat-{i}") for i in range(50)]
    here = [session_rank(t, s, 4) for t, s in sessions]
    code = (
        "from kvlease.engine.affinity import session_rank;"
        f"print([session_rank(t, s, 4) for t, s in {sessions!r}])"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout  # a fresh interpreter: another hash seed
    assert str(here) == there.strip()


def test_ranks_share_sessions_and_tenants_do_not_share_a_session_name():
    counts = Counter(session_rank("acme", f"s{i}", 2) for i in range(2000))
    assert 900 < counts[0] < 1100
    differs = sum(
        session_rank("a", f"s{i}", 8) != session_rank("b", f"s{i}", 8) for i in range(400)
    )
    assert differs > 300  # the tenant is part of the key


def test_one_more_rank_moves_only_the_sessions_it_takes():
    moved = [
        (session_rank("acme", f"s{i}", 4), session_rank("acme", f"s{i}", 5)) for i in range(4000)
    ]
    assert all(new in (old, 4) for old, new in moved)  # a session moves only to the new rank
    assert 600 < sum(old != new for old, new in moved) < 1000  # about 1/5 of them


def test_one_rank_is_rank_zero():
    assert session_rank("acme", "s1", 1) == 0

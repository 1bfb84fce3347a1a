"""What a clairvoyant reservation could keep under the same caps: the leased hit's bound.

`bench/policy.py` measures the leased next-turn hit against "what the caps allow". The
simple bound lets every next turn find min(cap, its prefix), as if each session had its
tier's cap to itself. Sessions overlap, though: a premium session that waits for its user
shares the tier's reserved blocks with every other premium session waiting at the time.
This module gives the bound for a shared cap: the most prefix blocks a reservation that
knows when every session returns could keep, with the tier's reserved blocks never more
than its cap at any step.

Each next turn is one interval: its session's blocks must stay reserved from the step its
previous turn finished until the step it arrives, and any k of its `blocks` may be kept
(a prefix-cache hit needs the first blocks, and keeping a prefix is as good as keeping any
k). Every block is then a unit job on an interval, and the best choice is greedy by
arrival: take each next turn's blocks in order of arrival, as many as the cap leaves free
over its whole interval. (Exchange argument: a block of an interval that ends later can
always give way to one that ends sooner without overfilling any later step; the
property test in tests/test_bench_oracle.py checks it against brute force.)
"""

from __future__ import annotations

from collections.abc import Iterable


def clairvoyant_kept(intervals: Iterable[tuple[int, int, int]], cap: int) -> list[int]:
    """For each (first step, last step, blocks), the blocks a clairvoyant reservation of
    `cap` blocks keeps over [first, last): at most `cap` reserved at any step.
    O(intervals x their length) with a load per step; intervals of length 0 need no room."""
    given = list(intervals)
    if not given:
        return []
    start = min(first for first, _, _ in given)
    load = [0] * (max(last for _, last, _ in given) - start + 1)
    kept = [0] * len(given)
    for i in sorted(range(len(given)), key=lambda i: (given[i][1], given[i][0])):
        first, last, blocks = given[i]
        span = range(first - start, last - start)
        room = cap - max((load[t] for t in span), default=0)
        take = max(0, min(blocks, room)) if span else blocks
        for t in span:
            load[t] += take
        kept[i] = take
    return kept

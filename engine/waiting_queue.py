"""The waiting queue: tier order first, arrival order within a tier.

It implements vLLM's `RequestQueue` interface (registered as a virtual
subclass in `engine.vllm_scheduler`) without importing vLLM. A request
preempted back into the queue goes to the front of its own tier, so a
preempted free request never jumps ahead of a waiting premium one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Any

Request = Any  # vllm.v1.request.Request; duck-typed here


class TenantWaitingQueue:
    """One FIFO deque per rank (0 = served first).

    Invariant: a request sits in bucket `rank_of(request)` and nowhere else;
    `len(self)` is the sum of bucket sizes. Costs: add/prepend O(1),
    pop/peek O(ranks) (ranks = tiers + 1, a small constant), remove O(bucket).
    With a single rank it behaves exactly like vLLM's FCFSRequestQueue.
    """

    def __init__(self, rank_of: Callable[[Request], int], num_ranks: int) -> None:
        self._rank_of = rank_of
        self._buckets: list[deque[Request]] = [deque() for _ in range(num_ranks)]
        self._len = 0

    def add_request(self, request: Request) -> None:
        self._buckets[self._rank_of(request)].append(request)
        self._len += 1

    def _first_bucket(self) -> deque[Request]:
        for bucket in self._buckets:
            if bucket:
                return bucket
        raise IndexError("pop from an empty queue")

    def pop_request(self) -> Request:
        request = self._first_bucket().popleft()
        self._len -= 1
        return request

    def peek_request(self) -> Request:
        return self._first_bucket()[0]

    def prepend_request(self, request: Request) -> None:
        self._buckets[self._rank_of(request)].appendleft(request)
        self._len += 1

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Like deque.extendleft per bucket: the last given ends up first, as in vLLM."""
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        self._buckets[self._rank_of(request)].remove(request)
        self._len -= 1

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(requests)
        for i, bucket in enumerate(self._buckets):
            kept = [r for r in bucket if r not in gone]
            if len(kept) != len(bucket):
                self._len -= len(bucket) - len(kept)
                self._buckets[i] = deque(kept)

    def __bool__(self) -> bool:
        return self._len > 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return chain.from_iterable(self._buckets)

    def bucket_sizes(self) -> list[int]:
        return [len(b) for b in self._buckets]

"""The waiting queue: tier order first, then vLLM's own order within a tier.

It implements vLLM's `RequestQueue` interface (registered as a virtual
subclass in `engine.vllm_scheduler`) without importing vLLM. Each tier has
its own queue, built by the factory the scheduler passes: vLLM's FCFS queue,
or its priority queue under `--scheduling-policy priority`, so requests that
carry no tenant fields are ordered exactly as vLLM would order them. A request
preempted back into the queue goes to the front of its own tier, so a
preempted free request never jumps ahead of a waiting premium one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, islice
from typing import Any

Request = Any  # vllm.v1.request.Request; duck-typed here


class Fifo(deque):
    """vLLM's FCFSRequestQueue, for use without vLLM (the policy tests)."""

    add_request = deque.append
    pop_request = deque.popleft
    prepend_request = deque.appendleft
    prepend_requests = deque.extendleft
    remove_request = deque.remove

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(requests)
        kept = [r for r in self if r not in gone]
        self.clear()
        self.extend(kept)


class TenantWaitingQueue:
    """One request queue per rank (0 = served first).

    Invariant: a request sits in bucket `rank_of(request)` and nowhere else;
    `len(self)` is the sum of bucket sizes. Costs: those of the bucket queue
    (FCFS: add/prepend O(1); priority: O(log n)) plus O(ranks) to find the
    first non-empty bucket on peek and pop (ranks = tiers + 1, a small
    constant). With a single rank it behaves exactly like its bucket queue.
    """

    def __init__(
        self,
        rank_of: Callable[[Request], int],
        num_ranks: int,
        make_bucket: Callable[[], Any] = Fifo,
    ) -> None:
        self._rank_of = rank_of
        self._buckets = [make_bucket() for _ in range(num_ranks)]
        self._len = 0

    def add_request(self, request: Request) -> None:
        self._buckets[self._rank_of(request)].add_request(request)
        self._len += 1

    def _first_bucket(self) -> Any:
        for bucket in self._buckets:
            if bucket:
                return bucket
        raise IndexError("pop from an empty queue")

    def pop_request(self) -> Request:
        request = self._first_bucket().pop_request()
        self._len -= 1
        return request

    def peek_request(self) -> Request:
        return self._first_bucket().peek_request()

    def prepend_request(self, request: Request) -> None:
        self._buckets[self._rank_of(request)].prepend_request(request)
        self._len += 1

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Like vLLM's: one at a time, so under FCFS the last given ends up first."""
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        self._buckets[self._rank_of(request)].remove_request(request)
        self._len -= 1

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(requests)
        for bucket in self._buckets:
            before = len(bucket)
            bucket.remove_requests(gone)
            self._len -= before - len(bucket)

    def __bool__(self) -> bool:
        return self._len > 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return chain.from_iterable(self._buckets)

    def __getitem__(self, index: int) -> Request:
        """The request at `index` in serving order (O(n)), as vLLM's FCFS deque allows."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("waiting queue index out of range")
        for bucket in self._buckets:
            if index < len(bucket):
                return next(islice(bucket, index, None))
            index -= len(bucket)
        raise IndexError("waiting queue index out of range")

    def bucket_sizes(self) -> list[int]:
        return [len(b) for b in self._buckets]

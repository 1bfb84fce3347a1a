"""The waiting queue: tier order first, then vLLM's own order within a tier.

It implements vLLM's `RequestQueue` interface (registered as a virtual
subclass in `kvlease.engine.vllm_scheduler`) without importing vLLM. Each tier has
its own queue, built by the factory the scheduler passes: vLLM's FCFS queue,
or its priority queue under `--scheduling-policy priority`, so requests that
carry no tenant fields are ordered exactly as vLLM would order them. A request
preempted back into the queue goes to the front of its own tier, so a
preempted free request never jumps ahead of a waiting premium one.
"""

from __future__ import annotations

import heapq
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


class FairBucket:
    """One tier's waiting requests: requests put back first, then one queue per tenant
    admitted by fair share.

    A request vLLM puts back (`prepend_request`: preempted, or skipped this step) was
    admitted once; it goes to the front of the tier, as in vLLM's own queue, so it resumes
    before any new admission while its prefix may still be cached (admitting new work
    ahead of it only makes more preemptions). New requests wait in their tenant's queue,
    and `peek_request`/`pop_request` take the head of the backlogged tenant with the
    smallest virtual token counter (`kvlease.engine.fairness.FairShare`), leaving out tenants that
    `skip(account, its head request)` refuses (at its KV cap); within a tenant, vLLM's
    own order (the queue `make_queue` builds).
    Invariants: `_queues[tenant]` holds exactly that tenant's new waiting requests, and a
    tenant has a queue exactly while its account is backlogged; `len` counts those and the
    requests put back. Costs: add O(1) + O(log tenants), prepend O(1), peek and pop
    O(log tenants) amortised. A bucket whose every request belongs to a refused tenant is
    falsy (nothing in it may be admitted now) while its `len` still counts them.

    `slack` (weighted tokens, 0: strict fair share) trades fairness for the tier's worst
    wait: the oldest waiting head goes first when its tenant's counter is within `slack`
    of the smallest waiting counter, so a tenant that sends more than its share still
    waits, but never longer than it takes the others to come within `slack` of it.
    Counters between two waiting tenants then stay within fair share's bound plus
    `slack`. `_oldest` holds `(arrival_time, seq, tenant)` for every tenant's head since
    it became head (stale entries, whose request has left the head, are dropped when they
    reach the top); with slack 0 it is never filled.
    """

    def __init__(
        self,
        share: Any,
        account_of: Callable[[Request], Any],
        make_queue: Callable[[], Any] = Fifo,
        skip: Callable[[Any, Request], bool] | None = None,
        slack: float = 0.0,
    ) -> None:
        self._share = share
        self._account_of = account_of
        self._make_queue = make_queue
        self._skip = skip
        self._slack = slack
        self._oldest: list[tuple[float, int, str]] = []  # heads by arrival (slack > 0)
        self._seq = 0
        self._back: deque[Request] = deque()  # put back by vLLM: served first
        self._queues: dict[str, Any] = {}
        self._len = 0
        self._peeked: Any = None  # the account whose head the last peek showed

    def add_request(self, request: Request) -> None:
        a = self._account_of(request)
        q = self._queues.get(a.tenant)
        if q is None:
            q = self._queues[a.tenant] = self._make_queue()
        q.add_request(request)
        self._len += 1
        self._share.enqueued(a)
        self._peeked = None  # a new head may come first
        if self._slack and q.peek_request() is request:
            self._note_head(a.tenant, request)

    def _note_head(self, tenant: str, head: Request) -> None:
        self._seq += 1
        heapq.heappush(self._oldest, (head.arrival_time, self._seq, tenant))

    def prepend_request(self, request: Request) -> None:
        """vLLM puts a request back (preempted, or skipped this step): the tier's front."""
        self._back.appendleft(request)
        self._len += 1
        self._peeked = None

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.prepend_request(request)

    def _refused(self, a: Any) -> bool:
        assert self._skip is not None  # FairShare.next is given this only when it is set
        return self._skip(a, self._queues[a.tenant].peek_request())

    def _head(self) -> tuple[Any, Any]:
        a = self._share.next(self._refused if self._skip else None)
        if a is None:
            raise IndexError("no waiting request may be admitted")
        if self._slack:
            a = self._within_slack(a)
        return a, self._queues[a.tenant]

    def _within_slack(self, smallest: Any) -> Any:
        """The tenant of the oldest waiting head if it is within the slack of `smallest`
        (and not refused), else `smallest`."""
        oldest = self._oldest_tenant()
        if oldest is None or oldest is smallest or oldest.counter > smallest.counter + self._slack:
            return smallest
        return smallest if self._skip and self._refused(oldest) else oldest

    def _oldest_tenant(self) -> Any:
        """The account whose queue's head arrived first. O(log tenants) amortised."""
        heap, queues = self._oldest, self._queues
        while heap:
            arrived, _, tenant = heap[0]
            q = queues.get(tenant)
            if q is not None and q.peek_request().arrival_time == arrived:
                return self._share.accounts[tenant]
            heapq.heappop(heap)  # its request left the head
        return None

    def peek_request(self) -> Request:
        if self._back:
            self._peeked = self._back
            return self._back[0]
        a, q = self._head()
        self._peeked = a
        return q.peek_request()

    def pop_request(self) -> Request:
        """The request `peek_request` showed: vLLM allocates for it between the two calls,
        which may bring its tenant to its cap, and must still get that request."""
        a, self._peeked = self._peeked, None
        if a is self._back or (a is None and self._back):
            self._len -= 1
            return self._back.popleft()
        if a is None or a.tenant not in self._queues:
            a = self._head()[0]
        q = self._queues[a.tenant]
        request = q.pop_request()
        self._left(a, q, 1)
        return request

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(requests)
        back = len(self._back)
        if back:
            self._back = deque(r for r in self._back if r not in gone)
            self._len -= back - len(self._back)
        by_tenant: dict[str, list[Request]] = {}
        for request in gone:
            by_tenant.setdefault(self._account_of(request).tenant, []).append(request)
        for tenant, mine in by_tenant.items():
            q = self._queues.get(tenant)
            if q is not None:
                before = len(q)
                q.remove_requests(mine)
                self._left(self._account_of(mine[0]), q, before - len(q))
        self._peeked = None

    def _left(self, a: Any, q: Any, n: int) -> None:
        self._peeked = None
        self._len -= n
        for _ in range(n):
            self._share.dequeued(a)
        if not q:
            del self._queues[a.tenant]
        elif self._slack:
            self._note_head(a.tenant, q.peek_request())

    def __bool__(self) -> bool:
        if not self._len:
            return False
        if self._back or self._skip is None:
            return True
        return self._share.next(self._refused) is not None

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Put-back requests, then tenants by counter, each in its own order (O(n log
        tenants), for inspection)."""
        accounts = self._share.accounts
        order = sorted(self._queues, key=lambda tenant: accounts[tenant].counter)
        return chain(self._back, *(self._queues[tenant] for tenant in order))


class TenantWaitingQueue:
    """One request queue per bucket (0 = served first).

    Invariant: a request sits in bucket `rank_of(request)` and nowhere else;
    `len(self)` is the sum of bucket sizes. Costs: those of the bucket queue
    (FCFS: add/prepend O(1); priority: O(log n)) plus O(ranks) to find the
    first non-empty bucket on peek and pop (ranks = tiers + 1, a small
    constant). With a single bucket it behaves exactly like its bucket queue.
    """

    def __init__(
        self,
        rank_of: Callable[[Request], int],
        num_buckets: int,
        make_bucket: Callable[[int], Any] = lambda bucket: Fifo(),
    ) -> None:
        self._rank_of = rank_of
        self._buckets = [make_bucket(b) for b in range(num_buckets)]
        self._len = 0
        self._peeked: Any = None  # the bucket the last peek showed

    def add_request(self, request: Request) -> None:
        self._buckets[self._rank_of(request)].add_request(request)
        self._len += 1
        self._peeked = None  # a new head may come first

    def _first_bucket(self) -> Any:
        for bucket in self._buckets:
            if bucket:
                return bucket
        raise IndexError("pop from an empty queue")

    def pop_request(self) -> Request:
        """The request the last `peek_request` showed (see `FairBucket.pop_request`)."""
        bucket, self._peeked = self._peeked, None
        if bucket is None or not len(bucket):
            bucket = self._first_bucket()
        request = bucket.pop_request()
        self._len -= 1
        return request

    def peek_request(self) -> Request:
        self._peeked = self._first_bucket()
        return self._peeked.peek_request()

    def prepend_request(self, request: Request) -> None:
        self._buckets[self._rank_of(request)].prepend_request(request)
        self._len += 1
        self._peeked = None

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Like vLLM's: one at a time, so under FCFS the last given ends up first."""
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        self._buckets[self._rank_of(request)].remove_request(request)
        self._len -= 1
        self._peeked = None

    def remove_requests(self, requests: Iterable[Request]) -> None:
        by_bucket: dict[int, list[Request]] = {}
        for request in requests:
            by_bucket.setdefault(self._rank_of(request), []).append(request)
        for index, gone in by_bucket.items():
            bucket = self._buckets[index]
            before = len(bucket)
            bucket.remove_requests(gone)
            self._len -= before - len(bucket)
        self._peeked = None

    def __bool__(self) -> bool:
        """Whether a request may be admitted now: a fair bucket whose tenants are all at
        their KV cap holds requests that must wait (`len` still counts them)."""
        return self._len > 0 and any(self._buckets)

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

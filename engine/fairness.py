"""Fair share inside a tier: the weighted Virtual Token Counter.

Sheng et al., "Fairness in Serving Large Language Models" (OSDI '24,
arXiv 2401.00588). Each tenant of a tier has a counter of the service it has
received, divided by its weight; the next waiting request comes from the
backlogged tenant (one with a request waiting) with the smallest counter; a
tenant that becomes backlogged again is lifted to the smallest backlogged
counter, so time spent idle banks no credit. Between two backlogged tenants the
counters then stay within a small multiple of the largest request's cost, and
the rule is work-conserving: it only orders requests, it never holds one back.

Service is weighted as in the paper: a prompt token costs `INPUT_COST`, a
generated token `OUTPUT_COST` (decoding holds the engine for a step a token).
Tokens recomputed after a preemption are service too: the engine did the work.

Plain Python, no vLLM: the scheduler adapter charges service and the waiting
queue (`kvlease.engine.waiting_queue.FairBucket`) asks `FairShare` whom to admit.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

INPUT_COST = 1.0
OUTPUT_COST = 2.0


@dataclass(slots=True, eq=False)
class Account:
    """One tenant's counter in one tier. `counter` is weighted service: it only grows
    (by `charge` and the lift), so a heap entry older than it is stale."""

    tenant: str
    weight: float
    book: FairShare  # its tier's, which keeps the backlogged service clock
    counter: float = 0.0
    waiting: int = 0  # its requests in the waiting queue: backlogged while > 0
    served: float = 0.0  # unweighted service, cumulative
    mark: float = 0.0  # `served` when its current backlog (or window) began
    vmark: float = 0.0  # the tier's `vtime` at the same moment
    requests: set[str] = field(default_factory=set)  # ids the engine holds (in flight)

    def charge(self, tokens: float) -> None:
        """`tokens` of service, INPUT_COST / OUTPUT_COST already applied. O(1)."""
        self.served += tokens
        self.counter += tokens / self.weight
        book = self.book
        if book.ending is not None:  # between an admission's pop and its charge
            book.charged_while_ending(self, tokens)
        elif self.waiting:
            book.vtime += tokens / book.weights


@dataclass
class FairShare:
    """The virtual token counters of one tier's tenants.

    Invariants:
    - every backlogged account has an entry `(counter, seq, account)` in `_heap` whose
      counter is at most its current one; entries of accounts no longer backlogged, and
      stale ones, are dropped or refreshed when they reach the top. Since counters never
      fall, the first fresh top entry is the smallest backlogged counter.
    - `floor` is the smallest backlogged counter when last looked at; an account that
      becomes backlogged is lifted to at least the current smallest (or to `floor` when
      nobody is backlogged), so idleness banks no credit.
    - an account with nothing in flight whose counter is at or under `floor` is forgotten:
      it would be lifted to the floor on return anyway. Memory: O(tenants in flight +
      idle tenants still above the floor).
    - the books are exact, whenever they are read: `vtime` is the service backlogged
      tenants received, per unit of the backlogged weight at the time (`weights`, the sum
      over backlogged accounts), so a tenant's entitlement over any stretch of its backlog
      is its weight times `vtime`'s growth over it, and the entitlements of a stretch add
      up to the service backlogged tenants received in it. A backlog that ends before a
      settlement is kept in `closed` until then (its account may be forgotten meanwhile).
    - a backlog ends with the admission of its last waiting request, charge included: the
      prompt is the service that request waited for. Until then its account is `ending`
      (out of the heap, still in `weights`); the account's next charge, or any other
      change to the books, closes it. Otherwise a tenant with one request at a time was
      booked an entitlement and never any service: a fair-share ratio of 0, and an alert,
      for a tenant served exactly its share.
    Costs: `charge` O(1); `enqueued` O(log n); `next` O(log n) amortised (each stale
    entry is refreshed once per change of its counter); `released` O(log n); `shares`
    O(backlogged + closed since the last settlement).
    """

    accounts: dict[str, Account] = field(default_factory=dict)
    floor: float = 0.0
    vtime: float = 0.0  # cumulative service to backlogged tenants / their weight then
    weights: float = 0.0  # the backlogged accounts' weights, summed
    backlogged: int = 0  # accounts with a request waiting
    # tenant -> [served, entitled] of backlogs that ended since the last settlement
    closed: dict[str, list[float]] = field(default_factory=dict)
    ending: Account | None = None  # its last waiting request was just taken, not yet charged
    _heap: list[tuple[float, int, Account]] = field(default_factory=list)
    _idle: list[tuple[float, int, Account]] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def account(self, tenant: str, weight: float, request_id: str) -> Account:
        """The account of `request_id`'s tenant, opened if new (at the floor: a newcomer
        is lifted anyway)."""
        self._end()
        a = self.accounts.get(tenant)
        if a is None:
            a = self.accounts[tenant] = Account(tenant, weight, self, self.floor)
        elif weight != a.weight and a.waiting:  # its books so far at the old weight
            self._close(a)
            self.weights += weight - a.weight
            a.mark, a.vmark = a.served, self.vtime
        a.weight = weight  # the latest request's weight (a token may carry a new one)
        a.requests.add(request_id)
        return a

    def released(self, a: Account, request_id: str) -> None:
        """`request_id` left the engine; forget the account once idle at the floor."""
        self._end()
        a.requests.discard(request_id)
        if not a.requests:
            heapq.heappush(self._idle, (a.counter, next(self._seq), a))
            self._forget_idle()

    def enqueued(self, a: Account) -> None:
        """A new request of `a` joined the waiting queue. A tenant that becomes backlogged
        is lifted to the smallest backlogged counter: idleness banks no credit. (A request
        put back after a preemption is not new: the waiting queue resumes it first.)"""
        self._end()
        a.waiting += 1
        if a.waiting == 1:  # backlogged again: lift, then compete
            a.mark, a.vmark = a.served, self.vtime
            self.backlogged += 1
            self.weights += a.weight
            smallest = self._smallest()
            a.counter = max(a.counter, self.floor if smallest is None else smallest.counter)
            heapq.heappush(self._heap, (a.counter, next(self._seq), a))

    def dequeued(self, a: Account) -> None:
        """A request of `a` left the waiting queue (admitted, put back or aborted). If it
        was the last, the backlog ends with its admission's charge (`charged_while_ending`)
        or, if no charge of `a` comes first, at the next change to the books."""
        self._end()
        a.waiting -= 1
        if a.waiting == 0:
            self.ending = a

    def charged_while_ending(self, a: Account, tokens: float) -> None:
        """`a.charge` while a backlog is ending: the ending account's own charge is the
        admission it waited for, service of its backlog, which then ends; any other
        charge first ends that backlog. O(1)."""
        if a is self.ending:
            self.vtime += tokens / self.weights
            self._end()
        else:
            self._end()
            if a.waiting:
                self.vtime += tokens / self.weights

    def _end(self) -> None:
        """Close the ending backlog, if any: book it until the next settlement."""
        a = self.ending
        if a is not None:
            self.ending = None
            self._close(a)
            self.backlogged -= 1
            self.weights = self.weights - a.weight if self.backlogged else 0.0  # no drift

    def _close(self, a: Account) -> None:
        book = self.closed.setdefault(a.tenant, [0.0, 0.0])
        book[0] += a.served - a.mark
        book[1] += a.weight * (self.vtime - a.vmark)

    def next(self, skip: Callable[[Account], bool] | None = None) -> Account | None:
        """The backlogged account with the smallest counter, leaving out those `skip`
        refuses (tenants at their KV cap); None when nobody else is backlogged."""
        smallest = self._smallest()
        if skip is None or smallest is None or not skip(smallest):
            return smallest
        held: list[tuple[float, int, Account]] = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            a = entry[2]
            if a.waiting == 0 or entry[0] < a.counter:
                if a.waiting:
                    heapq.heappush(self._heap, (a.counter, next(self._seq), a))
                continue
            held.append(entry)
            if not skip(a):
                found = a
                break
        for entry in held:
            heapq.heappush(self._heap, entry)
        return found

    def _smallest(self) -> Account | None:
        heap = self._heap
        while heap:
            counter, _, a = heap[0]
            if a.waiting == 0:
                heapq.heappop(heap)
            elif counter < a.counter:
                heapq.heapreplace(heap, (a.counter, next(self._seq), a))
            else:
                if counter > self.floor:
                    self.floor = counter
                    self._forget_idle()
                return a
        return None

    def _forget_idle(self) -> None:
        idle = self._idle
        while idle and idle[0][0] <= self.floor:
            counter, _, a = heapq.heappop(idle)
            if not a.requests and a.counter == counter and self.accounts.get(a.tenant) is a:
                del self.accounts[a.tenant]

    def forget(self) -> None:
        """Forget every tenant's counter, as a freshly started server knows none (between
        benchmark runs and tests sharing an engine); the books since the last settlement
        stay. Only with nothing in flight: a counter in use cannot be forgotten."""
        if any(a.requests for a in self.accounts.values()):
            raise ValueError("fair share cannot forget counters while requests are in flight")
        self._end()
        self.accounts.clear()
        self.floor = 0.0
        self._heap.clear()
        self._idle.clear()

    def shares(self) -> dict[str, tuple[float, float, float]]:
        """Per tenant backlogged at some time since the last `settle()`: its counter, the
        service it received while backlogged, and its entitlement over the same time: its
        weight's part of what every backlogged tenant of the tier received meanwhile.
        Served over entitled is its fair-share ratio: 1.0 its share exactly, 0.5 half of
        it. Exact: a backlog that began and ended between two settlements counts."""
        out = {}
        for tenant, (served, entitled) in self.closed.items():
            a = self.accounts.get(tenant)
            out[tenant] = (a.counter if a is not None else self.floor, served, entitled)
        for a in self.accounts.values():
            if a.waiting or a is self.ending:
                _, served, entitled = out.get(a.tenant, (0.0, 0.0, 0.0))
                served += a.served - a.mark
                entitled += a.weight * (self.vtime - a.vmark)
                out[a.tenant] = (a.counter, served, entitled)
        return out

    def settle(self) -> dict[str, tuple[float, float, float]]:
        """`shares()`, after which the books count anew."""
        out = self.shares()
        self.closed = {}
        for a in self.accounts.values():
            if a.waiting or a is self.ending:
                a.mark, a.vmark = a.served, self.vtime
        return out

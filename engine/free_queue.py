"""A drop-in replacement for vLLM's free-block queue that protects leased prefixes.

vLLM keeps free KV blocks in one doubly linked list, `FreeKVCacheBlockQueue`,
in eviction order: blocks without a reusable prefix at the front, cached
prefix blocks behind them in LRU order. Allocation pops from the front, and a
popped block that still holds a prefix is evicted from the prefix cache.

`TenantFreeBlockQueue` keeps the same single list and the same interface, and
adds separator nodes that split it into segments, evicted in this order (n leasing
tiers, least important first):

    EMPTY | CACHED | RETAINED(0) .. RETAINED(n-1) | RESERVED(0) .. RESERVED(n-1)

A cached block freed by a session whose lease is running goes to the back of its
tier's RESERVED segment while the session's reservation window runs
(kvlease.engine.reservations), else to the back of its tier's RETAINED segment; either way
it is evicted only after every EMPTY and CACHED block. When the window closes,
`retain` moves the session's blocks from RESERVED to RETAINED. A lease protects the
session's latest context only: when the session's last request in flight frees its
blocks, the session's leased blocks that request did not reuse are demoted first. A
tier's RESERVED segment holds at most its cap: at the cap, the tier's oldest reserved
block moves to the back of its RETAINED segment, so the sessions that were active
last, the likeliest to send a next turn, keep their reservation. The cap starts at the
tier table's and moves below it with what the reservations return (kvlease.engine.payback reads
`reserved_left` and `reserved_reused`, and sets it with `set_caps`). When a lease
expires its blocks move to the front of CACHED: they are the stalest prefixes.
With no owner set, every append lands in CACHED and the queue behaves exactly
like vLLM's (a differential test checks this).

A RESERVED segment is a reservation: while the scheduler allocates for a request, it
calls `reserve(k)`, k being the reserved tiers that request may take (those of its
own tier and lower), and the queue then reports and hands out only the blocks in
front of RESERVED(tier k). vLLM's `allocate_slots` reads `num_free_blocks` before it
pops, so a request that would need a reserved block gets no blocks: a running one is
preempted (or preempts a lower one), a waiting one waits. RETAINED blocks are never
hidden: any request may evict them, after every CACHED block.

It does not import vLLM: blocks are duck-typed (`block_id`, `block_hash`,
`prev_free_block`, `next_free_block`), like the ones vLLM's queue links.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvlease.engine.policy import EvictionClass, eviction_class

Block = Any  # vllm.v1.core.kv_cache_utils.KVCacheBlock

EMPTY = int(EvictionClass.EMPTY)
CACHED = int(EvictionClass.CACHED)
FIRST_LEASED = int(EvictionClass.RETAINED)  # the first RETAINED segment


@dataclass(eq=False, slots=True)
class Holder:
    """The owner of freed cached blocks: one tenant session (or tenant).

    The scheduler keeps one Holder per session, sets `protected` while the session's
    lease runs, and `reserving` from the end of a turn until its reservation window
    closes. The queue keeps the block counts current, so per-tenant occupancy is read
    off holders in O(holders), not O(blocks).
    """

    tenant_id: str | None
    tier: str | None
    session_id: str | None
    lease_index: int | None  # its tier among the leasing tiers (0: least important)
    protected: bool = False
    # Inside a reservation window: its freed blocks are RESERVED, not RETAINED. A window
    # opens only when the session's last request in flight ends (the scheduler's
    # `_end_turn`): blocks freed while the turn runs (a preemption, a sibling request
    # finishing) wait for no return, so they are only retained.
    reserving: bool = False
    reserved_until: float = math.inf  # when its reservation window closes (the scheduler's)
    in_flight: int = 0  # requests of this session in the engine
    # Of those, requests not yet admitted once: a window that ends while its session's
    # returning turn waits stays open until that turn is admitted (the scheduler's).
    returning: int = 0
    deferred: int = 0  # its block frees vLLM has put off (connectors, in-flight steps)
    last_hashes: list[Any] | None = None  # block hashes of its latest finished request's context
    cached: int = 0  # blocks in CACHED
    leased: int = 0  # blocks in a RETAINED or RESERVED segment
    reserved: int = 0  # of those, blocks in a RESERVED segment
    evicted_cached: int = 0  # cumulative
    evicted_leased: int = 0  # cumulative


class _Separator:
    """A fake block at a segment boundary; never handed out (block_id -1, as vLLM's)."""

    __slots__ = ("block_id", "next_free_block", "prev_free_block", "segment")

    def __init__(self, segment: int) -> None:
        self.block_id = -1
        self.segment = segment
        self.prev_free_block: Any = None
        self.next_free_block: Any = None


class TenantFreeBlockQueue:
    """vLLM's free-block queue with EMPTY / CACHED / RETAINED / RESERVED segments.

    Invariants: the list runs HEAD, blocks and separators in segment order,
    TAIL; `_free` counts real blocks; `_segment[b]` is the segment of
    every free block b and `_owner[b]` its Holder (None for EMPTY blocks and
    blocks freed with no owner); each Holder's `cached`/`leased`/`reserved` equal
    the blocks it owns in those segments; `_count[s] <= _cap[s]` for every RESERVED s.

    Costs: popleft is O(segments) (a small constant: twice the leasing tiers, + 2), remove,
    append (with a demotion at the cap) and prepend are O(1), `num_free_blocks`
    is a plain attribute, `reserve` O(segments); none allocates, except that a popleft
    evicting a held prefix block logs it (one tuple appended to `evictions`) and that
    `popleft` builds a one-block list (it is `popleft_n(1)`; vLLM calls it once, for
    its null block).
    `retain`, `demote` and `release` are O(blocks in that tier's segments) and happen
    once per reservation window, turn or lease, off the per-step path.
    """

    def __init__(
        self,
        blocks: Sequence[Block],
        num_blocks: int,
        leased_caps: Sequence[int] = (),
        retains: bool = True,
    ):
        """`leased_caps[i]` caps the RESERVED segment of leasing tier i (least important
        first); RETAINED segments have no cap (any request may take their blocks). With
        `retains` off (an ablation: no lease eviction order), what would be RETAINED goes
        to the back of CACHED instead, as in vLLM's LRU."""
        self._retains = retains
        self._tiers = len(leased_caps)
        self._first_reserved = FIRST_LEASED + self._tiers
        nseg = self._first_reserved + self._tiers
        self._seps = [_Separator(s) for s in range(nseg)] + [_Separator(nseg)]
        self._head, self._tail = self._seps[0], self._seps[-1]
        for a, b in zip(self._seps, self._seps[1:], strict=False):
            a.next_free_block, b.prev_free_block = b, a
        self._cap = [0] * self._first_reserved + list(leased_caps)
        self._count = [0] * nseg  # blocks in each RETAINED and RESERVED segment
        self.reserved_blocks = 0  # in every RESERVED segment: 0 means nothing is reserved
        # Blocks that left each RESERVED segment (least important leasing tier first), and
        # of those the ones a next turn reused: what a reservation returns (cumulative).
        self.reserved_left = [0] * self._tiers
        self.reserved_reused = [0] * self._tiers
        self._segment = [EMPTY] * num_blocks
        self._owner: list[Holder | None] = [None] * num_blocks
        self._free = 0  # every free block
        self.num_free_blocks = 0  # those the current allocation may take (vLLM reads this)
        self.owner: Holder | None = None  # who is freeing blocks right now (set by the scheduler)
        # The request allocating right now, where the scheduler knows it (its id); None:
        # the step's output will say who got each block.
        self.taker: str | None = None
        self.reserve_from = nseg  # segments from here on are hidden (`reserve`)
        # Evictions not yet reported, in order: (holder, leased, block id, taker). Without a
        # taker, the block id lets the scheduler name the request the block went to (its
        # step's output).
        self.evictions: list[tuple[Holder, bool, int, str | None]] = []
        for block in blocks:
            self._insert_before(self._seps[CACHED], block, EMPTY, None)

    @classmethod
    def replacing(
        cls, queue: Any, num_blocks: int, leased_caps: Sequence[int] = (), retains: bool = True
    ) -> TenantFreeBlockQueue:
        """A tenant queue holding `queue`'s free blocks in the same order."""
        return cls(queue.get_all_free_blocks(), num_blocks, leased_caps, retains)

    # -- vLLM's FreeKVCacheBlockQueue interface ------------------------------

    def reserve(self, takes: int) -> None:
        """Until `unreserve`, hide the RESERVED segments of leasing tiers `takes` and up:
        they are neither counted in `num_free_blocks` nor popped. O(segments)."""
        self.reserve_from = self._first_reserved + takes
        self.num_free_blocks = self.free_for(takes)

    def free_for(self, takes: int) -> int:
        """Free blocks a request that may take the reservations of leasing tiers below
        `takes` (and no other) may take."""
        visible = self._free
        for seg in range(self._first_reserved + takes, len(self._count)):
            visible -= self._count[seg]
        return visible

    def unreserve(self) -> None:
        self.reserve_from = len(self._count)
        self.num_free_blocks = self._free

    @property
    def free_unreserved(self) -> int:
        """Free blocks outside every RESERVED segment: what any request may take."""
        return self._free - self.reserved_blocks

    @property
    def fake_free_list_head(self) -> _Separator:
        return self._head

    @property
    def fake_free_list_tail(self) -> _Separator:
        return self._tail

    def popleft(self) -> Block:
        if not self.num_free_blocks:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Block]:
        """`n` pops, the list walked once: every allocation of new blocks comes here."""
        assert self.num_free_blocks >= n
        blocks = []
        node = self._head.next_free_block
        for _ in range(n):
            while node.block_id < 0:  # a separator: the next segment, unless hidden
                if node is self._tail or node.segment >= self.reserve_from:
                    raise ValueError("No free blocks available")
                node = node.next_free_block
            block, node = node, node.next_free_block
            self._unlink(block, evicting=True)
            blocks.append(block)
        return blocks

    def remove(self, block: Block) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        seg = self._segment[block.block_id]
        if seg >= self._first_reserved:  # a prefix hit on a reserved block
            self.reserved_reused[seg - self._first_reserved] += 1
        self._unlink(block, evicting=False)

    def append(self, block: Block) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Sequence[Block]) -> None:
        """Each block to the back of its segment. One owner frees them all (one request's
        blocks), so the segment is worked out once; a block with no prefix is CACHED and
        unowned, as in vLLM's queue. O(1) a block."""
        owner = self.owner
        seg = CACHED if owner is None else self._segment_for(owner)
        capped = seg >= self._first_reserved
        back, cached_back = self._seps[seg + 1], self._seps[CACHED + 1]
        for block in blocks:
            if block.block_hash is None:
                self._insert_before(cached_back, block, CACHED, None)
                continue
            if capped and self._count[seg] >= self._cap[seg]:
                self._demote_oldest(seg)
            self._insert_before(back, block, seg, owner)

    def prepend_n(self, blocks: Sequence[Block]) -> None:
        after = self._head
        for block in blocks:
            self._insert_before(after.next_free_block, block, EMPTY, None)
            after = block

    def get_all_free_blocks(self) -> list[Block]:
        return list(self.iter_blocks_after(None))

    def iter_blocks_after(self, cursor: Block | None) -> Iterator[Block]:
        node = self._head.next_free_block if cursor is None else cursor.next_free_block
        while node is not None and node is not self._tail:
            if node.block_id >= 0:
                yield node
            node = node.next_free_block

    # -- tenant operations ---------------------------------------------------

    def release(self, holder: Holder) -> int:
        """The holder's lease ended: move its blocks to the front of CACHED, in order."""
        holder.protected = False
        return self.demote(holder)

    def demote(self, holder: Holder) -> int:
        """Move the holder's leased blocks to the front of CACHED, in order: they are the
        stalest prefixes. O(blocks in its tier's segments)."""
        if holder.lease_index is None or holder.leased == 0:
            return 0
        moved = self._blocks_of(holder, FIRST_LEASED + holder.lease_index)
        moved += self._blocks_of(holder, self._first_reserved + holder.lease_index)
        after = self._seps[CACHED]
        for block in moved:
            self._unlink(block, evicting=False)
            self._insert_before(after.next_free_block, block, CACHED, holder)
            after = block
        return len(moved)

    def retain(self, holder: Holder) -> int:
        """The holder's reservation window closed: from now on its freed blocks are
        RETAINED, and its RESERVED blocks move to the back of its tier's RETAINED
        segment, in order. O(blocks in its tier's RESERVED segment)."""
        holder.reserving = False
        if holder.lease_index is None or holder.reserved == 0:
            return 0
        moved = self._blocks_of(holder, self._first_reserved + holder.lease_index)
        retained = self._retained(holder.lease_index)
        for block in moved:
            self._unlink(block, evicting=False)
            self._insert_before(self._seps[retained + 1], block, retained, holder)
        return len(moved)

    def set_caps(self, caps: Sequence[int]) -> None:
        """New RESERVED caps (least important leasing tier first); a segment over its new
        cap demotes its oldest blocks to RETAINED. O(tiers + blocks demoted)."""
        for i, cap in enumerate(caps):
            seg = self._first_reserved + i
            self._cap[seg] = cap
            while self._count[seg] > cap:
                self._demote_oldest(seg)

    def take_evictions(self) -> list[tuple[Holder, bool, int, str | None]]:
        """Evictions since the last call, in order: (holder, whether leased, block id, the
        request that took it if known)."""
        evictions, self.evictions = self.evictions, []
        return evictions

    def reserved_sizes(self) -> list[int]:
        """Blocks in each RESERVED segment, least important leasing tier first."""
        return self._count[self._first_reserved :]

    def segment_sizes(self) -> list[int]:
        sizes = [0] * (len(self._seps) - 1)
        for block in self.iter_blocks_after(None):
            sizes[self._segment[block.block_id]] += 1
        return sizes

    def check(self) -> None:
        """Verify every invariant by a full walk (tests and debug mode)."""
        seen, seg, prev = 0, -1, None
        node = self._head
        counts: dict[Holder, list[int]] = {}
        leased = [0] * len(self._count)
        while node is not None:
            assert node.prev_free_block is prev, "broken back link"
            if node.block_id < 0:
                assert node.segment == seg + 1, "separators out of order"
                seg = node.segment
            else:
                seen += 1
                assert self._segment[node.block_id] == seg, "block in the wrong segment"
                owner = self._owner[node.block_id]
                assert owner is None or seg != EMPTY, "owner recorded for an EMPTY block"
                if owner is not None:
                    count = counts.setdefault(owner, [0, 0, 0])
                    count[0 if seg == CACHED else 1] += 1
                    count[2] += seg >= self._first_reserved
                if seg >= FIRST_LEASED:
                    leased[seg] += 1
            prev, node = node, node.next_free_block
        assert prev is self._tail
        assert seen == self._free, "free block count out of sync"
        if self.reserve_from == len(self._count):
            assert self.num_free_blocks == self._free, "visible count out of sync"
        assert leased == self._count, "leased segment counts out of sync"
        reserved = leased[self._first_reserved :]
        assert sum(reserved) == self.reserved_blocks, "reserved block total out of sync"
        for s in range(self._first_reserved, len(self._count)):
            assert self._count[s] <= self._cap[s], "reserved cap exceeded"
        for left, reused in zip(self.reserved_left, self.reserved_reused, strict=True):
            assert reused <= left, "more reserved blocks reused than left their segment"
        for owner, count in counts.items():
            held = [owner.cached, owner.leased, owner.reserved]
            assert held == count, "holder counts out of sync"

    # -- internals -----------------------------------------------------------

    def _blocks_of(self, holder: Holder, seg: int) -> list[Block]:
        blocks, node = [], self._seps[seg].next_free_block
        while node is not self._seps[seg + 1]:
            if self._owner[node.block_id] is holder:
                blocks.append(node)
            node = node.next_free_block
        return blocks

    def _demote_oldest(self, seg: int) -> None:
        """The tier is at its reservation cap: its oldest reserved block becomes the
        newest RETAINED one of the tier (its lease still protects it, by order)."""
        block = self._seps[seg].next_free_block
        owner = self._owner[block.block_id]
        retained = self._retained(seg - self._first_reserved)
        self._unlink(block, evicting=False)
        self._insert_before(self._seps[retained + 1], block, retained, owner)

    def _segment_for(self, owner: Holder) -> int:
        """The segment `owner`'s freed prefix blocks go to now (`policy.eviction_class`)."""
        index = owner.lease_index
        if index is None:
            return CACHED
        reserving = owner.reserving and self._cap[self._first_reserved + index] > 0
        cls = eviction_class(True, owner.protected, reserving)
        if cls is EvictionClass.RESERVED:
            return self._first_reserved + index
        if cls is EvictionClass.RETAINED:
            return self._retained(index)
        return CACHED

    def _retained(self, lease_index: int) -> int:
        """The segment a leasing tier's blocks go to when their lease protects by order."""
        return FIRST_LEASED + lease_index if self._retains else CACHED

    def _insert_before(self, nxt: Any, block: Block, seg: int, owner: Holder | None) -> None:
        prev = nxt.prev_free_block
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = nxt
        nxt.prev_free_block = block
        i = block.block_id
        self._segment[i] = seg
        self._owner[i] = owner
        if owner is not None:
            if seg == CACHED:
                owner.cached += 1
            elif seg >= FIRST_LEASED:
                owner.leased += 1
                self._count[seg] += 1
                if seg >= self._first_reserved:
                    owner.reserved += 1
                    self.reserved_blocks += 1
        self._free += 1
        self.num_free_blocks += 1

    def _unlink(self, block: Block, evicting: bool) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self._free -= 1
        self.num_free_blocks -= 1
        i = block.block_id
        owner = self._owner[i]
        if owner is None:
            return
        self._owner[i] = None
        seg = self._segment[i]
        leased = seg >= FIRST_LEASED
        if leased:
            owner.leased -= 1
            self._count[seg] -= 1
            if seg >= self._first_reserved:
                owner.reserved -= 1
                self.reserved_blocks -= 1
                self.reserved_left[seg - self._first_reserved] += 1
        else:
            owner.cached -= 1
        if evicting and block.block_hash is not None:
            self.evictions.append((owner, leased, i, self.taker))
            if leased:
                owner.evicted_leased += 1
            else:
                owner.evicted_cached += 1

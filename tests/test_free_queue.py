"""The tenant free-block queue: vLLM's behaviour without tenants, lease protection with them."""

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvlease.engine.free_queue import CACHED, EMPTY, Holder, TenantFreeBlockQueue

N = 24


def _blocks(n=N, hashed=()):
    blocks = [KVCacheBlock(i) for i in range(n)]
    for i in hashed:
        blocks[i]._block_hash = b"h%d" % i
    return blocks


def _ids(queue):
    return [b.block_id for b in queue.get_all_free_blocks()]


ops = st.lists(
    st.tuples(
        st.sampled_from(["popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"]),
        st.integers(0, 10_000),
        st.integers(0, 4),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, hashed=st.sets(st.integers(0, N - 1)))
def test_without_owners_it_behaves_exactly_like_vllms_queue(ops, hashed):
    ours_blocks, stock_blocks = _blocks(hashed=hashed), _blocks(hashed=hashed)
    ours = TenantFreeBlockQueue(ours_blocks, N, leased_caps=[8, 8])
    stock = FreeKVCacheBlockQueue(stock_blocks)
    for op, pick, k in ops:
        free = _ids(stock)
        taken = sorted(set(range(N)) - set(free))
        if op == "popleft" and free:
            assert ours.popleft().block_id == stock.popleft().block_id
        elif op == "popleft_n":
            k = min(k, len(free))
            assert [b.block_id for b in ours.popleft_n(k)] == [
                b.block_id for b in stock.popleft_n(k)
            ]
        elif op == "remove" and free:
            i = free[pick % len(free)]
            ours.remove(ours_blocks[i])
            stock.remove(stock_blocks[i])
        elif op in ("append", "append_n", "prepend_n") and taken:
            chosen = [taken[(pick + j) % len(taken)] for j in range(min(k, len(taken)) or 1)]
            chosen = list(dict.fromkeys(chosen))
            if op == "append":
                chosen = chosen[:1]
                ours.append(ours_blocks[chosen[0]])
                stock.append(stock_blocks[chosen[0]])
            else:
                getattr(ours, op)([ours_blocks[i] for i in chosen])
                getattr(stock, op)([stock_blocks[i] for i in chosen])
        assert _ids(ours) == _ids(stock)
        assert ours.num_free_blocks == stock.num_free_blocks
        ours.check()


def _taken(queue, blocks, ids):
    for i in ids:
        queue.remove(blocks[i])
    return [blocks[i] for i in ids]


def test_leased_prefixes_are_evicted_only_after_every_unleased_block():
    blocks = _blocks(hashed=range(N))
    queue = TenantFreeBlockQueue(blocks, N, leased_caps=[N])
    premium = Holder("acme", "premium", "s1", 0, protected=True)
    free_tier = Holder("bob", "free", "s2", None)
    held = _taken(queue, blocks, range(N))  # everything allocated
    queue.owner = premium
    queue.append_n(held[:4])
    queue.owner = free_tier
    queue.append_n(held[4:8])
    queue.owner = None
    queue.prepend_n(held[8:])
    queue.check()
    assert (premium.leased, premium.cached, free_tier.cached) == (4, 0, 4)
    order = [queue.popleft().block_id for _ in range(N)]
    assert order[-4:] == [0, 1, 2, 3]  # the leased prefix goes last
    assert order[-8:-4] == [4, 5, 6, 7]  # after the empty blocks, before the lease
    assert (premium.evicted_leased, free_tier.evicted_cached) == (4, 4)
    evictions = queue.take_evictions()  # in eviction order, each with its block's id
    assert [(h.tenant_id, leased, i) for h, leased, i, _ in evictions] == [
        ("bob", False, i) for i in (4, 5, 6, 7)
    ] + [("acme", True, i) for i in (0, 1, 2, 3)]
    assert queue.take_evictions() == []


def test_at_the_tier_cap_the_newest_reserved_blocks_stay_and_the_oldest_are_retained():
    blocks = _blocks(hashed=range(N))
    queue = TenantFreeBlockQueue(blocks, N, leased_caps=[2])
    old = Holder("acme", "premium", "s1", 0, protected=True, reserving=True)
    new = Holder("acme", "premium", "s2", 0, protected=True, reserving=True)
    queue.owner = old
    queue.append_n(_taken(queue, blocks, range(3)))
    queue.check()
    assert (old.leased, old.reserved, old.cached) == (3, 2, 0)
    queue.owner = new
    queue.append_n(_taken(queue, blocks, range(3, 5)))
    queue.owner = None
    queue.check()
    assert (old.leased, old.reserved, new.leased, new.reserved) == (3, 0, 2, 2)
    assert queue.segment_sizes() == [N - 5, 0, 3, 2]  # EMPTY, CACHED, RETAINED, RESERVED
    # Eviction order: the empty blocks, then s1's three (oldest first), then s2's two.
    assert [b.block_id for b in queue.popleft_n(N)][-5:] == [0, 1, 2, 3, 4]


def test_expired_lease_moves_blocks_to_the_front_of_cached_in_order():
    blocks = _blocks(hashed=range(N))
    queue = TenantFreeBlockQueue(blocks, N, leased_caps=[N])
    holder = Holder("acme", "premium", "s1", 0, protected=True)
    other = Holder("bob", "free", None, None)
    held = _taken(queue, blocks, range(6))
    queue.owner = other
    queue.append_n(held[4:])
    queue.owner = holder
    queue.append_n(held[:4])
    queue.owner = None
    assert queue.release(holder) == 4
    assert not holder.protected
    queue.check()
    assert (holder.leased, holder.cached) == (0, 4)
    free = _ids(queue)
    assert free[-6:] == [0, 1, 2, 3, 4, 5]  # stalest first within CACHED
    assert queue.segment_sizes()[EMPTY] == N - 6
    assert queue.segment_sizes()[CACHED] == 6


def test_a_touched_block_leaves_its_owners_count_without_counting_an_eviction():
    blocks = _blocks(hashed=range(N))
    queue = TenantFreeBlockQueue(blocks, N, leased_caps=[N])
    holder = Holder("acme", "premium", "s1", 0, protected=True)
    held = _taken(queue, blocks, range(3))
    queue.owner = holder
    queue.append_n(held)
    queue.remove(blocks[1])  # a prefix hit reuses it
    assert (holder.leased, holder.evicted_leased) == (2, 0)
    assert queue.take_evictions() == []
    queue.check()


def test_replacing_keeps_vllms_order():
    stock_blocks = _blocks()
    stock = FreeKVCacheBlockQueue(stock_blocks)
    stock.popleft()
    stock.append(stock.popleft())
    before = _ids(stock)
    ours = TenantFreeBlockQueue.replacing(stock, N, leased_caps=[3])  # relinks the same blocks
    assert _ids(ours) == before
    ours.check()


def _leased_queue(caps=(4, 6), retains=True):
    """A queue whose blocks 0..N-1 are free; `standard` is leasing tier 0 and `premium`
    tier 1 (least important first), both between turns inside their reservation window."""
    blocks = _blocks(hashed=range(N))
    queue = TenantFreeBlockQueue(blocks, N, leased_caps=list(caps), retains=retains)
    holders = {
        "standard": Holder("s", "standard", "s1", 0, protected=True, reserving=True),
        "premium": Holder("p", "premium", "p1", 1, protected=True, reserving=True),
    }
    return blocks, queue, holders


def _free_as(queue, blocks, holder, ids):
    queue.owner = holder
    queue.append_n([blocks[i] for i in ids])
    queue.owner = None


def test_blocks_freed_before_a_reservation_window_opens_are_only_retained():
    """A leased session's turn still runs (a preempted request, or one of several in
    flight): nobody is waiting to come back for what it frees, so nothing is reserved."""
    blocks, queue, _ = _leased_queue()
    in_turn = Holder("p", "premium", "p1", 1, protected=True)
    queue.popleft_n(N)
    _free_as(queue, blocks, in_turn, [0, 1, 2])
    queue.check()
    assert (in_turn.leased, in_turn.reserved) == (3, 0)
    queue.reserve(0)  # a free-tier request may take them, after every unleased block
    assert queue.num_free_blocks == 3


def test_a_reservation_hides_the_more_important_leases_from_count_and_pop():
    blocks, queue, holders = _leased_queue()
    queue.popleft_n(N)
    _free_as(queue, blocks, None, [0, 1])
    _free_as(queue, blocks, holders["standard"], [2, 3, 4])
    _free_as(queue, blocks, holders["premium"], [5, 6, 7, 8])
    assert queue.num_free_blocks == 9
    queue.reserve(0)  # a free-tier request: may take neither reservation
    assert queue.num_free_blocks == 2
    assert [queue.popleft().block_id for _ in range(2)] == [0, 1]
    try:
        queue.popleft()
        raise AssertionError("popped a reserved block")
    except ValueError:
        pass
    queue.reserve(1)  # a standard request: its own tier's reservations too
    assert queue.num_free_blocks == 3
    queue.unreserve()
    assert queue.num_free_blocks == 7
    queue.check()


# take and free blocks, end a lease or a window, reuse a free block, move a tier's cap
LEASE_OPS = ("take", "free_plain", "free_standard", "free_premium", "expire", "window")
LEASE_OPS += ("hit", "recap")
lease_ops = st.lists(
    st.tuples(
        st.sampled_from(LEASE_OPS),
        st.integers(0, 10_000),
        st.integers(1, 6),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=lease_ops, caps=st.tuples(st.integers(0, 8), st.integers(0, 8)), retains=st.booleans())
def test_reservations_never_exceed_the_caps_and_leave_the_rest_to_anyone(ops, caps, retains):
    """Also with `retains` off (the lease-eviction-order ablation): nothing is RETAINED."""
    blocks, queue, holders = _leased_queue(caps, retains)
    held: list[int] = [b.block_id for b in queue.popleft_n(N)]
    for op, pick, k in ops:
        if op == "take":
            queue.reserve(pick % 3)
            k = min(k, queue.num_free_blocks)
            held += [b.block_id for b in queue.popleft_n(k)]
            queue.unreserve()
        elif op.startswith("free") and held:
            ids = [held.pop(pick % len(held)) for _ in range(min(k, len(held)))]
            _free_as(queue, blocks, holders.get(op.removeprefix("free_")), ids)
        elif op == "expire":
            queue.release(holders["standard" if pick % 2 else "premium"])
            holders["standard" if pick % 2 else "premium"].protected = True
        elif op == "window":  # a reservation window closes; the next turn may reserve
            holder = holders["standard" if pick % 2 else "premium"]
            queue.retain(holder)
            holder.reserving = bool(k % 2)
        elif op == "hit":  # a next turn reuses a free block (vLLM's touch)
            free = queue.get_all_free_blocks()
            if free:
                block = free[pick % len(free)]
                queue.remove(block)
                held.append(block.block_id)
        elif op == "recap":  # the payback tuner moves a cap within the tier table's
            queue.set_caps([pick % (cap + 1) if i == k % 2 else cap for i, cap in enumerate(caps)])
        queue.check()  # includes: each RESERVED segment within its cap
        if not retains:
            assert all(h.leased == h.reserved for h in holders.values())
        reserved = queue.reserved_sizes()
        assert all(n <= cap for n, cap in zip(reserved, caps, strict=True))
        # Whatever the reservations hold, a request of the least class may take the rest.
        total = queue.num_free_blocks
        queue.reserve(0)
        assert queue.num_free_blocks >= total - sum(caps)
        queue.unreserve()


def test_reserved_blocks_are_counted_as_they_leave_and_a_lower_cap_retains_the_oldest():
    """What the payback tuner reads: blocks leaving each RESERVED segment, and of those the
    ones a next turn reused (a prefix hit, `remove`), not the ones demoted or taken."""
    blocks, queue, holders = _leased_queue(caps=(4, 6))
    queue.popleft_n(N)
    _free_as(queue, blocks, holders["premium"], [5, 6, 7, 8, 9])
    queue.remove(blocks[9])  # the session's next turn reuses one block
    queue.set_caps([4, 2])  # premium's cap shrinks: its two newest blocks stay reserved
    queue.check()
    assert queue.reserved_sizes() == [0, 2]
    assert [b.block_id for b in queue.get_all_free_blocks()] == [5, 6, 7, 8]
    assert holders["premium"].reserved == 2 and holders["premium"].leased == 4
    _free_as(queue, blocks, holders["premium"], [10])  # at the new cap: the oldest goes
    assert queue.reserved_sizes() == [0, 2]
    assert (queue.reserved_left, queue.reserved_reused) == ([0, 4], [0, 1])
    queue.check()


def test_a_closed_reservation_window_leaves_blocks_to_anyone_but_after_every_cached_one():
    blocks, queue, holders = _leased_queue()
    queue.popleft_n(N)
    _free_as(queue, blocks, None, [0, 1])
    _free_as(queue, blocks, holders["premium"], [2, 3, 4])
    queue.reserve(0)
    assert queue.num_free_blocks == 2  # reserved: a free-tier request sees only 0 and 1
    queue.unreserve()
    assert queue.retain(holders["premium"]) == 3
    assert (holders["premium"].leased, holders["premium"].reserved) == (3, 0)
    queue.check()
    queue.reserve(0)
    assert queue.num_free_blocks == 5  # retained: any request may take them ...
    assert [b.block_id for b in queue.popleft_n(5)] == [0, 1, 2, 3, 4]  # ... after CACHED
    queue.unreserve()
    assert holders["premium"].evicted_leased == 3
    # A holder whose window is closed frees its next blocks as RETAINED, not RESERVED.
    _free_as(queue, blocks, holders["premium"], [0, 1])
    assert (holders["premium"].leased, holders["premium"].reserved) == (2, 0)
    queue.check()


def test_retained_blocks_of_a_lower_tier_go_before_those_of_a_higher_one():
    blocks, queue, holders = _leased_queue()
    queue.popleft_n(N)
    for name in ("premium", "standard"):
        holders[name].reserving = False
    _free_as(queue, blocks, holders["premium"], [0, 1])
    _free_as(queue, blocks, holders["standard"], [2, 3])
    _free_as(queue, blocks, None, [4])
    queue.check()
    assert [b.block_id for b in queue.popleft_n(5)] == [4, 2, 3, 0, 1]

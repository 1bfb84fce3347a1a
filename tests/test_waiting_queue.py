from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.core.sched.request_queue import FCFSRequestQueue

from kvlease.engine.waiting_queue import TenantWaitingQueue


class Req:
    def __init__(self, name: str, rank: int) -> None:
        self.name, self.rank = name, rank

    def __repr__(self) -> str:
        return self.name


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "pop", "prepend", "prepend_many", "remove", "remove_many"]),
        st.integers(0, 3),
        st.integers(0, 1000),
    ),
    max_size=60,
)


@given(ops=ops)
def test_with_one_rank_it_behaves_exactly_like_vllms_fcfs_queue(ops):
    ours, stock = TenantWaitingQueue(lambda r: 0, 1), FCFSRequestQueue()
    made = 0
    for op, _, pick in ops:
        present = list(stock)
        if op == "add" or (op in ("prepend", "prepend_many") and True):
            new = [Req(f"r{made + i}", 0) for i in range(1 if op != "prepend_many" else 3)]
            made += len(new)
            if op == "add":
                ours.add_request(new[0])
                stock.add_request(new[0])
            elif op == "prepend":
                ours.prepend_request(new[0])
                stock.prepend_request(new[0])
            else:
                ours.prepend_requests(new)
                stock.prepend_requests(new)
        elif op == "pop" and present:
            assert ours.pop_request() is stock.pop_request()
        elif op == "remove" and present:
            victim = present[pick % len(present)]
            ours.remove_request(victim)
            stock.remove_request(victim)
        elif op == "remove_many" and present:
            victims = present[pick % len(present) :: 2]
            ours.remove_requests(victims)
            stock.remove_requests(victims)
        assert list(ours) == list(stock)
        assert len(ours) == len(stock) and bool(ours) == bool(stock)
        if stock:
            assert ours.peek_request() is stock.peek_request()


@given(ranks=st.lists(st.integers(0, 3), max_size=40))
def test_pops_in_rank_order_and_fifo_within_a_rank(ranks):
    queue = TenantWaitingQueue(lambda r: r.rank, 4)
    reqs = [Req(f"r{i}", rank) for i, rank in enumerate(ranks)]
    for r in reqs:
        queue.add_request(r)
    popped = [queue.pop_request() for _ in range(len(reqs))]
    assert popped == sorted(reqs, key=lambda r: r.rank)  # sorted() is stable: FIFO per rank
    assert not queue


def test_a_preempted_free_request_never_jumps_ahead_of_a_waiting_premium_one():
    queue = TenantWaitingQueue(lambda r: r.rank, 4)
    premium, free = Req("premium", 0), Req("free-preempted", 2)
    queue.add_request(premium)
    queue.prepend_request(free)
    assert queue.pop_request() is premium
    assert queue.bucket_sizes() == [0, 0, 1, 0]

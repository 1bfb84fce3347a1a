import pytest
from clocks import ManualClock

from kvlease.engine.leases import LeaseBook


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def book(clock):
    return LeaseBook(clock=clock)


def test_lease_starts_with_the_first_request_and_renews_with_the_next(book):
    assert book.request_started("s", 60).kind == "start"
    assert book.request_started("s", 60).kind == "renew"
    assert book.active("s")


def test_lease_lasts_exactly_lease_seconds_after_the_last_request_finishes(book, clock):
    book.request_started("s", 60)
    book.request_started("s", 60)
    clock.now = 1010.0
    assert book.request_finished("s") is None  # one still in flight
    clock.now = 1020.0
    change = book.request_finished("s")
    assert (change.kind, change.expires_at) == ("renew", 1080.0)
    clock.now = 1079.999
    assert book.active("s") and book.expire() == []
    assert book.seconds_left("s") == pytest.approx(0.001)
    clock.now = 1080.0
    assert not book.active("s")
    [expired] = book.expire()
    assert (expired.session, expired.kind, expired.expires_at) == ("s", "expire", 1080.0)
    assert book.sessions() == []


def test_in_flight_session_never_expires(book, clock):
    book.request_started("s", 1)
    clock.now += 10_000
    assert book.active("s") and book.expire() == []
    assert book.seconds_left("s") == float("inf")


def test_a_new_request_before_expiry_renews_and_the_old_deadline_is_ignored(book, clock):
    book.request_started("s", 60)
    book.request_finished("s")  # expires at 1060
    clock.now = 1050.0
    assert book.request_started("s", 60).kind == "renew"
    clock.now = 1055.0
    book.request_finished("s")  # now expires at 1115
    clock.now = 1070.0
    assert book.expire() == [] and book.active("s")
    clock.now = 1115.0
    assert [c.expires_at for c in book.expire()] == [1115.0]


def test_tiers_without_a_lease_hold_none(book):
    assert book.request_started("free", 0) is None
    assert book.request_finished("free") is None
    assert not book.active("free") and book.seconds_left("free") is None


def test_many_sessions_expire_in_deadline_order(book, clock):
    for i, seconds in enumerate([30, 10, 20]):
        book.request_started(f"s{i}", seconds)
        book.request_finished(f"s{i}")
    clock.now += 25
    assert [c.session for c in book.expire()] == ["s1", "s2"]
    clock.now += 5
    assert [c.session for c in book.expire()] == ["s0"]

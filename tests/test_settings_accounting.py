import pytest

from kvlease.engine.accounting import AccountingError, TenantAccounting
from kvlease.engine.events import EVENT_CAPACITY, TenantHolding
from kvlease.engine.policy import VictimRule
from kvlease.engine.settings import FAIR_SLACK, SchedulerSettings, SettingsError


def test_defaults():
    s = SchedulerSettings.load({}, env={})
    assert (s.victim_rule, s.debug_accounting, s.sample_seconds) == (
        VictimRule.LEAST_WORK,
        False,
        0.25,
    )
    assert list(s.tiers) == ["premium", "standard", "free"]


def test_additional_config_wins_over_environment():
    s = SchedulerSettings.load(
        {"kvlease": {"victim_rule": "lru", "debug_accounting": True}},
        env={"KVLEASE_VICTIM_RULE": "least_work", "KVLEASE_SAMPLE_SECONDS": "2"},
    )
    assert s.victim_rule is VictimRule.LRU and s.debug_accounting
    assert s.sample_seconds == 2.0
    assert s.reserve is None  # each tier's own `reserve`
    assert SchedulerSettings.load({}, env={"KVLEASE_RESERVE": "never"}).reserve == "never"
    assert SchedulerSettings.load({}, env={}).fair_slack == FAIR_SLACK
    assert SchedulerSettings.load({}, env={"KVLEASE_FAIR_SLACK": "0"}).fair_slack == 0.0


def test_every_mechanism_is_on_unless_turned_off_for_an_ablation():
    switches = ("lease_order", "admission_preemption", "class_service", "reserve_payback")
    on = SchedulerSettings.load({}, env={})
    assert [getattr(on, key) for key in switches] == [True] * 4
    off = SchedulerSettings.load(
        {"kvlease": {"lease_order": False}},
        env={
            "KVLEASE_ADMISSION_PREEMPTION": "0",
            "KVLEASE_CLASS_SERVICE": "off",
            "KVLEASE_RESERVE_PAYBACK": "no",
        },
    )
    assert [getattr(off, key) for key in switches] == [False] * 4


def test_events_are_kept_only_where_something_reads_them():
    """A channel to kvlease's API process reads them; a plain `vllm serve
    --scheduler-cls` has none, and an in-process reader sets `event_capacity`."""
    default = SchedulerSettings.load({}, env={})
    assert (default.events_kept(published=True), default.events_kept(published=False)) == (
        EVENT_CAPACITY,
        0,
    )
    for given in (0, 3):
        s = SchedulerSettings.load({}, env={"KVLEASE_EVENT_CAPACITY": str(given)})
        assert (s.events_kept(published=True), s.events_kept(published=False)) == (given, given)


@pytest.mark.parametrize(
    ("additional", "env", "message"),
    [
        ({"kvlease": {"victim": "lru"}}, {}, "unknown key 'victim'"),
        ({}, {"KVLEASE_VICTIM_RULE": "random"}, "KVLEASE_VICTIM_RULE must be 'lru' or"),
        ({"kvlease": {"sample_seconds": 0}}, {}, "sample_seconds must be > 0"),
        ({}, {"KVLEASE_FAIR_SLACK": "-1"}, "KVLEASE_FAIR_SLACK must be >= 0"),
        ({}, {"KVLEASE_EVENT_CAPACITY": "lots"}, "KVLEASE_EVENT_CAPACITY must be a number"),
        ({}, {"KVLEASE_EVENT_CAPACITY": "-1"}, "KVLEASE_EVENT_CAPACITY must be >= 0"),
        ({}, {"KVLEASE_RESERVE": "always"}, "KVLEASE_RESERVE must be one of 'auto'"),
        ({}, {"KVLEASE_CLASS_SERVICE": "maybe"}, "KVLEASE_CLASS_SERVICE must be true or false"),
    ],
)
def test_bad_settings_name_the_setting(additional, env, message):
    with pytest.raises(SettingsError, match=message):
        SchedulerSettings.load(additional, env=env)


def test_block_seconds_integrate_billable_blocks_between_samples():
    acc = TenantAccounting()
    held = {"a": TenantHolding(running=2, cached_leased=1, cached=5)}
    acc.sample(10.0, 9, 7, 2, held, {"r1": 2}, check=True)
    acc.sample(12.5, 9, 7, 2, held, {"r1": 2}, check=True)
    assert acc.block_seconds["a"] == pytest.approx(2.5 * 3)
    assert acc.request_done("r1") == pytest.approx(2.5 * 2)
    assert acc.request_done("r1") == 0.0


def test_unbalanced_books_raise():
    with pytest.raises(AccountingError, match="3 referenced \\+ 6 free != 10"):
        TenantAccounting().sample(0.0, 10, 6, 3, {}, {}, check=True)


def test_a_leased_next_turn_counts_what_the_cache_served_as_reused_and_the_rest_as_lost():
    acc = TenantAccounting()
    acc.count_lease_reuse("premium", covered=160, cached=160, reserved=True)
    acc.count_lease_reuse("premium", covered=160, cached=96, reserved=True)
    acc.count_lease_reuse("premium", covered=96, cached=32, reserved=False)  # after its window
    # never scheduled: nothing served; then a hit beyond the lease's part
    acc.count_lease_reuse("standard", covered=64, cached=-1, reserved=True)
    acc.count_lease_reuse("standard", covered=64, cached=300, reserved=True)
    assert dict(acc.lease_reuse_tokens) == {
        ("premium", "reused", True): 256,
        ("premium", "lost", True): 64,
        ("premium", "reused", False): 32,
        ("premium", "lost", False): 64,
        ("standard", "reused", True): 64,
        ("standard", "lost", True): 64,
    }

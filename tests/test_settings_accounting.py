import pytest

from engine.accounting import AccountingError, TenantAccounting
from engine.events import TenantHolding
from engine.policy import VictimRule
from engine.settings import SchedulerSettings, SettingsError


def test_defaults():
    s = SchedulerSettings.load({}, env={})
    assert (s.victim_rule, s.debug_accounting, s.sample_seconds) == (VictimRule.LRU, False, 0.25)
    assert list(s.tiers) == ["premium", "standard", "free"]


def test_additional_config_wins_over_environment():
    s = SchedulerSettings.load(
        {"kvlease": {"victim_rule": "least_work", "debug_accounting": True}},
        env={"KVLEASE_VICTIM_RULE": "lru", "KVLEASE_SAMPLE_SECONDS": "2"},
    )
    assert s.victim_rule is VictimRule.LEAST_WORK and s.debug_accounting
    assert s.sample_seconds == 2.0


@pytest.mark.parametrize(
    ("additional", "env", "message"),
    [
        ({"kvlease": {"victim": "lru"}}, {}, "unknown key 'victim'"),
        ({}, {"KVLEASE_VICTIM_RULE": "random"}, "KVLEASE_VICTIM_RULE must be 'lru' or"),
        ({"kvlease": {"sample_seconds": 0}}, {}, "sample_seconds must be > 0"),
        ({}, {"KVLEASE_EVENT_CAPACITY": "lots"}, "KVLEASE_EVENT_CAPACITY must be a number"),
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

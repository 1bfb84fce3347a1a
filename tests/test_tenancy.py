from decimal import Decimal

import pytest

from kvlease.engine.tenancy import TenantContext, TierConfigError, TierTable

VALID = """
currency = "EUR"
[tiers.gold]
priority = 0
lease_seconds = 120
leased_cache_cap = 0.4
[tiers.gold.prices]
input_per_1k = "0.002"
cached_input_per_1k = "0.001"
output_per_1k = 0.004
block_hour = "0.01"
[tiers.bronze]
priority = 5
lease_seconds = 0
leased_cache_cap = 0
[tiers.bronze.prices]
input_per_1k = 0
cached_input_per_1k = 0
output_per_1k = 0
block_hour = 0
"""


def test_shipped_default_has_three_tiers_in_priority_order(tiers):
    assert list(tiers) == ["premium", "standard", "free"]
    assert [tiers[n].priority for n in tiers] == [0, 1, 2]
    assert [tiers[n].lease_seconds for n in tiers] == [300, 60, 0]
    assert tiers.currency == "USD"
    assert tiers["premium"].prices.output_per_1k == Decimal("0.0060")
    assert [tiers[n].max_concurrent_requests for n in tiers] == [64, 32, 8]


def test_a_tier_reserves_while_its_sessions_are_likely_back_unless_told_otherwise(tmp_path):
    from kvlease.engine.reservations import ReserveMode, ReservePolicy

    assert TierTable.load()["premium"].reservation == ReservePolicy()  # auto, 0.9, 60 s, 0.5
    path = tmp_path / "tiers.toml"
    path.write_text(VALID.replace("priority = 5", "priority = 5\nreserve = 'lease'"))
    assert TierTable.load(path)["bronze"].reservation.mode is ReserveMode.LEASE


def test_only_premium_preempts_to_be_admitted_in_the_shipped_table_and_every_tier_by_default():
    assert [t.preempt_to_admit for t in TierTable.load().values()] == [True, False, False]
    assert all(t.preempt_to_admit for t in TierTable.from_toml(VALID).values())


def test_concurrency_cap_is_optional():
    assert TierTable.from_toml(VALID)["gold"].max_concurrent_requests is None


def test_prices_are_exact_decimals_even_when_written_as_floats():
    table = TierTable.from_toml(VALID)
    assert table["gold"].prices.output_per_1k == Decimal("0.004")
    assert isinstance(table["gold"].prices.block_hour, Decimal)


def test_kv_retention_prices_default_to_the_block_hour_reserved_and_nothing_retained():
    from kvlease.engine.tenancy import Prices

    table = TierTable.from_toml(VALID)
    gold = table["gold"].prices
    assert (gold.reserved_block_hour, gold.retained_block_hour) == (Decimal("0.01"), 0)
    priced = TierTable.from_toml(
        VALID.replace('block_hour = "0.01"', 'block_hour = "0.01"\nretained_block_hour = "0.002"')
    )["gold"].prices
    assert priced.retained_block_hour == Decimal("0.002")
    assert Prices.from_basis(priced.basis("EUR")) == ("EUR", priced)  # six prices kept
    old = '{"block_hour": "0.01", "cached_input_per_1k": "0.1", "currency": "USD", '
    old += '"input_per_1k": "0.5", "output_per_1k": "1.5"}'  # written before retention
    _, prices = Prices.from_basis(old)
    assert (prices.reserved_block_hour, prices.retained_block_hour) == (Decimal("0.01"), 0)
    shipped = TierTable.load()
    assert [shipped[t].prices.retained_block_hour for t in shipped] == [
        Decimal("0.0020"),
        Decimal("0.0010"),
        0,
    ]
    with pytest.raises(TierConfigError, match="reserved_block_hour"):
        TierTable.from_toml(
            VALID.replace('block_hour = "0.01"', 'block_hour = "0.01"\nreserved_block_hour = "-1"')
        )


def test_load_prefers_explicit_path_over_environment(tmp_path, monkeypatch):
    explicit = tmp_path / "explicit.toml"
    explicit.write_text(VALID)
    env_file = tmp_path / "env.toml"
    env_file.write_text(VALID.replace('"EUR"', '"GBP"'))
    monkeypatch.setenv("KVLEASE_TIERS", str(env_file))
    assert TierTable.load().currency == "GBP"
    assert TierTable.load(explicit).currency == "EUR"
    assert list(TierTable.load(explicit)) == ["gold", "bronze"]


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(TierConfigError, match=r"nope\.toml: cannot read tier table"):
        TierTable.load(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: "colour = 'red'\n" + s, "unknown key 'colour' in top level"),
        (
            lambda s: s.replace("lease_seconds = 120", "lease_seconds = 120\nburst = 3"),
            "unknown key 'burst' in tier 'gold'",
        ),
        (
            lambda s: s.replace('block_hour = "0.01"', 'block_hour = "0.01"\nper_image = 1'),
            "unknown key 'per_image' in tier 'gold' prices",
        ),
        (
            lambda s: s.replace("lease_seconds = 120", "lease_seconds = -1"),
            "'lease_seconds' must be >= 0",
        ),
        (
            lambda s: s.replace("priority = 5", "priority = 0"),
            "duplicate priority 0: tiers 'gold' and 'bronze'",
        ),
        (
            lambda s: s.replace("output_per_1k = 0.004\n", ""),
            "tier 'gold': missing price 'output_per_1k'",
        ),
        (lambda s: s.replace("leased_cache_cap = 0.4", ""), "tier 'gold': missing key"),
        (
            lambda s: s.replace("leased_cache_cap = 0.4", "leased_cache_cap = 1.5"),
            "fraction of the pool",
        ),
        (lambda s: s.replace("priority = 0", "priority = true"), "non-negative integer"),
        (lambda s: s.replace("priority = 0", "priority = -1"), "non-negative integer"),
        (lambda s: s.replace('"0.002"', '"cheap"'), "not a decimal"),
        (lambda s: s.replace('"0.002"', '"-0.002"'), "must be a finite amount from 0"),
        (lambda s: s.replace('"0.002"', '"NaN"'), "must be a finite amount from 0"),
        (lambda s: s.replace('"0.002"', '"sNaN"'), "must be a finite amount from 0"),
        (lambda s: s.replace('"0.002"', '"1E+999999"'), "must be a finite amount from 0"),
        (lambda s: s.replace('"0.002"', '"1E-40"'), "at most 12 decimal places"),
        (lambda s: s.replace('"EUR"', '"euro"'), "three-letter ISO 4217"),
        (
            lambda s: s.replace("[tiers.gold]", "[tiers.Gold]").replace(
                "[tiers.gold.prices]", "[tiers.Gold.prices]"
            ),
            "name must match",
        ),
        (lambda s: s.replace("[tiers.gold]", "[tiers.gold"), "not valid TOML"),
        (lambda s: 'currency = "EUR"\n', "'tiers' must be a table"),
        (
            lambda s: s.replace("priority = 5", "priority = 5\nmax_concurrent_requests = 0"),
            "'max_concurrent_requests' must be an integer >= 1",
        ),
        (
            lambda s: s.replace("priority = 5", "priority = 5\nweight = 2\nmax_weight = 1"),
            "<= 'weight' <= 'max_weight'",
        ),
        (lambda s: s.replace("priority = 5", "priority = 5\nweight = 0"), "<= 'weight'"),
        (lambda s: s.replace("priority = 5", "priority = 5\nweight = nan"), "finite number"),
        (lambda s: s.replace("priority = 5", "priority = 5\nweight = 1e-320"), "<= 'weight'"),
        (
            lambda s: s.replace("priority = 5", "priority = 5\nmax_tenant_kv_share = 0"),
            "'max_tenant_kv_share' is a fraction of the pool",
        ),
        (
            lambda s: s.replace("priority = 5", "priority = 5\nreserve = 'always'"),
            "'reserve' must be one of 'auto', 'lease', 'never'",
        ),
        (
            lambda s: s.replace("priority = 5", "priority = 5\nreserve_quantile = 0"),
            "need 0 < 'reserve_quantile' <= 1",
        ),
        (
            lambda s: s.replace("priority = 5", "priority = 5\nreserve_max_seconds = -1"),
            "'reserve_max_seconds' >= 0",
        ),
        (
            lambda s: s.replace("priority = 5", "priority = 5\nreserve_min_return = 2"),
            "0 <= 'reserve_min_return' <= 1",
        ),
        (
            lambda s: s.replace("priority = 5", "priority = 5\npreempt_to_admit = 1"),
            "'preempt_to_admit' must be true or false",
        ),
        (
            lambda s: s.replace("priority = 5", "priority = 5\nreserve_min_payback = -1"),
            "'reserve_min_payback' >= 0",
        ),
    ],
)
def test_invalid_tier_files_fail_with_a_precise_message(tmp_path, edit, message):
    path = tmp_path / "tiers.toml"
    path.write_text(edit(VALID))
    with pytest.raises(TierConfigError) as err:
        TierTable.load(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_tenant_context_extra_args_is_the_scheduler_contract():
    assert TenantContext("acme", "premium").extra_args() == {"tenant_id": "acme", "tier": "premium"}
    ctx = TenantContext("acme", "free", frozenset({"admin"}), "s-1")
    assert ctx.extra_args() == {"tenant_id": "acme", "tier": "free", "session_id": "s-1"}


def test_a_token_weight_is_bounded_by_the_tier_table():
    tier = TierTable.from_toml(
        VALID.replace("priority = 5", "priority = 5\nweight = 1.5\nmax_weight = 4")
    )["bronze"]
    assert (tier.weight, tier.max_weight, tier.max_tenant_kv_share) == (1.5, 4.0, 1.0)
    assert tier.tenant_weight(None) == 1.5  # no claim: the tier's default
    assert tier.tenant_weight(3) == 3.0
    assert tier.tenant_weight(100) == 4.0  # a plain vLLM caller cannot buy more than the cap
    assert tier.tenant_weight("lots") == tier.tenant_weight(-1) == tier.tenant_weight(True) == 1.5
    # A claim that would make the tenant's counter NaN or infinite: the tier's default.
    for claim in (float("nan"), float("inf"), 1e-320, 0.0):
        assert tier.tenant_weight(claim) == 1.5
    ctx = TenantContext("acme", "bronze", weight=3.0)
    assert ctx.extra_args() == {"tenant_id": "acme", "tier": "bronze", "weight": 3.0}

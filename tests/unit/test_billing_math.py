"""The billing arithmetic (common/billing.py) against a direct computation: storage GB-hours per hour,
checkpoint counts, the window's rules, the price table and the costs of gateway events."""

import random

import pytest

from temper.common import billing
from temper.common.billing import HOUR_MS, Stored
from temper.common.errors import InvalidArgument
from temper.services.gateway.routes_billing import usage_event
from temper.v1 import service_pb2

T0 = 1_765_000_800_000 - 1_765_000_800_000 % HOUR_MS  # an hour boundary


def direct_gbh(stored, from_ms, to_ms):
    """Millisecond by millisecond would be exact but slow: second by second over whole seconds."""
    out = {}
    for s in stored:
        for sec in range(from_ms // 1000, to_ms // 1000):
            at = sec * 1000
            if s.created_ms <= at < s.end_ms and s.size_bytes > 0:
                hour = at - (at - from_ms) % HOUR_MS
                out[(hour, s.base_model)] = out.get((hour, s.base_model), 0.0) + s.size_bytes / 1e9 / 3600
    return out


def test_storage_gigabyte_hours_matches_a_second_by_second_sum():
    rng = random.Random(3)
    stored = []
    for _ in range(6):
        created = T0 + rng.randrange(-2 * 3600, 4 * 3600) * 1000
        stored.append(Stored(rng.randrange(1, 5_000_000_000), rng.choice(["a", "b"]), created,
                             created + rng.randrange(1, 5 * 3600) * 1000))
    from_ms, to_ms = T0, T0 + 4 * HOUR_MS
    got, want = billing.storage_gigabyte_hours(stored, from_ms, to_ms), direct_gbh(stored, from_ms, to_ms)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9)
    # a checkpoint alive for the whole window: its GB times the window's hours, one hour at a time
    whole = billing.storage_gigabyte_hours([Stored(2_000_000_000, "m", T0 - 1, T0 + 10 * HOUR_MS)], T0, T0 + 3 * HOUR_MS)
    assert whole == {(T0 + h * HOUR_MS, "m"): pytest.approx(2.0) for h in range(3)}


def test_hour_counts_count_only_the_window():
    got = billing.hour_counts([(T0, "a"), (T0 + HOUR_MS - 1, "a"), (T0 + HOUR_MS, "a"), (T0 - 1, "a"), (T0 + 5, "b")],
                              T0, T0 + 2 * HOUR_MS)
    assert got == {(T0, "a"): 2, (T0 + HOUR_MS, "a"): 1, (T0, "b"): 1}


@pytest.mark.parametrize("from_ms,to_ms", [(T0 + 1, T0 + HOUR_MS), (T0, T0 + HOUR_MS + 5), (T0, T0), (T0 + HOUR_MS, T0),
                                           (T0, T0 + 15 * 24 * HOUR_MS), (T0 + 48 * HOUR_MS, T0 + 49 * HOUR_MS)])
def test_bad_windows_are_refused(from_ms, to_ms):
    with pytest.raises(InvalidArgument):
        billing.check_window(from_ms, to_ms, now_ms=T0 + 24 * HOUR_MS)


def test_a_good_window_passes():
    billing.check_window(T0, T0 + 14 * 24 * HOUR_MS, now_ms=T0)


def test_price_table_parses_and_refuses_what_it_cannot_bill_by():
    table = billing.parse_price_table('{"m": {"train_per_mtok": 3, "sample_per_mtok": 1.5, "prefill_per_mtok": 0.5,'
                                      ' "storage_per_gb_month": 0.02}}')
    assert table["m"].cached_prefill_per_mtok == 0.5  # defaults to the prefill rate
    assert billing.parse_price_table("") == {} and billing.parse_price_table(None) == {}
    for bad in ('[1]', '{"m": 3}', '{"m": {"train": 3}}', '{"m": {"train_per_mtok": -1}}', '{"m": {"train_per_mtok": "3"}}',
                '{"m": {"train_per_mtok": true}}', 'not json'):
        with pytest.raises(ValueError):
            billing.parse_price_table(bad)


def test_event_costs_are_quantity_times_rate():
    prices = billing.parse_price_table('{"m": {"train_per_mtok": 3, "sample_per_mtok": 1.5, "prefill_per_mtok": 0.5,'
                                       ' "storage_per_gb_month": 0.02}, "half": {"train_per_mtok": 2}}')
    bucket = service_pb2.BillingBucket
    cases = [(bucket(kind="training", base_model="m", token_count=1234), 3 * 1234 / 1e6),
             (bucket(kind="sampling_sample", base_model="m", token_count=77), 1.5 * 77 / 1e6),
             (bucket(kind="sampling_prefill", base_model="m", token_count=900), 0.5 * 900 / 1e6),
             (bucket(kind="storage", base_model="m", gigabyte_hours=3.6), 0.02 * 3.6 / 720),
             (bucket(kind="checkpoint", base_model="m", count=2), None),
             (bucket(kind="sampling_sample", base_model="half", token_count=5), None),  # no sample rate for it
             (bucket(kind="training", base_model="unlisted", token_count=5), None)]
    for b, cost in cases:
        event = usage_event(b, prices)
        assert event["estimated_cost_usd"] == (None if cost is None else pytest.approx(cost)), b
        assert event["event_info"]["type"] == b.kind
    assert usage_event(cases[0][0], prices)["effective_rate_usd_per_million_tokens"] == 3
    assert usage_event(cases[3][0], prices)["effective_rate_usd_per_gigabyte_month"] == 0.02


def test_cookbook_pricing_is_read_by_the_cookbook():
    cost_estimation = pytest.importorskip("tinker_cookbook.utils.cost_estimation")
    table = billing.parse_price_table('{"m": {"train_per_mtok": 3, "sample_per_mtok": 1.5, "prefill_per_mtok": 0.5}}')
    rates = cost_estimation.rates_from_pricing_entry(billing.cookbook_pricing(table)[0])
    assert (rates.train_usd_per_million, rates.sample_usd_per_million, rates.prefill_usd_per_million,
            rates.cached_prefill_usd_per_million) == (3, 1.5, 0.5, 0.5)

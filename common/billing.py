"""Billing arithmetic shared by the scheduler and the gateway (issue 33: the SDK's get_billing_usage):
the query window's rules, storage in GB-hours per UTC hour, and the operator's price table.

Pure functions over plain values, so the sums and prices are checked without a stack
(tests/unit/test_billing_math.py). Quantities are the SDK's: tokens per kind, checkpoint counts,
storage in gigabyte-hours (1 GB = 1e9 bytes); a cost is ``rate_per_million * tokens / 1e6`` for
tokens and ``rate_per_gb_month * gigabyte_hours / 720`` for storage, as BillingUsageEvent documents.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple

from temper.common.errors import InvalidArgument

HOUR_MS = 3_600_000
MAX_WINDOW_MS = 14 * 24 * HOUR_MS  # the SDK's limit: ending_before at most 14 days after starting_on
HOURS_PER_MONTH = 720              # one GB-month is 720 GB-hours (BillingUsageEvent)
TOKEN_KINDS = ("training", "sampling_prefill", "sampling_sample")
KINDS = TOKEN_KINDS + ("checkpoint", "storage")


def check_window(from_ms: int, to_ms: int, now_ms: int) -> None:
    """The SDK's rules for [starting_on, ending_before): hour-aligned, start not in the future, end
    after start and at most 14 days after it. InvalidArgument (400) otherwise."""
    if from_ms % HOUR_MS or to_ms % HOUR_MS:
        raise InvalidArgument("starting_on and ending_before must be on a UTC hour boundary")
    if from_ms > now_ms:
        raise InvalidArgument("starting_on must not be in the future")
    if to_ms <= from_ms:
        raise InvalidArgument("ending_before must be after starting_on")
    if to_ms - from_ms > MAX_WINDOW_MS:
        raise InvalidArgument("ending_before must be at most 14 days after starting_on")


class Stored(NamedTuple):
    """A checkpoint's life for storage: bytes, base model, [created, end) in unix ms (end: its
    expiry, or now for one that lives on)."""
    size_bytes: int
    base_model: str
    created_ms: int
    end_ms: int


def storage_gigabyte_hours(stored: Iterable[Stored], from_ms: int, to_ms: int) -> dict[tuple[int, str], float]:
    """GB-hours per (hour start, base model) in [from_ms, to_ms): each checkpoint's bytes times the
    part of each hour it existed. Hours with none are absent."""
    out: dict[tuple[int, str], float] = {}
    for s in stored:
        start, end = max(s.created_ms, from_ms), min(s.end_ms, to_ms)
        if end <= start or s.size_bytes <= 0:
            continue
        hour = start - (start - from_ms) % HOUR_MS
        while hour < end:
            overlap = min(end, hour + HOUR_MS) - max(start, hour)
            key = (hour, s.base_model)
            out[key] = out.get(key, 0.0) + s.size_bytes / 1e9 * overlap / HOUR_MS
            hour += HOUR_MS
    return out


def hour_counts(created_ms: Iterable[tuple[int, str]], from_ms: int, to_ms: int) -> dict[tuple[int, str], int]:
    """How many of (created unix ms, base model) fall in each (hour start, base model) of the window."""
    out: dict[tuple[int, str], int] = {}
    for at, base_model in created_ms:
        if from_ms <= at < to_ms:
            key = (at - (at - from_ms) % HOUR_MS, base_model)
            out[key] = out.get(key, 0) + 1
    return out


PRICE_FIELDS = ("train_per_mtok", "sample_per_mtok", "prefill_per_mtok", "cached_prefill_per_mtok", "storage_per_gb_month")


@dataclass(frozen=True)
class ModelPrices:
    """USD rates of one base model. ``cached_prefill_per_mtok`` defaults to the prefill rate (Temper
    reports no prefix-cache hits: every prefill token is billed uncached)."""
    train_per_mtok: float | None = None
    sample_per_mtok: float | None = None
    prefill_per_mtok: float | None = None
    cached_prefill_per_mtok: float | None = None
    storage_per_gb_month: float | None = None

    def token_rate(self, kind: str) -> float | None:
        return {"training": self.train_per_mtok, "sampling_sample": self.sample_per_mtok,
                "sampling_prefill": self.prefill_per_mtok}.get(kind)


def parse_price_table(raw: str | None) -> dict[str, ModelPrices]:
    """The operator's price table: JSON ``{model: {train_per_mtok, sample_per_mtok, prefill_per_mtok,
    storage_per_gb_month, cached_prefill_per_mtok?}}``, each a finite number >= 0 (a missing one:
    that kind is unpriced). Empty or None: no prices. ValueError on anything else, so a mistyped
    table stops the process at start rather than billing wrongly."""
    if not raw or not raw.strip():
        return {}
    table = json.loads(raw)
    if not isinstance(table, dict):
        raise ValueError("the price table must be a JSON object {model: {rate: number}}")
    out = {}
    for model, rates in table.items():
        if not isinstance(rates, dict):
            raise ValueError(f"the price table's entry for {model!r} must be an object")
        unknown = set(rates) - set(PRICE_FIELDS)
        if unknown:
            raise ValueError(f"the price table's entry for {model!r} has unknown fields {sorted(unknown)}; known: {PRICE_FIELDS}")
        for name, value in rates.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{model!r}.{name} must be a finite number >= 0, got {value!r}")
        values = {k: float(v) for k, v in rates.items()}
        values.setdefault("cached_prefill_per_mtok", values.get("prefill_per_mtok"))
        out[model] = ModelPrices(**values)
    return out


class Priced(NamedTuple):
    cost_usd: float | None
    per_million_tokens: float | None
    per_gigabyte_month: float | None


def price(kind: str, quantity: float, prices: ModelPrices | None) -> Priced:
    """The cost of ``quantity`` (tokens, or GB-hours for storage) of ``kind`` and the rate used; all
    None when the table has no rate for it (and for checkpoint counts, which are not priced)."""
    if prices is None:
        return Priced(None, None, None)
    if kind == "storage":
        rate = prices.storage_per_gb_month
        return Priced(None, None, None) if rate is None else Priced(rate * quantity / HOURS_PER_MONTH, None, rate)
    rate = prices.token_rate(kind)
    return Priced(None, None, None) if rate is None else Priced(rate * quantity / 1e6, rate, None)


def cookbook_pricing(table: Mapping[str, ModelPrices]) -> list[dict]:
    """The table as the cookbook's pricing file (``tinker_cookbook.utils.cost_estimation``'s
    models.json: ``{tinker_id, prefill, cached_prefill, sample, train}``, prices as "$1.87"
    strings); a model without all four token rates is listed without them (the cookbook then logs
    token counts only, as it does for an unlisted model)."""
    out = []
    for model, p in sorted(table.items()):
        entry: dict = {"tinker_id": model}
        for name, rate in (("prefill", p.prefill_per_mtok), ("cached_prefill", p.cached_prefill_per_mtok),
                           ("sample", p.sample_per_mtok), ("train", p.train_per_mtok)):
            if rate is not None:
                entry[name] = f"${rate!r}"
        if p.storage_per_gb_month is not None:
            entry["storage_per_gb_month"] = f"${p.storage_per_gb_month!r}"
        out.append(entry)
    return out

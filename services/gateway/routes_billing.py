"""The SDK's billing usage and copy_weights routes (issue 33), and the operator's rate card for the
cookbook.

- ``GET /api/v1/billing/usage/events?starting_on=...&ending_before=...`` (``AdminClient`` /
  ``RestClient.get_billing_usage``): the caller's tenant's usage (GetBillingUsage) as the SDK's
  ``BillingUsageResponse``: one event per UTC hour, base model, session and kind, each priced from
  the operator's price table (``TEMPER_GATEWAY_PRICE_TABLE``; a model or kind without a rate: cost
  None). Both times are RFC 3339, on an hour boundary, the window at most 14 days.
- ``POST /api/v1/copy_weights`` (``RestClient.copy_weights``, ``ServiceClient.copy_weights``):
  ``{source_path, ttl_seconds?, destination_project_id?, session_id?}`` -> ``{tinker_path}``
  (CopyCheckpoint). A resent request (the SDK's ``X-Idempotency-Key``) answers the first copy.
- ``GET /tinker/models.json`` (no key): the price table as the cookbook's pricing file, so
  ``tinker_cookbook.utils.cost_estimation.load_model_pricing(url=<gateway>/tinker/models.json)``
  makes its trainers log ``cost/step_usd`` and ``cost/cumulative_usd`` at the operator's rates.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from fastapi import APIRouter, Request

from temper.common.billing import HOUR_MS, ModelPrices, cookbook_pricing, price
from temper.services.gateway import fields
from temper.services.gateway.app import api_key, gateway, json_body
from temper.services.gateway.errors import invalid
from temper.services.gateway.idempotent import once_per_request
from temper.v1 import records_pb2, service_pb2

router = APIRouter()
MAX_SESSION_LOOKUPS = 200      # sessions whose user_metadata one answer reads (more: None)
COPY_FIELDS = {"source_path", "ttl_seconds", "destination_project_id", "session_id", "model_seq_id", "weights_access_token"}


def price_table(request: Request) -> dict[str, ModelPrices]:
    return getattr(request.app.state, "price_table", {})


def _instant(request: Request, name: str) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        raise invalid(f"{name} is required (RFC 3339, on a UTC hour boundary)")
    try:
        if len(raw) > 40:
            raise ValueError
        at = datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise invalid(f"{name} must be an RFC 3339 time, got {raw[:40]!r}") from None
    if at.tzinfo is None:
        raise invalid(f"{name} must carry a time zone (e.g. Z)")
    return int(at.timestamp() * 1000) if at.microsecond == 0 else -1  # -1: not on an hour boundary


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def usage_event(bucket: service_pb2.BillingBucket, prices: dict[str, ModelPrices]) -> dict:
    """One BillingBucket as the SDK's BillingUsageEvent."""
    kind = bucket.kind
    info: dict = {"type": kind}
    if kind == "storage":
        info.update(free=False, gigabyte_hours=bucket.gigabyte_hours)
        quantity = bucket.gigabyte_hours
    elif kind == "checkpoint":
        info["count"] = bucket.count
        quantity = bucket.count
    else:
        info["token_count"] = bucket.token_count
        quantity = bucket.token_count
        if kind == "sampling_prefill":
            info["cached"] = False  # Temper reports no prefix-cache hits: every prefill token at the full rate
    priced = price(kind, quantity, prices.get(bucket.base_model)) if kind != "checkpoint" else price(kind, 0, None)
    return {"bucket_start": _iso(bucket.bucket_start_unix_ms), "bucket_end": _iso(bucket.bucket_start_unix_ms + HOUR_MS),
            "base_model": bucket.base_model or None, "user_id": None, "user_name": None,
            "session_id": bucket.session_id or None, "project_id": None, "estimated_cost_usd": priced.cost_usd,
            "effective_rate_usd_per_million_tokens": priced.per_million_tokens,
            "effective_rate_usd_per_gigabyte_month": priced.per_gigabyte_month, "event_info": info}


def _quantity(event: dict) -> float:
    info = event["event_info"]
    return info.get("token_count", info.get("gigabyte_hours", info.get("count", 0)))


@router.get("/api/v1/billing/usage/events")
async def billing_usage_events(request: Request):
    key = api_key(request)
    unknown = set(request.query_params) - {"starting_on", "ending_before"}
    if unknown:
        raise invalid(f"unknown query parameters {sorted(unknown)}: billing usage takes starting_on and ending_before")
    start, end = _instant(request, "starting_on"), _instant(request, "ending_before")
    if start < 0 or end < 0:
        raise invalid("starting_on and ending_before must be on a UTC hour boundary")
    scheduler = gateway(request).scheduler
    usage = await scheduler.call("GetBillingUsage", service_pb2.GetBillingUsageRequest(from_unix_ms=start, to_unix_ms=end), key)
    prices = price_table(request)
    events = [usage_event(b, prices) for b in usage.buckets]
    events.sort(key=lambda e: (e["bucket_start"], -_quantity(e)))  # by bucket, then descending quantity (the SDK's order)
    session_ids = sorted({e["session_id"] for e in events if e["session_id"]})
    return {"data": events, "sessions": await _sessions(scheduler, key, session_ids), "cost_data_through": None}


async def _sessions(scheduler, key: str, session_ids: list[str]) -> dict:
    """session_id -> {user_metadata} for the events' sessions (the first MAX_SESSION_LOOKUPS read)."""
    limit = asyncio.Semaphore(8)

    async def one(session_id: str):
        async with limit:
            info = await scheduler.call("GetSession", records_pb2.GetSessionRequest(session_id=session_id), key)
        return session_id, {"user_metadata": dict(info.user_metadata) or None}

    found = dict(await asyncio.gather(*(one(s) for s in session_ids[:MAX_SESSION_LOOKUPS])))
    return {s: found.get(s, {"user_metadata": None}) for s in session_ids}


@router.get("/tinker/models.json", include_in_schema=False)
async def cookbook_models(request: Request):
    return cookbook_pricing(price_table(request))


@router.post("/api/v1/copy_weights")
async def copy_weights(request: Request):
    key, body = api_key(request), await json_body(request)
    unknown = set(body) - COPY_FIELDS
    if unknown:
        raise invalid(f"unknown fields {sorted(unknown)}")
    if body.get("weights_access_token") is not None or request.headers.get("x-tinker-weights-access-token"):
        raise invalid("weights_access_token is not used by Temper: another tenant's checkpoint is copied once it is "
                      "published to you")
    if body.get("model_seq_id") is not None:
        raise invalid("model_seq_id is not taken: Temper puts a copy in a training run of its own; leave it unset")
    message = service_pb2.CopyCheckpointRequest(
        source_path=fields.string(body, "source_path"),
        ttl_seconds=fields.integer(body, "ttl_seconds", lo=1, hi=fields.INT64[1], default=0),  # the scheduler checks its range
        session_id=fields.string(body, "session_id", default=""),
        project_id=fields.string(body, "destination_project_id", default=""))

    async def make():
        return await gateway(request).scheduler.call("CopyCheckpoint", message, key)

    copied = await once_per_request(request, key, message.SerializeToString(), make)
    return {"tinker_path": copied.path}

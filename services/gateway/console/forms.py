"""The console's POST bodies, validated here before any scheduler call (the scheduler checks what the
values mean again: whose checkpoint, a TTL in range). Unknown fields, wrong types and out-of-range
values are 400 with the field named; nothing is coerced (``"true"`` is not a boolean)."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from temper.common.checkpoints import parse_path
from temper.services.gateway.errors import invalid

MAX_TTL_SECONDS = 10 * 365 * 24 * 3600
Form = TypeVar("Form", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CheckpointForm(_Strict):
    path: StrictStr = Field(min_length=1, max_length=1024)

    def checked_path(self) -> str:
        return str(parse_path(self.path))  # tinker://<run>/<weights|sampler_weights>/<name>, else 400


class PublishForm(CheckpointForm):
    published: StrictBool


class TtlForm(CheckpointForm):
    ttl_seconds: StrictInt = Field(ge=0, le=MAX_TTL_SECONDS)  # 0 clears the expiry


class CreateKeyForm(_Strict):
    label: StrictStr = Field(default="", max_length=128)


class RevokeKeyForm(_Strict):
    prefix: StrictStr = Field(min_length=1, max_length=16)


async def read(request: Request, form: type[Form]) -> Form:
    body = await request.body()
    try:
        return form.model_validate_json(body or b"{}")
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise invalid(f"bad form: {problems}") from None

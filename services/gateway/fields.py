"""Typed reads of JSON request fields.

Each getter returns the field's value, or ``default`` when it is absent or null (the SDK leaves
None fields out), or refuses the request with INVALID_ARGUMENT naming the field. Nothing is coerced:
``1.9`` is not an integer, ``true`` is not 1, ``"abc"`` is not a list of tags. Bounds default to the
range of the protobuf field the value goes into, so no protobuf constructor raises later; the
scheduler checks what a value means (a known loss, a positive rank).

``where`` prefixes the field's name in messages (``"sampling_params."``). Messages name fields and
never repeat the value sent.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from temper.common.strings import MAX_ENTRIES, MAX_ID_CHARS, MAX_TEXT_CHARS
from temper.services.gateway.errors import invalid

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
FLOAT32_MAX = 3.4028234663852886e38
REQUIRED: Any = object()  # the default of a field that must be given


def _value(body: Mapping[str, Any], name: str, default, where: str):
    value = body.get(name)
    if value is None and default is REQUIRED:
        raise invalid(f"{where}{name} is required")
    return value


def text(value: Any, label: str, max_len: int = MAX_ID_CHARS) -> str:
    """A string of at most ``max_len`` characters (also for strings read from protobuf)."""
    if not isinstance(value, str):
        raise invalid(f"{label} must be a string")
    if len(value) > max_len:
        raise invalid(f"{label} is {len(value)} characters long (at most {max_len})")
    return value


def string(body: Mapping[str, Any], name: str, max_len: int = MAX_ID_CHARS, default: Any = REQUIRED, where: str = ""):
    value = _value(body, name, default, where)
    return default if value is None else text(value, where + name, max_len)


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(body: Mapping[str, Any], name: str, lo: int = INT64[0], hi: int = INT64[1], default: Any = REQUIRED,
            where: str = ""):
    value = _value(body, name, default, where)
    if value is None:
        return default
    if not is_integer(value) or not lo <= value <= hi:
        raise invalid(f"{where}{name} must be an integer in [{lo}, {hi}]")
    return value


def finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number (an integer is one too), else None."""
    if type(value) not in (int, float):  # not bool
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float
        return None
    return value if math.isfinite(value) else None


def number(body: Mapping[str, Any], name: str, lo: float = -math.inf, hi: float = math.inf, default: Any = REQUIRED,
           where: str = ""):
    value = _value(body, name, default, where)
    if value is None:
        return default
    value = finite(value)
    if value is None or not lo <= value <= hi:
        bounds = f" in [{lo:g}, {hi:g}]" if math.isfinite(lo) or math.isfinite(hi) else ""
        raise invalid(f"{where}{name} must be a finite number{bounds}")
    return value


def boolean(body: Mapping[str, Any], name: str, default: Any = False, where: str = ""):
    value = _value(body, name, default, where)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{where}{name} must be true or false")
    return value


def obj(body: Mapping[str, Any], name: str, default: Any = REQUIRED, where: str = ""):
    value = _value(body, name, default, where)
    if value is None:
        return default
    if not isinstance(value, dict):
        raise invalid(f"{where}{name} must be an object")
    return value


def array(body: Mapping[str, Any], name: str, max_len: int | None = None, default: Any = REQUIRED, where: str = ""):
    value = _value(body, name, default, where)
    if value is None:
        return default
    if not isinstance(value, list):
        raise invalid(f"{where}{name} must be a list")
    if max_len is not None and len(value) > max_len:
        raise invalid(f"{where}{name} has {len(value)} items (at most {max_len})")
    return value


def strings(body: Mapping[str, Any], name: str, max_len: int = MAX_TEXT_CHARS, default: Any = REQUIRED,
            where: str = ""):
    """A list of strings (tags, stop strings)."""
    values = array(body, name, MAX_ENTRIES, default, where)
    if values is default:
        return default
    return [text(v, f"{where}{name}[{i}]", max_len) for i, v in enumerate(values)]


def string_map(body: Mapping[str, Any], name: str, where: str = "") -> dict[str, str]:
    """``user_metadata``: an object whose values are kept as text (the SDK types some as Any)."""
    values = obj(body, name, {}, where)
    if len(values) > MAX_ENTRIES:
        raise invalid(f"{where}{name} has {len(values)} entries (at most {MAX_ENTRIES})")
    return {k: v if isinstance(v, str) else str(v) for k, v in values.items()}


def integers(values: Any, label: str, lo: int = INT64[0], hi: int = INT64[1]) -> list[int]:
    """A list of integers (token ids, shapes, sparse indices); bools and floats are refused."""
    if not isinstance(values, list):
        raise invalid(f"{label} must be a list of integers")
    if not all(is_integer(v) and lo <= v <= hi for v in values):
        raise invalid(f"{label} must hold integers in [{lo}, {hi}]")
    return values


def numbers(values: Any, label: str) -> list[float | int]:
    """A flat list of finite numbers."""
    if not isinstance(values, list):
        raise invalid(f"{label} must be a list of numbers")
    if not all(finite(v) is not None for v in values):
        raise invalid(f"{label} must hold finite numbers only (a flat list)")
    return values

"""Protobuf messages -> the JSON the console's scripts read: field names as in the proto, every
field present (zeros and empty lists too), enums by name, 64-bit integers as JSON numbers (the
console's values, milliseconds, tokens and bytes, stay far below 2**53)."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def view(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if _is_map(field):
            entry = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _scalar(entry, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_scalar(field, v) for v in value]
        elif field.has_presence and _optional(field) and not message.HasField(field.name):
            out[field.name] = None  # proto3 optional left unset (a row without a loss shows none, not 0)
        else:
            out[field.name] = _scalar(field, value)
    return out


def _optional(field: FieldDescriptor) -> bool:
    """A proto3 ``optional`` scalar: it sits alone in a synthetic oneof named after it (upb's
    descriptors say no more), so ``containing_oneof`` is set for it too; real oneofs are left as they were."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return False
    oneof = field.containing_oneof
    return oneof is None or (oneof.name == f"_{field.name}" and len(oneof.fields) == 1)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _scalar(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return view(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name if value in field.enum_type.values_by_number else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return None  # tensors and files are not the console's to show
    return value

"""Checks on the strings of every request, before any of them reaches SQL, a file name or a log:
no NUL or other control characters in identifiers, bounded lengths, and error messages that show
at most a short prefix of what the caller sent."""

from __future__ import annotations

import re

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from temper.common.errors import InvalidArgument, shown  # noqa: F401 (shown: re-exported, defined torch- and protobuf-free)

MAX_ID_CHARS = 256          # ids, paths, names, model names
MAX_TEXT_CHARS = 4096       # free text: tags, metadata values, stop strings
MAX_ENTRIES = 256           # repeated strings and map entries per field
# Fields whose value names something (a row, a file, a model): no control characters at all.
_IDENTIFIER_SUFFIXES = ("_id", "path", "base_model", "name", "status", "loss_fn", "checkpoint_key", "kind_name")


_CONTROL = re.compile("[\x00-\x1f\x7f]")


def check_text(value: str, what: str, identifier: bool) -> None:
    limit = MAX_ID_CHARS if identifier else MAX_TEXT_CHARS
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long (at most {limit})")
    if "\x00" in value:
        raise InvalidArgument(f"{what} contains a NUL character")
    if identifier and _CONTROL.search(value):
        raise InvalidArgument(f"{what} contains control characters: {shown(value)}")


def _repeated(field: FieldDescriptor) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 6 drops .label
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


_STRING, _MAP, _MESSAGE = 0, 1, 2
# message type -> its fields that can hold a string (in field-number order, as ListFields gives them):
# the walk below skips the rest (token bytes, numbers, string-free submessages), which is most of a
# training request. Built once per type.
_PLANS: dict = {}


def _plan(descriptor, planning: frozenset = frozenset()) -> list[tuple]:
    plan = _PLANS.get(descriptor)
    if plan is not None:
        return plan
    plan, planning = [], planning | {descriptor}
    for field in sorted(descriptor.fields, key=lambda f: f.number):
        identifier = field.name.endswith(_IDENTIFIER_SUFFIXES)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_type, value_type = (field.message_type.fields_by_name[n].type for n in ("key", "value"))
            if FieldDescriptor.TYPE_STRING in (key_type, value_type) or value_type == FieldDescriptor.TYPE_MESSAGE:
                plan.append((field.name, _MAP, identifier, True, value_type))
        elif field.type == FieldDescriptor.TYPE_STRING:
            plan.append((field.name, _STRING, identifier, _repeated(field), None))
        elif field.type == FieldDescriptor.TYPE_MESSAGE and (field.message_type in planning  # recursive: kept, to be safe
                                                             or _plan(field.message_type, planning)):
            plan.append((field.name, _MESSAGE, identifier, _repeated(field), None))
    if len(planning) == 1:  # a plan made inside a recursion may have left out what the outer type adds: not kept
        _PLANS[descriptor] = plan
    return plan


def check_request_strings(message: Message, prefix: str = "", only: tuple[str, ...] | None = None) -> None:
    """Every string of ``message`` (nested messages, repeated fields and maps included); with
    ``only``, just those top-level fields."""
    for field_name, kind, identifier, repeated, value_type in _plan(message.DESCRIPTOR):
        if only is not None and field_name not in only:
            continue
        name = f"{prefix}{field_name}"
        if kind == _MAP:
            value = getattr(message, field_name)
            if not value:
                continue
            if len(value) > MAX_ENTRIES:
                raise InvalidArgument(f"{name} has {len(value)} entries (at most {MAX_ENTRIES})")
            for key in value:
                if isinstance(key, str):
                    check_text(key, f"a key of {name}", identifier=True)
                if value_type == FieldDescriptor.TYPE_STRING:
                    check_text(value[key], f"{name}[{shown(str(key), 32)}]", identifier=False)
                elif value_type == FieldDescriptor.TYPE_MESSAGE:
                    check_request_strings(value[key], f"{name}[{shown(str(key), 32)}].")
        elif kind == _STRING:
            value = getattr(message, field_name)
            if not value:
                continue  # unset (or empty: nothing to check)
            values = value if repeated else (value,)
            if len(values) > MAX_ENTRIES:
                raise InvalidArgument(f"{name} has {len(values)} entries (at most {MAX_ENTRIES})")
            for item in values:
                check_text(item, name, identifier)
        elif repeated:
            for i, item in enumerate(getattr(message, field_name)):
                check_request_strings(item, f"{name}[{i}].")
        elif message.HasField(field_name):
            check_request_strings(getattr(message, field_name), f"{name}.")

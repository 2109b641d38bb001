"""Checks on the strings of every request, before any of them reaches SQL, a file name or a log:
no NUL or other control characters in identifiers, bounded lengths, and error messages that show
at most a short prefix of what the caller sent."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from temper.common.errors import InvalidArgument

MAX_ID_CHARS = 256          # ids, paths, names, model names
MAX_TEXT_CHARS = 4096       # free text: tags, metadata values, stop strings
MAX_ENTRIES = 256           # repeated strings and map entries per field
# Fields whose value names something (a row, a file, a model): no control characters at all.
_IDENTIFIER_SUFFIXES = ("_id", "path", "base_model", "name", "status", "loss_fn", "checkpoint_key", "kind_name")


def shown(value: str, limit: int = 64) -> str:
    """``value`` for an error message: repr'd and cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...'" + f" ({len(value)} chars)"


def check_text(value: str, what: str, identifier: bool) -> None:
    limit = MAX_ID_CHARS if identifier else MAX_TEXT_CHARS
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long (at most {limit})")
    if "\x00" in value:
        raise InvalidArgument(f"{what} contains a NUL character")
    if identifier and any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise InvalidArgument(f"{what} contains control characters: {shown(value)}")


def _repeated(field: FieldDescriptor) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 6 drops .label
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def check_request_strings(message: Message, prefix: str = "", only: tuple[str, ...] | None = None) -> None:
    """Every string of ``message`` (nested messages, repeated fields and maps included); with
    ``only``, just those top-level fields."""
    for field, value in message.ListFields():
        if only is not None and field.name not in only:
            continue
        name = f"{prefix}{field.name}"
        identifier = field.name.endswith(_IDENTIFIER_SUFFIXES)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            if len(value) > MAX_ENTRIES:
                raise InvalidArgument(f"{name} has {len(value)} entries (at most {MAX_ENTRIES})")
            value_field = field.message_type.fields_by_name["value"]
            for key in value:
                if isinstance(key, str):
                    check_text(key, f"a key of {name}", identifier=True)
                if value_field.type == FieldDescriptor.TYPE_STRING:
                    check_text(value[key], f"{name}[{shown(str(key), 32)}]", identifier=False)
                elif value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    check_request_strings(value[key], f"{name}[{shown(str(key), 32)}].")
        elif field.type == FieldDescriptor.TYPE_STRING:
            values = value if _repeated(field) else [value]
            if len(values) > MAX_ENTRIES:
                raise InvalidArgument(f"{name} has {len(values)} entries (at most {MAX_ENTRIES})")
            for item in values:
                check_text(item, name, identifier)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            for i, item in enumerate(value if _repeated(field) else [value]):
                check_request_strings(item, f"{name}[{i}]." if _repeated(field) else f"{name}.")

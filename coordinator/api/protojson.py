"""protobuf's JSON mapping of the coordinator's messages, compiled once per message type from its descriptor.

``google.protobuf.json_format`` walks the descriptors in Python on every message (about 12 us to read a
ClaimReplyRequest and 16 us to write its answer), which made the JSON mapping a third of what the HTTP face
costs over gRPC (docs/performance.md#the-httpjson-face-python--m-bench-http). ``ProtoJson`` does the same
mapping from per-type field tables built once, and gives the same results as ``json_format`` with its default
options, which stays the reference:

- ``to_dict`` writes what ``json_format.MessageToDict`` writes (camelCase names, the fields that are set,
  64-bit integers as strings, enums by name, Timestamps in RFC 3339). A type it has no table for (floats,
  maps, well-known types other than Timestamp, closed enums) is written by ``json_format``.
- ``parse`` reads the documents our clients send (camelCase names, values of their canonical JSON type) from
  the tables, and hands anything else to ``json_format.ParseDict``: a snake_case name, an unknown field, a
  null, a number as a string where a number goes, a value of the wrong type, a string with a lone surrogate.
  So every refusal is ``json_format``'s, with its message, and every document is read as ``json_format``
  reads it (tests/unit/test_protojson.py compares the two over every message type of the API).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_TIMESTAMP = "google.protobuf.Timestamp"
# The well-known types json_format maps in their own ways (wrappers, Any, Struct, Duration, ...) all live here:
# those other than Timestamp are left to it.
_WELL_KNOWN = "google.protobuf."
_INT32_TYPES = frozenset((FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_UINT32))
_INT64_TYPES = frozenset((FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64))
_INTEGER = re.compile(r"-?[0-9]+\Z")
_SURROGATE = re.compile("[\ud800-\udfff]")
# json_format refuses messages nested deeper than this; the tables hand deep documents to it.
_MAX_DEPTH = 64


class _Unsupported(Exception):
    """A message type the tables do not cover: json_format handles it."""


class _Fallback(Exception):
    """A document the tables do not read: json_format reads it (and words any refusal)."""


T = TypeVar("T")
Convert = Callable[[Any], Any]
# Reads one JSON value into a field of a message: (message, value, depth); raises _Fallback when unsure.
Read = Callable[[Any, Any, int], None]


class _Tables(dict[Any, "T | None"]):
    """Tables by message descriptor, each built on first use by ``build`` (None: the type is json_format's)."""

    def __init__(self, build: Callable[[Any], T | None]) -> None:
        super().__init__()
        self._build = build

    def __missing__(self, descriptor: Any) -> T | None:
        table = self[descriptor] = self._build(descriptor)
        return table


class ProtoJson:
    """The JSON mapping of messages, by message type; tables are built on first use and kept."""

    def __init__(self) -> None:
        self._writers = _Tables[dict[int, tuple[str, Convert | None]]](self._writer)
        self._readers = _Tables[dict[str, tuple[str | None, Read]]](self._reader)

    # -- writing ---------------------------------------------------------------------------------------

    def to_dict(self, message: Message) -> dict[str, Any]:
        """``json_format.MessageToDict(message)``."""
        table = self._writers[message.DESCRIPTOR]
        if table is None:
            result: dict[str, Any] = json_format.MessageToDict(message)
            return result
        document = {}
        for field, value in message.ListFields():
            name, convert = table[field.number]
            document[name] = value if convert is None else convert(value)
        return document

    def _writer(self, descriptor: Any) -> dict[int, tuple[str, Convert | None]] | None:
        table: dict[int, tuple[str, Convert | None]] | None
        try:
            if descriptor.full_name.startswith(_WELL_KNOWN):
                raise _Unsupported(descriptor.full_name)
            table = {field.number: (field.json_name, self._field_writer(field)) for field in descriptor.fields}
        except _Unsupported:
            table = None
        return table

    def _field_writer(self, field: Any) -> Convert | None:
        convert = self._value_writer(field)
        if not _is_repeated(field):
            return convert
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            raise _Unsupported("map")
        if convert is None:
            return list
        return lambda values: [convert(value) for value in values]

    def _value_writer(self, field: Any) -> Convert | None:
        kind = field.cpp_type
        if kind == FieldDescriptor.CPPTYPE_MESSAGE:
            name = field.message_type.full_name
            if name == _TIMESTAMP:
                return _timestamp_json
            if name.startswith(_WELL_KNOWN):
                return json_format.MessageToDict
            return self.to_dict
        if kind == FieldDescriptor.CPPTYPE_ENUM:
            names = _open_enum_names(field)
            return lambda number: names.get(number, number)
        if kind in _INT64_TYPES:
            return str
        if kind in _INT32_TYPES or kind == FieldDescriptor.CPPTYPE_BOOL:
            return None
        if kind == FieldDescriptor.CPPTYPE_STRING and field.type == FieldDescriptor.TYPE_STRING:
            return None
        raise _Unsupported(field.full_name)  # floats, bytes

    # -- reading ---------------------------------------------------------------------------------------

    def parse(self, document: Any, message: Message) -> None:
        """``json_format.ParseDict(document, message)`` into a new (empty) message, raising what it raises."""
        try:
            self._read(document, message, 0)
        except Exception:  # anything the tables did not expect is json_format's to read or to refuse
            message.Clear()
            json_format.ParseDict(document, message)

    def _read(self, document: Any, message: Message, depth: int) -> None:
        if type(document) is not dict or depth > _MAX_DEPTH:
            raise _Fallback
        table = self._readers[message.DESCRIPTOR]
        if table is None:
            raise _Fallback
        oneofs: set[str] | None = None
        for key, value in document.items():
            entry = table.get(key)
            if entry is None or value is None:
                raise _Fallback
            oneof, read = entry
            if oneof is not None:
                if oneofs is None:
                    oneofs = {oneof}
                elif oneof in oneofs:
                    raise _Fallback
                else:
                    oneofs.add(oneof)
            read(message, value, depth)

    def _reader(self, descriptor: Any) -> dict[str, tuple[str | None, Read]] | None:
        table: dict[str, tuple[str | None, Read]] | None
        keys = {field.json_name for field in descriptor.fields} | {field.name for field in descriptor.fields}
        if descriptor.full_name.startswith(_WELL_KNOWN) or any(oneof.name in keys for oneof in descriptor.oneofs):
            # json_format keeps field and oneof names in one list: a clash is refused in ways left to it.
            table = None
        else:
            # Only the camelCase names: a document naming a field both ways is json_format's to judge.
            table = {
                field.json_name: (
                    field.containing_oneof.name if field.containing_oneof is not None else None,
                    self._field_reader(field),
                )
                for field in descriptor.fields
            }
        return table

    def _field_reader(self, field: Any) -> Read:
        name = field.name
        kind = field.cpp_type
        if kind == FieldDescriptor.CPPTYPE_MESSAGE:
            type_name = field.message_type.full_name
            timestamp = type_name == _TIMESTAMP
            if field.message_type.GetOptions().map_entry or (type_name.startswith(_WELL_KNOWN) and not timestamp):
                return _unreadable
            if _is_repeated(field):
                if timestamp:
                    return _unreadable

                def read_messages(message: Any, values: Any, depth: int) -> None:
                    if type(values) is not list:
                        raise _Fallback
                    container = getattr(message, name)
                    for value in values:
                        self._read(value, container.add(), depth + 1)

                return read_messages

            def read_message(message: Any, value: Any, depth: int) -> None:
                inner = getattr(message, name)
                inner.SetInParent()
                if timestamp:
                    if type(value) is not str:
                        raise _Fallback
                    inner.FromJsonString(value)
                else:
                    self._read(value, inner, depth + 1)

            return read_message
        convert = _scalar_reader(field)
        if _is_repeated(field):

            def read_values(message: Any, values: Any, depth: int) -> None:
                if type(values) is not list:
                    raise _Fallback
                getattr(message, name).extend([convert(value) for value in values])

            return read_values

        def read_value(message: Any, value: Any, depth: int) -> None:
            setattr(message, name, convert(value))

        return read_value


def _is_repeated(field: Any) -> bool:
    return bool(field.is_repeated)


def _timestamp_json(value: Any) -> str:
    text: str = value.ToJsonString()
    return text


def _open_enum_names(field: Any) -> dict[int, str]:
    enum = field.enum_type
    if enum.is_closed or enum.full_name == "google.protobuf.NullValue" or any(v.has_options for v in enum.values):
        raise _Unsupported(enum.full_name)  # refusals of unknown numbers, JSON null, custom JSON names
    return {value.number: value.name for value in enum.values}


def _unreadable(message: Any, value: Any, depth: int) -> None:
    raise _Fallback


def _scalar_reader(field: Any) -> Convert:
    """A value's field value when it has its canonical JSON type, else _Fallback (a setattr then checks ranges)."""
    kind = field.cpp_type
    if kind in _INT32_TYPES or kind in _INT64_TYPES:

        def integer(value: Any) -> int:
            if type(value) is int:
                return value
            if type(value) is str and _INTEGER.match(value):
                return int(value)
            raise _Fallback

        return integer
    if kind == FieldDescriptor.CPPTYPE_BOOL:

        def boolean(value: Any) -> bool:
            if type(value) is not bool:
                raise _Fallback
            return value

        return boolean
    if kind == FieldDescriptor.CPPTYPE_ENUM:
        numbers: dict[str, int] = {value.name: value.number for value in field.enum_type.values}

        def enum(value: Any) -> int:
            if type(value) is not str or value not in numbers:
                raise _Fallback
            return numbers[value]

        return enum
    if kind == FieldDescriptor.CPPTYPE_STRING and field.type == FieldDescriptor.TYPE_STRING:

        def string(value: Any) -> str:
            if type(value) is not str or (not value.isascii() and _SURROGATE.search(value)):
                raise _Fallback
            return value

        return string

    def unreadable(value: Any) -> Any:
        raise _Fallback

    return unreadable  # floats, bytes: json_format's

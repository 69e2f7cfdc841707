"""ProtoJson (the HTTP face's JSON mapping) against google.protobuf.json_format, the reference, over every message
type of the API: the same JSON written for any message, and the same message read (or the same error raised)
for any document: the canonical ones our clients send and mutated ones (snake_case names, unknown fields,
nulls, values of other types, numbers in strings, out-of-range numbers, lone surrogates, repeated oneofs)."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.api.protojson import ProtoJson
from inbox_wire.v1 import coordinator_pb2 as pb

INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}
# Timestamp's valid range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999999Z.
TIMESTAMP_SECONDS = (-62135596800, 253402300799)


def all_types(descriptors: Any) -> list[Any]:
    found: list[Any] = []
    for descriptor in descriptors:
        if not descriptor.GetOptions().map_entry:
            found.append(descriptor)
        found.extend(all_types(descriptor.nested_types))
    return found


MESSAGE_TYPES = all_types(pb.DESCRIPTOR.message_types_by_name.values())
CLASSES = {descriptor.full_name: message_factory.GetMessageClass(descriptor) for descriptor in MESSAGE_TYPES}


def test_every_request_and_response_type_is_covered() -> None:
    names = {descriptor.name for descriptor in MESSAGE_TYPES}
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        assert {method.input_type.name, method.output_type.name} <= names


texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)


def scalar(field: Any) -> st.SearchStrategy[Any]:
    kind = field.cpp_type
    if kind in INT_RANGES:
        low, high = INT_RANGES[kind]
        return st.one_of(st.integers(low, high), st.sampled_from((low, high, 0, 1)))
    if kind == FieldDescriptor.CPPTYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.CPPTYPE_ENUM:
        numbers = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-5, 50))  # open enums keep unknown numbers
    assert field.type == FieldDescriptor.TYPE_STRING, field.full_name
    return texts


@st.composite
def messages(draw: st.DrawFn, descriptor: Any, depth: int = 0) -> Any:
    message: Any = CLASSES.get(descriptor.full_name, message_factory.GetMessageClass(descriptor))()
    if descriptor.full_name == "google.protobuf.Timestamp":
        message.seconds = draw(st.integers(*TIMESTAMP_SECONDS))
        message.nanos = draw(st.sampled_from((0, 1_000_000, 1_000, 1, 999_999_999)) | st.integers(0, 999_999_999))
        return message
    oneofs_set: set[str] = set()
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and len(oneof.fields) > 1:
            if oneof.name in oneofs_set or not draw(st.booleans()):
                continue
            oneofs_set.add(oneof.name)
        elif not draw(st.booleans()):
            continue
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if depth >= 3:
                continue
            inner = messages(field.message_type, depth + 1)
            if field.is_repeated:
                for value in draw(st.lists(inner, max_size=2)):
                    getattr(message, field.name).add().CopyFrom(value)
            else:
                getattr(message, field.name).CopyFrom(draw(inner))
        elif field.is_repeated:
            getattr(message, field.name).extend(draw(st.lists(scalar(field), max_size=3)))
        else:
            setattr(message, field.name, draw(scalar(field)))
    return message


any_message = st.sampled_from(MESSAGE_TYPES).flatmap(messages)

odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.integers(-3, 3), max_size=2),
    st.dictionaries(st.sampled_from(["mailbox", "id", "kind", "seconds", "x"]), st.integers(0, 3), max_size=2),
    texts,
)
INTEGERS = [" 12", "12", "-7", "1e3", "0x10", "1_000", "007", "1.0", "٣", "", "-0", "99999999999999999999", 1.0, 1.5]
INTEGERS += [True, 2**31, -(2**31) - 1, 2**32, 2**63, 2**64, -1, 0]
TIMESTAMPS = ["2026-11-30T20:00:00Z", "2026-11-30T20:00:00.5+01:00", "yesterday", "0001-01-01T00:00:00Z", 12, {}]
STRINGS = ["\ud800", "a\udfffb", "ok ✓", "\x00", 12, True, ["x"]]


def odd_for(field: Any) -> st.SearchStrategy[Any]:
    """Values a client could send for this field that are not what json_format writes for it."""
    if field is None:
        return odd_values
    if field.is_repeated and not field.message_type:
        return st.one_of(st.lists(odd_for_value(field), max_size=2), st.just([None]), st.just("x"), st.just({}))
    return st.one_of(odd_for_value(field), odd_values)


def odd_for_value(field: Any) -> st.SearchStrategy[Any]:
    kind = field.cpp_type
    if kind in INT_RANGES:
        return st.sampled_from(INTEGERS)
    if kind == FieldDescriptor.CPPTYPE_BOOL:
        return st.sampled_from(["true", "false", 1, 0, 1.0])
    if kind == FieldDescriptor.CPPTYPE_ENUM:
        names = [value.name for value in field.enum_type.values]
        return st.sampled_from([*names, "NOPE", "1", " 1", 1, 99, 1.0, True, names[-1].lower()])
    if kind == FieldDescriptor.CPPTYPE_MESSAGE:
        if field.message_type.full_name == "google.protobuf.Timestamp":
            return st.sampled_from(TIMESTAMPS)
        return st.sampled_from([{}, [], "x", 1, {"unknown": 1}])
    return st.sampled_from(STRINGS)


def snake(name: str) -> str:
    return "".join(f"_{ch.lower()}" if ch.isupper() else ch for ch in name)


def field_named(descriptor: Any, key: str) -> Any:
    for field in descriptor.fields:
        if key in (field.json_name, field.name):
            return field
    return None


@st.composite
def mutated(draw: st.DrawFn, document: Any, descriptor: Any) -> Any:
    """The document with one change somewhere in it (or none)."""
    if not isinstance(document, dict) or not document:
        return draw(odd_values) if draw(st.booleans()) else document
    document = dict(document)
    key = draw(st.sampled_from(sorted(document)))
    field = field_named(descriptor, key)
    change = draw(st.sampled_from(["deeper", "value", "value", "snake", "both", "merge", "unknown", "null", "none"]))
    if change == "deeper" and field is not None and field.message_type is not None:
        value = document[key]
        if isinstance(value, list) and value:
            document[key] = [draw(mutated(value[0], field.message_type)), *value[1:]]
        else:
            document[key] = draw(mutated(value, field.message_type))
    elif change == "value":
        document[key] = draw(odd_for(field))
    elif change == "snake":
        document[snake(key)] = document.pop(key)
    elif change == "both":
        document[snake(key)] = draw(odd_for(field)) if draw(st.booleans()) else document[key]
    elif change == "merge":  # another message's fields too: two members of a oneof, say
        document.update(json_format.MessageToDict(draw(messages(descriptor))))
    elif change == "unknown":
        document[draw(st.sampled_from(["x", "Mailbox", "@type", "[ext]", "snapshot", "event", "kind"]))] = 1
    elif change == "null":
        document[key] = None
    return document


def outcome(parse: Any, document: Any, cls: type[Message]) -> tuple[str, Any]:
    message = cls()
    try:
        parse(document, message)
    except Exception as error:  # compared, not judged: both must fail alike
        return type(error).__name__, str(error)
    return "ok", message


FAST = ProtoJson()


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(any_message)
def test_writing_any_message_gives_json_formats_dict(message: Message) -> None:
    assert FAST.to_dict(message) == json_format.MessageToDict(message)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(any_message)
def test_reading_a_canonical_document_gives_the_message_back(message: Message) -> None:
    document = json_format.MessageToDict(message)
    read = type(message)()
    FAST.parse(document, read)
    assert read == message


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_reading_any_document_reads_or_refuses_it_as_json_format_does(data: st.DataObject) -> None:
    message = data.draw(any_message)
    document = data.draw(mutated(json_format.MessageToDict(message), message.DESCRIPTOR))
    cls = type(message)
    assert outcome(FAST.parse, document, cls) == outcome(json_format.ParseDict, document, cls)


def odd_values_of(field: Any) -> list[Any]:
    """Every listed off-canonical value for the field's type, alone and (repeated fields) in a list."""
    kind = field.cpp_type
    if kind in INT_RANGES:
        values: list[Any] = list(INTEGERS)
    elif kind == FieldDescriptor.CPPTYPE_BOOL:
        values = ["true", "false", 1, 0, 1.0, True, False]
    elif kind == FieldDescriptor.CPPTYPE_ENUM:
        names = [value.name for value in field.enum_type.values]
        values = [*names, "NOPE", "1", " 1", 1, 99, 1.0, True, names[-1].lower()]
    elif kind == FieldDescriptor.CPPTYPE_MESSAGE and field.message_type.full_name == "google.protobuf.Timestamp":
        values = list(TIMESTAMPS)
    elif kind == FieldDescriptor.CPPTYPE_MESSAGE:
        values = [{}, [], "x", 1, {"unknown": 1}, {"@type": 1}]
    else:
        values = list(STRINGS)
    values += [None, [], {}, "", 0, 2.5]
    if field.is_repeated:
        values += [[value] for value in values]
    return values


FIELD_CASES = [
    (descriptor, key, value)
    for descriptor in MESSAGE_TYPES
    for field in descriptor.fields
    for key in {field.json_name, field.name}
    for value in odd_values_of(field)
]


def test_every_field_of_every_type_with_every_listed_value_reads_or_is_refused_as_by_json_format() -> None:
    assert len(FIELD_CASES) > 1000
    for descriptor, key, value in FIELD_CASES:
        cls = CLASSES[descriptor.full_name]
        for document in ({key: value}, {key: value, "other": 1}):
            fast, reference = outcome(FAST.parse, document, cls), outcome(json_format.ParseDict, document, cls)
            assert fast == reference, (descriptor.full_name, document)


@pytest.mark.parametrize(
    ("document", "error"),
    [
        ({"ttlSeconds": "30"}, None),  # a number in a string is read as json_format reads it
        ({"ttl_seconds": 30}, None),  # so is a proto field name
        ({"ttlSeconds": 2**32}, "Value out of range"),
        ({"ttlSeconds": " 30"}, "Couldn't parse integer"),
        ({"note": "\ud800"}, "Unpaired surrogate"),
        ({"subject": {"kind": "SUBJECT_KIND_BOAT"}}, "Invalid enum value SUBJECT_KIND_BOAT"),
        ({"summary": {"receivedAt": "yesterday"}}, "receivedAt"),
        ({"surprise": 1}, 'no field named "surprise"'),
    ],
)
def test_documents_off_the_fast_path_are_json_formats_to_read_or_refuse(document: Any, error: str | None) -> None:
    fast, reference = (
        outcome(FAST.parse, document, pb.ClaimReplyRequest),
        outcome(json_format.ParseDict, document, pb.ClaimReplyRequest),
    )
    assert fast == reference
    if error is None:
        assert fast[0] == "ok"
    else:
        assert error in fast[1]

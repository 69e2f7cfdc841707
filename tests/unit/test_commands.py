"""The commands' fingerprints (coordinator/core/commands.py, docs/design.md#retries): the golden vectors pin the
encoding and the legacy fingerprints; the properties hold for every field of every command, found by
``dataclasses.fields``, so a field added later is covered without a new test."""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from coordinator.core import commands
from coordinator.core.commands import COMMANDS, Command, canonical_document
from coordinator.core.domain import Subject, SubjectKind, Summary

VECTORS = Path(__file__).resolve().parents[1] / "data" / "fingerprints.json"
COMMAND_CLASSES = {cls.__name__: cls for cls in COMMANDS}


# --- commands as JSON (the vectors' inputs) ---------------------------------------------------------------


def _to_json(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _to_json(getattr(value, field.name)) for field in dataclasses.fields(value)}
    return value


def _from_json(value: Any, hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None:
            return None
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        build: Any = hint
        return build(**{name: _from_json(item, hints[name]) for name, item in value.items()})
    return value


def command_to_json(command: Command) -> dict[str, Any]:
    """Every field, defaults included: the vector says exactly what was fingerprinted."""
    encoded = _to_json(command)
    assert isinstance(encoded, dict)
    return encoded


def command_from_json(name: str, fields: dict[str, Any]) -> Command:
    command = _from_json(fields, COMMAND_CLASSES[name])
    assert isinstance(command, Command)
    return command


def _vectors() -> list[tuple[str, dict[str, Any]]]:
    data = json.loads(VECTORS.read_text(encoding="utf-8"))
    return [(name, vector) for name, rows in data["commands"].items() for vector in rows]


# --- golden vectors ---------------------------------------------------------------------------------------


def test_every_command_class_is_listed() -> None:
    declared = {cls for cls in Command.__subclasses__() if cls.__module__ == commands.__name__}
    assert declared == set(COMMANDS), "list a new command in COMMANDS: the tests below cover what it lists"


def test_every_command_has_golden_vectors() -> None:
    named = {name for name, _ in _vectors()}
    assert named == set(COMMAND_CLASSES), "add vectors for a new command to tests/data/fingerprints.json"


@pytest.mark.parametrize(("name", "vector"), _vectors(), ids=lambda v: v if isinstance(v, str) else v["case"])
def test_a_golden_vector_keeps_its_fingerprints(name: str, vector: dict[str, Any]) -> None:
    """A failure here means records in etcd would no longer be recognised: a new encoding needs a new version
    (and the old one still recognised), never a changed vector."""
    command = command_from_json(name, vector["command"])
    assert canonical_document(command) == vector["document"]
    assert command.fingerprint == vector["v1"]
    assert command.legacy_fingerprint() == vector["legacy"]
    assert command.recognises(vector["v1"])
    if vector["legacy"] is not None:
        assert command.recognises(vector["legacy"])


def test_the_vectors_cover_each_value_of_each_enum() -> None:
    seen: dict[type[enum.Enum], set[enum.Enum]] = {}

    def visit(value: Any) -> None:
        if isinstance(value, enum.Enum):
            seen.setdefault(type(value), set()).add(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name))

    for name, vector in _vectors():
        visit(command_from_json(name, vector["command"]))
    assert seen, "no enum found: the walk is broken"
    for kind, values in seen.items():
        assert values == set(kind), f"the vectors miss {set(kind) - values}"


def test_the_encoding_is_canonical_json_of_the_fields_but_the_request_id() -> None:
    claim = commands.ClaimReply(
        request_id="r-1",
        subject=Subject("bo\u00eete", SubjectKind.THREAD, "t\U0001d11e"),
        ttl_seconds=60,
        summary=Summary("Hi", received_ms=5),
    )
    assert canonical_document(claim) == (
        '["ClaimReply",{"subject":{"id":"t\\ud834\\udd1e","kind":"t","mailbox":"bo\\u00eete"},'
        '"summary":{"received_ms":5,"subject_line":"Hi"},"ttl_seconds":60}]'
    )
    assert claim.fingerprint.startswith("v1:")
    assert len(claim.fingerprint) == len("v1:") + 11  # 8 bytes, unpadded base64url


def test_a_field_type_without_an_encoding_is_refused() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Measured(Command):
        rpc: typing.ClassVar[str] = "Measured"
        seconds: float

    with pytest.raises(TypeError, match="float"):
        _ = Measured(request_id="r", seconds=1.5).fingerprint


# --- properties over every field --------------------------------------------------------------------------


def _sample(hint: Any) -> Any:
    """A value of ``hint`` other than any default: a command built of these sets every optional field."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if hint is bool:
        return True
    if hint is int:
        return 1_760_000_000_000
    if hint is str:
        return "s"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return list(hint)[-1]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        build: Any = hint
        return build(**{field.name: _sample(hints[field.name]) for field in dataclasses.fields(hint)})
    raise AssertionError(f"no sample for {hint}: teach _sample the new field's type")


def _changed(value: Any, hint: Any) -> Any:
    """Another value of ``hint`` than ``value``."""
    if value is None:
        return _sample(hint)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, enum.Enum):
        members = list(type(value))
        return members[(members.index(value) + 1) % len(members)]
    raise AssertionError(f"no change for {value!r}")


def _full(cls: type[Command]) -> Command:
    hints = typing.get_type_hints(cls)
    return cls(**{field.name: _sample(hints[field.name]) for field in dataclasses.fields(cls)})


def _minimal(cls: type[Command]) -> Command:
    """Every field that has a default at its default."""
    hints = typing.get_type_hints(cls)
    required = [field for field in dataclasses.fields(cls) if field.default is dataclasses.MISSING]
    return cls(**{field.name: _sample(hints[field.name]) for field in required})


def _variants(value: Any, hint: Any) -> list[tuple[str, Any]]:
    """(path, changed value) for each leaf of ``value``: a field of a nested dataclass is a leaf of its own."""
    if value is not None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = typing.get_type_hints(type(value))
        return [
            (f"{field.name}.{path}", dataclasses.replace(value, **{field.name: changed}))
            for field in dataclasses.fields(value)
            for path, changed in _variants(getattr(value, field.name), hints[field.name])
        ]
    return [("", _changed(value, hint))]


BASES = [(cls, build) for cls in COMMANDS for build in (_full, _minimal)]


@pytest.mark.parametrize(("cls", "build"), BASES, ids=lambda v: v.__name__)
def test_changing_any_field_changes_the_fingerprint_and_the_request_id_does_not(cls: type[Command], build: Any) -> None:
    command = build(cls)
    hints = typing.get_type_hints(cls)
    checked = 0
    for field in dataclasses.fields(cls):
        for path, changed in _variants(getattr(command, field.name), hints[field.name]):
            other = dataclasses.replace(command, **{field.name: changed})
            if field.name == "request_id":
                assert other.fingerprint == command.fingerprint
            else:
                assert other.fingerprint != command.fingerprint, f"{cls.__name__}.{field.name}.{path}"
                assert not command.recognises(other.fingerprint)
            checked += 1
    assert checked >= len(dataclasses.fields(cls))


def _without(cls: type[Command], name: str) -> type[Command]:
    """``cls`` as an earlier release without its field ``name`` would have declared it."""
    kept = [(field.name, field.type, field) for field in dataclasses.fields(cls) if field.name != name]
    earlier = dataclasses.make_dataclass(
        cls.__name__, kept, bases=(Command,), namespace={"rpc": cls.rpc}, frozen=True, kw_only=True
    )
    return typing.cast(type[Command], earlier)


DEFAULTED = [
    (cls, field.name)
    for cls in COMMANDS
    for field in dataclasses.fields(cls)
    if field.default is not dataclasses.MISSING
]


@pytest.mark.parametrize(("cls", "name"), DEFAULTED, ids=lambda v: v.__name__ if isinstance(v, type) else v)
def test_a_field_at_its_default_fingerprints_as_if_the_command_had_none(cls: type[Command], name: str) -> None:
    """A field a later release adds with a default leaves the fingerprints of the calls that do not use it."""
    default: Any = next(f for f in dataclasses.fields(cls) if f.name == name).default
    command = dataclasses.replace(_full(cls), **{name: default})
    values = {f.name: getattr(command, f.name) for f in dataclasses.fields(cls) if f.name != name}
    earlier = _without(cls, name)(**values)
    assert earlier.fingerprint == command.fingerprint
    assert dataclasses.replace(command, **{name: _sample(typing.get_type_hints(cls)[name])}).fingerprint != (
        command.fingerprint
    )


def test_a_nested_field_at_its_default_encodes_as_if_its_class_had_none() -> None:
    @dataclasses.dataclass(frozen=True)
    class EarlierSummary:
        subject_line: str = ""
        sender: str = ""

    claim = commands.ClaimReply(
        request_id="r", subject=Subject("b", SubjectKind.MESSAGE, "m"), summary=Summary("Hi", "bea")
    )
    earlier = dataclasses.replace(claim, summary=typing.cast(Summary, EarlierSummary("Hi", "bea")))
    assert earlier.fingerprint == claim.fingerprint


def test_a_version_1_fingerprint_is_compared_with_version_1_only() -> None:
    begin = commands.BeginSend(request_id="r", subject=Subject("b", SubjectKind.MESSAGE, "m"), token=7)
    legacy = begin.legacy_fingerprint()
    assert legacy is not None
    assert not legacy.startswith("v1:")
    assert begin.recognises(begin.fingerprint)
    assert begin.recognises(legacy)
    other = dataclasses.replace(begin, token=8)
    assert not begin.recognises(other.fingerprint)
    assert not begin.recognises(other.legacy_fingerprint() or "")
    assert not begin.recognises("v1:" + legacy)

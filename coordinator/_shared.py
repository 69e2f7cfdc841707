"""Work done once for every watcher of a mailbox: a batch of changes becomes events once, an event becomes a
serialized message once, however many streams carry it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

Key = TypeVar("Key")
Value = TypeVar("Value")


class LastConverted(Generic[Key, Value]):
    """Remembers the conversions of the last ``size`` objects, by identity: the fan-out hands the very same
    batch (and then the very same event) to every subscriber, so the first one converts it and the others
    find it here. Each entry holds its object, so an id is never reused while it is remembered; a subscriber
    so far behind that its batch was forgotten simply converts it again."""

    def __init__(self, convert: Callable[[Key], Value], size: int = 256) -> None:
        self._convert = convert
        self._size = size
        self._entries: dict[int, tuple[Key, Value]] = {}

    def __call__(self, key: Key) -> Value:
        entry = self._entries.get(id(key))
        if entry is not None and entry[0] is key:
            return entry[1]
        value = self._convert(key)
        self._entries[id(key)] = (key, value)
        if len(self._entries) > self._size:
            del self._entries[next(iter(self._entries))]
        return value


@dataclass(frozen=True, slots=True)
class Encoded:
    """A response serialized once, to be written as the same bytes to many gRPC streams. The HTTP face, which
    writes JSON, takes ``message``."""

    message: Message
    data: bytes

    @classmethod
    def of(cls, message: Message) -> Encoded:
        return cls(message, message.SerializeToString())


def writes_encoded(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    """A gRPC response serializer that writes an :class:`Encoded` message's bytes as they are."""

    def serialize(message: Any) -> bytes:
        if type(message) is Encoded:
            return message.data
        if serializer is None:
            return bytes(message)
        return serializer(message)

    return serialize

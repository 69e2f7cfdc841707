"""Work done once for every watcher of a mailbox: a batch of changes becomes events once, however many
streams carry them (the serialized message likewise: coordinator/api/encoded.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

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

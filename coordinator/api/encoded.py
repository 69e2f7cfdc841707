"""A Watch response serialized once and written as the same bytes to every gRPC stream that carries it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message


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

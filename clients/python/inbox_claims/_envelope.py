"""Typed parsing of the Nylas v3 webhook notification envelope (a CloudEvents-style document).

.. code-block:: json

    {"specversion": "1.0", "type": "message.created", "source": "/google/emails/realtime",
     "id": "<notification id>", "time": 1723821985, "webhook_delivery_attempt": 1,
     "data": {"application_id": "<app id>",
              "object": {"id": "<message id>", "grant_id": "<grant id>", "thread_id": "...",
                         "object": "message", "subject": "...", "from": [...], ...}}}

**Two ids, two jobs.** The *notification id* (top-level ``id``) identifies one
notification: Nylas delivers at least once, so a retried delivery carries the same
notification id, and it is the key for *delivery* dedup. The *message id*
(``data.object.id`` of a ``message.*`` event) identifies the email, and it is what an
agent *claims* before replying. One message produces several notifications
(``message.created``, then ``message.updated`` for each change of labels, read state,
...), each with its own notification id; so the message id must never be used for
delivery dedup (it would drop genuine updates), and the notification id must never be
used as the claim key (it would let two notifications about one message both get a
reply).

Verify the signature (see :mod:`inbox_claims._webhooks`) on the raw body *before*
parsing it.
"""

from __future__ import annotations

import copy
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["Notification", "NotificationError", "NotificationVariant", "parse_notification"]

# Notification types that are about one email and are useless without its id: parsing
# them without ``data.object.id`` fails rather than produce a claim key of ``None``.
_MESSAGE_ID_REQUIRED = frozenset({"message.created", "message.updated"})


class NotificationError(ValueError):
    """The notification body is not a usable Nylas v3 envelope; the message names the field."""


EnvelopeError = NotificationError  # its name until 0.2 (see inbox_claims.__getattr__)


class NotificationVariant(enum.Enum):
    """Which form of the object a notification carries, from the suffix of its ``type``.

    * ``FULL``: no suffix (``message.created``); the object is complete.
    * ``TRUNCATED``: ``.truncated``; the message exceeded 1 MB, so Nylas dropped the body.
      Callers must fetch the message (``GET /v3/grants/{grant_id}/messages/{id}``) for it.
    * ``CLEANED``: ``.cleaned``; a Clean Conversations variant (body reduced to the new
      text, quoted history and signatures removed).
    * ``TRANSFORMED``: ``.transformed``; another clean-conversation variant, with the body
      transformed by Nylas.

    Every variant of a message event is still about the same message id.
    """

    FULL = "full"
    TRUNCATED = "truncated"
    CLEANED = "cleaned"
    TRANSFORMED = "transformed"


_SUFFIXES: Mapping[str, NotificationVariant] = {
    v.value: v for v in NotificationVariant if v is not NotificationVariant.FULL
}


@dataclass(frozen=True, slots=True)
class Notification:
    """One Nylas v3 webhook notification.

    ``notification_id`` is the delivery dedup key (a redelivery repeats it).
    ``object_id`` is ``data.object.id``: for message events, the message id, which is
    what an agent claims. One message yields several notifications with different
    notification ids, so never dedup deliveries on the message id, nor claim on the
    notification id.

    ``object`` and ``raw`` are read-only views of private copies of the document.
    """

    notification_id: str
    type: str
    """The full type, e.g. ``message.created.truncated``."""
    base_type: str
    """The type without its variant suffix, e.g. ``message.created``."""
    variant: NotificationVariant
    object_kind: str
    """First dotted part of the type: ``message``, ``thread``, ``grant``, ..."""
    action: str
    """The rest of the base type: ``created``, ``updated``, ``replied``, ``expired``, ..."""
    source: str | None
    specversion: str | None
    time: int | None
    """Unix seconds at which Nylas generated the notification."""
    delivery_attempt: int | None
    """``webhook_delivery_attempt``: 1 for the first delivery, more on retries."""
    application_id: str | None
    object_id: str | None
    """``data.object.id``: the message id for message events; absent for some kinds."""
    grant_id: str | None
    thread_id: str | None
    object: Mapping[str, Any] = field(repr=False, hash=False)
    raw: Mapping[str, Any] = field(repr=False, hash=False)

    @property
    def mailbox(self) -> str | None:
        """The grant id: the mailbox (connected account) the notification is about."""
        return self.grant_id

    @property
    def is_message_event(self) -> bool:
        """True for ``message.*`` notifications (any action, any variant)."""
        return self.object_kind == "message"

    @property
    def message_id(self) -> str | None:
        """The id to claim: ``object_id`` for message events, ``None`` otherwise."""
        return self.object_id if self.is_message_event else None


def _load(raw: bytes | bytearray | str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        document: Any = copy.deepcopy(dict(raw))
    elif isinstance(raw, bytes | bytearray | str):
        try:
            document = json.loads(raw)
        except RecursionError:
            raise NotificationError("notification body is nested too deeply to parse") from None
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise NotificationError(f"notification body is not valid JSON: {exc}") from None
    else:
        raise TypeError(f"notification must be bytes, str or a mapping, not {type(raw).__name__}")
    if not isinstance(document, dict):
        raise NotificationError(f"notification body must be a JSON object, not {_json_type(document)}")
    return document


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _describe(path: str) -> str:
    return f"'{path}'" if "." in path else f"top-level '{path}'"


def _required_str(container: Mapping[str, Any], path: str, why: str = "") -> str:
    key = path.rpartition(".")[2]
    value = container.get(key)
    if value is None:
        raise NotificationError(f"notification envelope has no {_describe(path)}{why}")
    if not isinstance(value, str):
        raise NotificationError(f"notification {_describe(path)} must be a string, not {_json_type(value)}")
    if not value:
        raise NotificationError(f"notification {_describe(path)} is empty{why}")
    return value


def _optional_str(container: Mapping[str, Any], path: str) -> str | None:
    if container.get(path.rpartition(".")[2]) is None:
        return None
    return _required_str(container, path)


def _optional_int(container: Mapping[str, Any], path: str) -> int | None:
    value = container.get(path.rpartition(".")[2])
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise NotificationError(f"notification {_describe(path)} must be an integer, not {_json_type(value)}")
    return value


def _split_type(type_: str) -> tuple[str, NotificationVariant, str, str]:
    parts = type_.split(".")
    variant = NotificationVariant.FULL
    if len(parts) >= 3 and parts[-1] in _SUFFIXES:
        variant = _SUFFIXES[parts[-1]]
        parts = parts[:-1]
    if len(parts) < 2 or not all(parts):
        raise NotificationError(
            f"notification top-level 'type' {type_[:80]!r} is not of the form '<object>.<action>[.<variant>]'"
        )
    return ".".join(parts), variant, parts[0], ".".join(parts[1:])


def parse_notification(raw: bytes | str | Mapping[str, Any]) -> Notification:
    """Parse a Nylas v3 webhook body (raw bytes, text, or an already-decoded mapping).

    Strict on what matters: top-level ``id`` and ``type`` must be non-empty strings,
    ``type`` must look like ``<object>.<action>[.<variant>]``, ``data`` must be an
    object, and ``data.object`` must be an object when present. ``message.created`` and
    ``message.updated`` (any variant) must carry ``data.object.id``, the message id.
    Known optional fields must have the right JSON type when present; ``null`` counts as
    absent. Unknown fields are ignored (and kept in ``raw``/``object``).

    The returned ``notification_id`` is the delivery dedup key; ``object_id`` /
    ``message_id`` is the message id to claim. Never swap them: one message yields
    several notifications.

    Raises :class:`NotificationError` naming the missing or bad field.
    """
    document = _load(raw)

    notification_id = _required_str(document, "id")
    type_ = _required_str(document, "type")
    base_type, variant, object_kind, action = _split_type(type_)

    if "data" not in document or document["data"] is None:
        raise NotificationError("notification envelope has no top-level 'data' object")
    data = document["data"]
    if not isinstance(data, dict):
        raise NotificationError(f"notification 'data' must be an object, not {_json_type(data)}")

    obj = data.get("object")
    if obj is None:
        obj = {}
    elif not isinstance(obj, dict):
        raise NotificationError(f"notification 'data.object' must be an object, not {_json_type(obj)}")

    if base_type in _MESSAGE_ID_REQUIRED:
        object_id: str | None = _required_str(
            obj, "data.object.id", f" (required for {base_type} notifications: it is the message id)"
        )
    else:
        object_id = _optional_str(obj, "data.object.id")

    return Notification(
        notification_id=notification_id,
        type=type_,
        base_type=base_type,
        variant=variant,
        object_kind=object_kind,
        action=action,
        source=_optional_str(document, "source"),
        specversion=_optional_str(document, "specversion"),
        time=_optional_int(document, "time"),
        delivery_attempt=_optional_int(document, "webhook_delivery_attempt"),
        application_id=_optional_str(data, "data.application_id"),
        object_id=object_id,
        grant_id=_optional_str(obj, "data.object.grant_id"),
        thread_id=_optional_str(obj, "data.object.thread_id"),
        object=MappingProxyType(obj),
        raw=MappingProxyType(document),
    )

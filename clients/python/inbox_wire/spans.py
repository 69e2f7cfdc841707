"""What a call's span says, read from its messages the same way by the coordinator and the Python client (the
Node client spells the same names): the attributes a request gives and the result label a response gives
(docs/operations.md#traces). Only the fields named here reach a span: never a message's summary (subject line,
sender), a fencing token or a credential. No OpenTelemetry here: plain values, set on spans by each side.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["TRACEPARENT", "TRACESTATE", "request_attributes", "result_label"]

# The W3C trace context's gRPC metadata keys and HTTP headers (https://www.w3.org/TR/trace-context/).
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# Request fields -> span attributes: which call this is, to be found by (a message id, a notification id).
_PLAIN_FIELDS = (
    ("request_id", "inbox.request_id"),
    ("mailbox", "inbox.mailbox"),
    ("notification_id", "inbox.notification_id"),
    ("thread_id", "inbox.thread_id"),
    ("message_id", "inbox.message_id"),
)

_readers: dict[str, Callable[[Any], dict[str, str]]] = {}


def request_attributes(request: Any) -> dict[str, str]:
    """The span attributes of a request message: its request id, mailbox, subject (``inbox.subject.kind``:
    message or thread, ``inbox.subject.id``), notification, thread and message ids, for those it has and sets."""
    descriptor = getattr(request, "DESCRIPTOR", None)
    if descriptor is None:
        return {}
    reader = _readers.get(descriptor.full_name)
    if reader is None:
        reader = _readers[descriptor.full_name] = _request_reader(descriptor)
    return reader(request)


def _request_reader(descriptor: Any) -> Callable[[Any], dict[str, str]]:
    names = descriptor.fields_by_name
    plain = [(field, attribute) for field, attribute in _PLAIN_FIELDS if field in names]
    subject = names.get("subject")
    has_subject = (
        subject is not None and subject.message_type is not None and "mailbox" in subject.message_type.fields_by_name
    )

    def read(request: Any) -> dict[str, str]:
        attributes = {attribute: value for field, attribute in plain if (value := getattr(request, field))}
        if has_subject and request.HasField("subject"):
            attributes["inbox.mailbox"] = request.subject.mailbox
            attributes["inbox.subject.kind"] = enum_label(request.subject, "kind")
            attributes["inbox.subject.id"] = request.subject.id
        return attributes

    return read


def enum_label(message: Any, field: str) -> str:
    """An enum field's value name without its type's prefix, lower-cased (``SUBJECT_KIND_THREAD`` is ``thread``)."""
    enum = message.DESCRIPTOR.fields_by_name[field].enum_type
    value = enum.values_by_number.get(getattr(message, field))
    if value is None:
        return str(getattr(message, field))
    return str(value.name).removeprefix(_snake(enum.name) + "_").lower()


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


_result_labels: dict[str, Callable[[Any], str]] = {}


def result_label(response: Any) -> str:
    """The response's ``result`` as a label value (``GRANTED`` is ``granted``, ``FENCE_RESULT_STALE_TOKEN`` is
    ``stale_token``); ``ok`` when it has none. The coordinator's metrics use the same labels."""
    descriptor = getattr(response, "DESCRIPTOR", None)
    if descriptor is None:
        return "ok"
    label = _result_labels.get(descriptor.full_name)
    if label is None:
        label = _result_labels[descriptor.full_name] = _result_reader(descriptor)
    return label(response)


def _result_reader(descriptor: Any) -> Callable[[Any], str]:
    field = descriptor.fields_by_name.get("result")
    if field is None or field.enum_type is None:
        return lambda _response: "ok"
    prefix = _snake(field.enum_type.name) + "_"
    names = {value.number: value.name.removeprefix(prefix).lower() for value in field.enum_type.values}
    return lambda response: names.get(response.result, str(response.result))

"""Webhook helpers of the client: Nylas and Standard Webhooks signatures, and the Nylas envelope."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inbox_claims._webhooks import (
    WebhookVerificationError,
    nylas_challenge_response,
    sign_nylas,
    sign_standard_webhook,
    verify_nylas_signature,
    verify_standard_webhook,
)
from inbox_claims.webhooks import Notification, NotificationError, NotificationVariant, parse_notification

# ------------------------------------------------------------------ Standard Webhooks

# The reference vector from the Standard Webhooks specification and libraries.
SW_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SW_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SW_TS = 1614265330
SW_BODY = b'{"test": 2432232314}'
SW_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
OTHER_SECRET = "whsec_" + base64.b64encode(b"another secret, 32 bytes long!!!").decode()


def sw_headers(signature: str = SW_SIGNATURE, *, msg_id: str = SW_ID, ts: int | str = SW_TS) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": signature}


def test_standard_webhook_reference_vector_verifies() -> None:
    verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET, now=SW_TS)


def test_sign_standard_webhook_reproduces_reference_vector() -> None:
    assert sign_standard_webhook(SW_BODY, msg_id=SW_ID, timestamp=SW_TS, secret=SW_SECRET) == SW_SIGNATURE
    # The whsec_ prefix is optional.
    bare = SW_SECRET.removeprefix("whsec_")
    assert sign_standard_webhook(SW_BODY, msg_id=SW_ID, timestamp=SW_TS, secret=bare) == SW_SIGNATURE
    verify_standard_webhook(SW_BODY, sw_headers(), bare, now=SW_TS)


def test_standard_webhook_header_names_are_case_insensitive() -> None:
    headers = {"Webhook-Id": SW_ID, "WEBHOOK-TIMESTAMP": str(SW_TS), "webhook-Signature": SW_SIGNATURE}
    verify_standard_webhook(SW_BODY, headers, SW_SECRET, now=SW_TS)


def test_standard_webhook_accepts_any_mapping() -> None:
    class Headers(Mapping[str, str]):
        def __init__(self, items: dict[str, str]) -> None:
            self._items = items

        def __getitem__(self, key: str) -> str:
            return self._items[key]

        def __iter__(self) -> Any:
            return iter(self._items)

        def __len__(self) -> int:
            return len(self._items)

    verify_standard_webhook(SW_BODY, Headers(sw_headers()), SW_SECRET, now=SW_TS)


def test_standard_webhook_second_of_several_signatures_matches() -> None:
    wrong = sign_standard_webhook(SW_BODY, msg_id=SW_ID, timestamp=SW_TS, secret=OTHER_SECRET)
    assert wrong != SW_SIGNATURE
    verify_standard_webhook(SW_BODY, sw_headers(f"{wrong} {SW_SIGNATURE}"), SW_SECRET, now=SW_TS)


def test_standard_webhook_other_versions_are_ignored() -> None:
    header = f"v2,{SW_SIGNATURE.removeprefix('v1,')} v1a,xyz garbage {SW_SIGNATURE}"
    verify_standard_webhook(SW_BODY, sw_headers(header), SW_SECRET, now=SW_TS)


def test_standard_webhook_only_v2_is_rejected() -> None:
    # Even with a digest that would be right for v1, a v2 entry is not considered.
    header = f"v2,{SW_SIGNATURE.removeprefix('v1,')}"
    with pytest.raises(WebhookVerificationError, match=r"no well-formed 'v1,<base64>' signature"):
        verify_standard_webhook(SW_BODY, sw_headers(header), SW_SECRET, now=SW_TS)


def test_standard_webhook_wrong_signature_is_rejected() -> None:
    wrong = sign_standard_webhook(SW_BODY, msg_id=SW_ID, timestamp=SW_TS, secret=OTHER_SECRET)
    with pytest.raises(WebhookVerificationError, match="no v1 signature in webhook-signature matches"):
        verify_standard_webhook(SW_BODY, sw_headers(wrong), SW_SECRET, now=SW_TS)


def test_standard_webhook_tampered_body_is_rejected() -> None:
    with pytest.raises(WebhookVerificationError, match="matches the request"):
        verify_standard_webhook(b'{"test": 2432232315}', sw_headers(), SW_SECRET, now=SW_TS)


@pytest.mark.parametrize(
    ("msg_id", "ts"),
    [("msg_other", SW_TS), (SW_ID, SW_TS + 1)],
    ids=["id-changed", "timestamp-changed"],
)
def test_standard_webhook_signature_covers_id_and_timestamp(msg_id: str, ts: int) -> None:
    with pytest.raises(WebhookVerificationError, match="matches the request"):
        verify_standard_webhook(SW_BODY, sw_headers(msg_id=msg_id, ts=ts), SW_SECRET, now=SW_TS)


@pytest.mark.parametrize(
    ("now", "message"),
    [(SW_TS + 301, "too old"), (SW_TS - 301, "too new")],
    ids=["stale", "future"],
)
def test_standard_webhook_timestamp_outside_default_tolerance(now: int, message: str) -> None:
    with pytest.raises(WebhookVerificationError, match=f"webhook-timestamp is {message}"):
        verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET, now=now)


@pytest.mark.parametrize("now", [SW_TS + 300, SW_TS - 300, SW_TS + 299.5])
def test_standard_webhook_timestamp_at_edge_of_tolerance_is_accepted(now: float) -> None:
    verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET, now=now)


def test_standard_webhook_custom_tolerance_is_honoured() -> None:
    verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET, now=SW_TS + 3000, tolerance=3600)
    verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET, now=SW_TS - 3000, tolerance=3600)
    with pytest.raises(WebhookVerificationError, match="too old"):
        verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET, now=SW_TS + 11, tolerance=10)
    with pytest.raises(WebhookVerificationError, match="too new"):
        verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET, now=SW_TS - 11, tolerance=10)


def test_standard_webhook_defaults_to_current_time() -> None:
    # The reference vector is from 2021: far outside the default tolerance of "now".
    with pytest.raises(WebhookVerificationError, match="too old"):
        verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_standard_webhook_missing_header_is_named(missing: str) -> None:
    headers = sw_headers()
    del headers[missing]
    with pytest.raises(WebhookVerificationError, match=f"missing {missing} header"):
        verify_standard_webhook(SW_BODY, headers, SW_SECRET, now=SW_TS)


@pytest.mark.parametrize("empty", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_standard_webhook_empty_header_is_named(empty: str) -> None:
    headers = sw_headers()
    headers[empty] = "  "
    with pytest.raises(WebhookVerificationError, match=f"{empty} header is empty"):
        verify_standard_webhook(SW_BODY, headers, SW_SECRET, now=SW_TS)


@pytest.mark.parametrize("ts", ["1614265330.5", "-1614265330", "soon", "1e9", "١٦١٤٢٦٥٣٣٠"])
def test_standard_webhook_malformed_timestamp(ts: str) -> None:
    with pytest.raises(WebhookVerificationError, match="webhook-timestamp header is not an integer"):
        verify_standard_webhook(SW_BODY, sw_headers(ts=ts), SW_SECRET, now=SW_TS)


@pytest.mark.parametrize(
    "header",
    ["v1", "v1,", "v1,not base64!", "v1,AAAA", "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="],
    ids=["no-comma", "empty", "bad-base64", "short-digest", "no-version"],
)
def test_standard_webhook_malformed_signature_entries(header: str) -> None:
    with pytest.raises(WebhookVerificationError, match="no well-formed"):
        verify_standard_webhook(SW_BODY, sw_headers(header), SW_SECRET, now=SW_TS)


def test_standard_webhook_configuration_errors_are_not_verification_errors() -> None:
    for secret in ["whsec_not*base64", "whsec_"]:
        with pytest.raises(ValueError, match="Standard Webhooks secret") as info:
            verify_standard_webhook(SW_BODY, sw_headers(), secret, now=SW_TS)
        assert not isinstance(info.value, WebhookVerificationError)
    with pytest.raises(ValueError, match="tolerance must be") as info:
        verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET, now=SW_TS, tolerance=-1)
    assert not isinstance(info.value, WebhookVerificationError)
    with pytest.raises(ValueError, match="now must be a finite") as info:
        verify_standard_webhook(SW_BODY, sw_headers(), SW_SECRET, now=float("nan"))
    assert not isinstance(info.value, WebhookVerificationError)


def test_standard_webhook_rejects_text_body() -> None:
    with pytest.raises(TypeError, match="raw_body must be the request body as received"):
        verify_standard_webhook(SW_BODY.decode(), sw_headers(), SW_SECRET, now=SW_TS)  # type: ignore[arg-type]


def test_standard_webhook_errors_do_not_leak_secret_or_expected_signature() -> None:
    wrong = sign_standard_webhook(SW_BODY, msg_id=SW_ID, timestamp=SW_TS, secret=OTHER_SECRET)
    with pytest.raises(WebhookVerificationError) as info:
        verify_standard_webhook(SW_BODY, sw_headers(wrong), SW_SECRET, now=SW_TS)
    text = str(info.value)
    assert SW_SECRET.removeprefix("whsec_") not in text
    assert SW_SIGNATURE.removeprefix("v1,") not in text


def test_sign_standard_webhook_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timestamp must be"):
        sign_standard_webhook(SW_BODY, msg_id=SW_ID, timestamp=-1, secret=SW_SECRET)
    with pytest.raises(ValueError, match="msg_id must be"):
        sign_standard_webhook(SW_BODY, msg_id="", timestamp=SW_TS, secret=SW_SECRET)


# ------------------------------------------------------------------------------ Nylas

NYLAS_SECRET = "nylas-webhook-secret-for-tests"
NYLAS_BODY = (
    b'{"specversion":"1.0","type":"message.created","source":"/google/emails/realtime",'
    b'"id":"notif-1","time":1723821985,"webhook_delivery_attempt":1,'
    b'"data":{"application_id":"app-1","object":{"id":"msg-1","grant_id":"grant-1",'
    b'"thread_id":"thread-1","object":"message","subject":"Hello \\u00e9t\\u00e9"}}}'
)


def test_sign_nylas_is_lowercase_hex_sha256() -> None:
    signature = sign_nylas(NYLAS_BODY, NYLAS_SECRET)
    assert len(signature) == 64
    assert signature == signature.lower()
    int(signature, 16)
    assert sign_nylas(NYLAS_BODY, NYLAS_SECRET.encode()) == signature


def test_sign_nylas_known_answer() -> None:
    # RFC 4231 test case 2: HMAC-SHA256 with key "Jefe".
    assert (
        sign_nylas(b"what do ya want for nothing?", "Jefe")
        == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    )


def test_nylas_valid_signature() -> None:
    verify_nylas_signature(NYLAS_BODY, sign_nylas(NYLAS_BODY, NYLAS_SECRET), NYLAS_SECRET)
    verify_nylas_signature(NYLAS_BODY, sign_nylas(NYLAS_BODY, NYLAS_SECRET), NYLAS_SECRET.encode())


def test_nylas_uppercase_hex_and_whitespace_accepted() -> None:
    signature = sign_nylas(NYLAS_BODY, NYLAS_SECRET)
    verify_nylas_signature(NYLAS_BODY, signature.upper(), NYLAS_SECRET)
    verify_nylas_signature(NYLAS_BODY, f"  {signature}\r\n", NYLAS_SECRET)


def test_nylas_tampered_body_rejected() -> None:
    signature = sign_nylas(NYLAS_BODY, NYLAS_SECRET)
    tampered = NYLAS_BODY.replace(b"msg-1", b"msg-2")
    with pytest.raises(WebhookVerificationError, match="does not match the request body"):
        verify_nylas_signature(tampered, signature, NYLAS_SECRET)


def test_nylas_wrong_secret_rejected() -> None:
    signature = sign_nylas(NYLAS_BODY, "some other secret")
    with pytest.raises(WebhookVerificationError, match="does not match"):
        verify_nylas_signature(NYLAS_BODY, signature, NYLAS_SECRET)


def test_nylas_reserialised_json_fails() -> None:
    """Semantically equal JSON, re-serialised, has different bytes: hashing must use the raw body."""
    signature = sign_nylas(NYLAS_BODY, NYLAS_SECRET)
    reserialised = json.dumps(json.loads(NYLAS_BODY)).encode()
    assert json.loads(reserialised) == json.loads(NYLAS_BODY)
    assert reserialised != NYLAS_BODY
    with pytest.raises(WebhookVerificationError, match="re-serialised"):
        verify_nylas_signature(reserialised, signature, NYLAS_SECRET)


@pytest.mark.parametrize(
    "header",
    ["abc123", "a" * 63, "a" * 65, "a" * 128],
    ids=["short", "63", "65", "128"],
)
def test_nylas_wrong_length_rejected(header: str) -> None:
    with pytest.raises(WebhookVerificationError, match=f"has {len(header)} characters, expected 64 hex"):
        verify_nylas_signature(NYLAS_BODY, header, NYLAS_SECRET)


def test_nylas_non_hex_rejected() -> None:
    header = "g" + sign_nylas(NYLAS_BODY, NYLAS_SECRET)[1:]
    with pytest.raises(WebhookVerificationError, match="not hexadecimal"):
        verify_nylas_signature(NYLAS_BODY, header, NYLAS_SECRET)
    with pytest.raises(WebhookVerificationError, match="not hexadecimal"):
        verify_nylas_signature(NYLAS_BODY, "é" * 64, NYLAS_SECRET)


def test_nylas_missing_or_empty_header_rejected() -> None:
    with pytest.raises(WebhookVerificationError, match="missing x-nylas-signature header"):
        verify_nylas_signature(NYLAS_BODY, None, NYLAS_SECRET)
    with pytest.raises(WebhookVerificationError, match="x-nylas-signature header is empty"):
        verify_nylas_signature(NYLAS_BODY, " ", NYLAS_SECRET)


def test_nylas_errors_do_not_leak_secret_or_expected_signature() -> None:
    expected = sign_nylas(NYLAS_BODY, NYLAS_SECRET)
    with pytest.raises(WebhookVerificationError) as info:
        verify_nylas_signature(NYLAS_BODY, "0" * 64, NYLAS_SECRET)
    assert NYLAS_SECRET not in str(info.value)
    assert expected not in str(info.value)


def test_nylas_empty_secret_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="webhook secret is empty") as info:
        verify_nylas_signature(NYLAS_BODY, "0" * 64, "")
    assert not isinstance(info.value, WebhookVerificationError)


def test_nylas_text_body_is_a_type_error() -> None:
    signature = sign_nylas(NYLAS_BODY, NYLAS_SECRET)
    with pytest.raises(TypeError, match="bytes"):
        verify_nylas_signature(NYLAS_BODY.decode(), signature, NYLAS_SECRET)  # type: ignore[arg-type]


def test_nylas_bytearray_and_memoryview_bodies_accepted() -> None:
    signature = sign_nylas(NYLAS_BODY, NYLAS_SECRET)
    verify_nylas_signature(bytearray(NYLAS_BODY), signature, NYLAS_SECRET)
    verify_nylas_signature(memoryview(NYLAS_BODY), signature, NYLAS_SECRET)


# -------------------------------------------------------------------------- challenge


def test_challenge_is_echoed_exactly() -> None:
    assert nylas_challenge_response({"challenge": "bc609b38-c81f-47fb-a275-1d9bd61be301"}) == (
        "bc609b38-c81f-47fb-a275-1d9bd61be301"
    )
    assert nylas_challenge_response({"challenge": " a+b/c= "}) == " a+b/c= "
    assert nylas_challenge_response({"challenge": "x" * 1024}) == "x" * 1024


def test_challenge_absent_returns_none() -> None:
    assert nylas_challenge_response({}) is None
    assert nylas_challenge_response({"other": "value"}) is None
    assert nylas_challenge_response({"Challenge": "value"}) is None  # query keys are case-sensitive


def test_challenge_too_long_rejected() -> None:
    with pytest.raises(WebhookVerificationError, match="1025 characters long, more than the 1024 allowed"):
        nylas_challenge_response({"challenge": "x" * 1025})


def test_challenge_empty_or_not_a_string_rejected() -> None:
    with pytest.raises(WebhookVerificationError, match="is empty"):
        nylas_challenge_response({"challenge": ""})
    with pytest.raises(WebhookVerificationError, match="single string, not list"):
        nylas_challenge_response({"challenge": ["a", "b"]})  # type: ignore[dict-item]


# ---------------------------------------------------------------- property-based tests


def _flip(body: bytes, index: int, mask: int) -> bytes:
    altered = bytearray(body)
    altered[index % len(body)] ^= mask
    return bytes(altered)


@settings(database=None, max_examples=200, deadline=None)
@given(
    body=st.binary(min_size=1, max_size=2048),
    secret=st.one_of(st.text(min_size=1), st.binary(min_size=1)),
    index=st.integers(min_value=0),
    mask=st.integers(min_value=1, max_value=255),
)
def test_nylas_sign_then_verify_and_any_flipped_byte_fails(
    body: bytes, secret: str | bytes, index: int, mask: int
) -> None:
    signature = sign_nylas(body, secret)
    verify_nylas_signature(body, signature, secret)
    with pytest.raises(WebhookVerificationError, match="does not match"):
        verify_nylas_signature(_flip(body, index, mask), signature, secret)


@settings(database=None, max_examples=200, deadline=None)
@given(
    body=st.binary(min_size=1, max_size=2048),
    key=st.binary(min_size=1, max_size=64),
    msg_id=st.text(alphabet=st.characters(codec="ascii", categories=["L", "N", "P"]), min_size=1),
    timestamp=st.integers(min_value=0, max_value=2**40),
    index=st.integers(min_value=0),
    mask=st.integers(min_value=1, max_value=255),
)
def test_standard_sign_then_verify_and_any_flipped_byte_fails(
    body: bytes, key: bytes, msg_id: str, timestamp: int, index: int, mask: int
) -> None:
    secret = "whsec_" + base64.b64encode(key).decode()
    signature = sign_standard_webhook(body, msg_id=msg_id, timestamp=timestamp, secret=secret)
    headers = sw_headers(signature, msg_id=msg_id, ts=timestamp)
    verify_standard_webhook(body, headers, secret, now=timestamp)
    with pytest.raises(WebhookVerificationError, match="matches the request"):
        verify_standard_webhook(_flip(body, index, mask), headers, secret, now=timestamp)


# --------------------------------------------------------------------------- envelope


def message_envelope(
    type_: str = "message.created", *, notification_id: str = "notif-1", **obj_extra: Any
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": "msg-1",
        "grant_id": "grant-1",
        "thread_id": "thread-1",
        "object": "message",
        "subject": "Quarterly numbers",
        "from": [{"name": "Ada", "email": "ada@example.com"}],
        "date": 1723821980,
        **obj_extra,
    }
    return {
        "specversion": "1.0",
        "type": type_,
        "source": "/google/emails/realtime",
        "id": notification_id,
        "time": 1723821985,
        "webhook_delivery_attempt": 1,
        "data": {"application_id": "app-1", "object": obj},
    }


def test_parse_message_created_from_bytes() -> None:
    note = parse_notification(json.dumps(message_envelope()).encode())
    assert note.notification_id == "notif-1"
    assert note.type == "message.created"
    assert note.base_type == "message.created"
    assert note.variant is NotificationVariant.FULL
    assert note.object_kind == "message"
    assert note.action == "created"
    assert note.source == "/google/emails/realtime"
    assert note.specversion == "1.0"
    assert note.time == 1723821985
    assert note.delivery_attempt == 1
    assert note.application_id == "app-1"
    assert note.object_id == "msg-1"
    assert note.message_id == "msg-1"
    assert note.grant_id == "grant-1"
    assert note.mailbox == "grant-1"
    assert note.thread_id == "thread-1"
    assert note.is_message_event
    assert note.object["subject"] == "Quarterly numbers"
    assert note.object["from"] == [{"name": "Ada", "email": "ada@example.com"}]
    assert note.raw["data"]["application_id"] == "app-1"


def test_parse_accepts_str_and_mapping() -> None:
    envelope = message_envelope()
    from_str = parse_notification(json.dumps(envelope))
    from_mapping = parse_notification(envelope)
    assert from_str == from_mapping
    assert from_str.notification_id == from_mapping.notification_id == "notif-1"


def test_message_updated_is_a_different_notification_for_the_same_message() -> None:
    created = parse_notification(message_envelope("message.created", notification_id="notif-1"))
    updated = parse_notification(
        message_envelope("message.updated", notification_id="notif-2", unread=False, folders=["INBOX"])
    )
    assert updated.action == "updated"
    assert updated.base_type == "message.updated"
    assert updated.variant is NotificationVariant.FULL
    # Same message to claim, different deliveries to dedup.
    assert created.message_id == updated.message_id == "msg-1"
    assert created.notification_id != updated.notification_id


@pytest.mark.parametrize(
    ("type_", "base_type", "variant"),
    [
        ("message.created.truncated", "message.created", NotificationVariant.TRUNCATED),
        ("message.updated.truncated", "message.updated", NotificationVariant.TRUNCATED),
        ("message.created.cleaned", "message.created", NotificationVariant.CLEANED),
        ("message.created.transformed", "message.created", NotificationVariant.TRANSFORMED),
    ],
)
def test_parse_variants(type_: str, base_type: str, variant: NotificationVariant) -> None:
    note = parse_notification(message_envelope(type_))
    assert note.type == type_
    assert note.base_type == base_type
    assert note.variant is variant
    assert note.object_kind == "message"
    assert note.action == base_type.split(".")[1]
    assert note.message_id == "msg-1"


def test_parse_thread_event() -> None:
    envelope = {
        "specversion": "1.0",
        "type": "thread.replied",
        "source": "/com/nylas/tracking",
        "id": "notif-thread",
        "time": 1723821990,
        "data": {
            "application_id": "app-1",
            "object": {
                "message_id": "msg-9",
                "root_message_id": "msg-1",
                "grant_id": "grant-1",
                "thread_id": "thread-1",
                "label": "follow-up",
                "reply_data": {"count": 1},
            },
        },
    }
    note = parse_notification(envelope)
    assert note.object_kind == "thread"
    assert note.action == "replied"
    assert note.variant is NotificationVariant.FULL
    assert not note.is_message_event
    assert note.message_id is None
    assert note.object_id is None
    assert note.thread_id == "thread-1"
    assert note.mailbox == "grant-1"
    assert note.delivery_attempt is None
    assert note.object["root_message_id"] == "msg-1"


def test_parse_grant_event_without_object_id() -> None:
    envelope = {
        "specversion": "1.0",
        "type": "grant.expired",
        "source": "/nylas/system",
        "id": "notif-grant",
        "time": 1723821995,
        "webhook_delivery_attempt": 3,
        "data": {
            "application_id": "app-1",
            "object": {"code": 25009, "grant_id": "grant-1", "integration_id": "int-1", "provider": "google"},
        },
    }
    note = parse_notification(json.dumps(envelope).encode())
    assert note.object_kind == "grant"
    assert note.action == "expired"
    assert note.base_type == "grant.expired"
    assert note.object_id is None
    assert note.message_id is None
    assert note.grant_id == note.mailbox == "grant-1"
    assert note.thread_id is None
    assert note.delivery_attempt == 3
    assert not note.is_message_event


def test_parse_is_lenient_on_extra_and_absent_optional_fields() -> None:
    envelope = {"id": "n", "type": "grant.deleted", "data": {}, "extension": {"x": 1}}
    note = parse_notification(envelope)
    assert note.source is None
    assert note.specversion is None
    assert note.time is None
    assert note.application_id is None
    assert note.object == {}
    assert note.raw["extension"] == {"x": 1}
    nulls = {"id": "n", "type": "grant.deleted", "source": None, "time": None, "data": {"object": None}}
    assert parse_notification(nulls).object == {}


def test_notification_is_frozen_hashable_and_isolated_from_input() -> None:
    envelope = message_envelope()
    note = parse_notification(envelope)
    with pytest.raises(dataclasses.FrozenInstanceError):
        note.notification_id = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        note.object["id"] = "other"  # type: ignore[index]
    envelope["data"]["object"]["id"] = "changed"
    assert note.object_id == "msg-1"
    assert note.object["id"] == "msg-1"
    assert isinstance(hash(note), int)
    assert "Quarterly" not in repr(note)  # raw and object stay out of the repr


def test_notification_constructor_is_typed() -> None:
    fields = {f.name for f in dataclasses.fields(Notification)}
    assert {"notification_id", "object_id", "grant_id", "thread_id", "variant", "raw", "object"} <= fields


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda e: e.pop("id"), "notification envelope has no top-level 'id'"),
        (lambda e: e.update(id=""), "notification top-level 'id' is empty"),
        (lambda e: e.update(id=42), "notification top-level 'id' must be a string, not a number"),
        (lambda e: e.pop("type"), "notification envelope has no top-level 'type'"),
        (lambda e: e.update(type=None), "notification envelope has no top-level 'type'"),
        (lambda e: e.update(type="message"), "is not of the form '<object>.<action>"),
        (lambda e: e.update(type="message..created"), "is not of the form"),
        (lambda e: e.pop("data"), "notification envelope has no top-level 'data' object"),
        (lambda e: e.update(data=[1]), "notification 'data' must be an object, not an array"),
        (lambda e: e.update(data="x"), "notification 'data' must be an object, not a string"),
        (lambda e: e["data"].update(object=[]), "notification 'data.object' must be an object, not an array"),
        (lambda e: e["data"]["object"].pop("id"), r"no 'data.object.id' \(required for message.created"),
        (lambda e: e["data"]["object"].update(id=7), "'data.object.id' must be a string, not a number"),
        (lambda e: e["data"]["object"].update(grant_id=True), "'data.object.grant_id' must be a string"),
        (lambda e: e.update(time="yesterday"), "top-level 'time' must be an integer, not a string"),
        (lambda e: e.update(time=True), "top-level 'time' must be an integer, not a boolean"),
        (lambda e: e.update(webhook_delivery_attempt=1.5), "'webhook_delivery_attempt' must be an integer"),
    ],
)
def test_envelope_errors_name_the_field(mutate: Any, message: str) -> None:
    envelope = message_envelope()
    mutate(envelope)
    with pytest.raises(NotificationError, match=message):
        parse_notification(json.dumps(envelope).encode())


def test_truncated_message_without_id_is_rejected() -> None:
    envelope = message_envelope("message.updated.truncated")
    del envelope["data"]["object"]["id"]
    with pytest.raises(NotificationError, match=r"required for message.updated notifications"):
        parse_notification(envelope)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "notification body is not valid JSON"),
        (b"not json", "notification body is not valid JSON"),
        (b'{"id": "n", ', "notification body is not valid JSON"),
        (b"\xff\xfe\x00garbage", "notification body is not valid JSON"),
        (b"[]", "notification body must be a JSON object, not an array"),
        (b"null", "notification body must be a JSON object, not null"),
        ("42", "notification body must be a JSON object, not a number"),
    ],
)
def test_non_json_or_non_object_body(body: bytes | str, message: str) -> None:
    with pytest.raises(NotificationError, match=message):
        parse_notification(body)


def test_deeply_nested_body_is_an_envelope_error() -> None:
    with pytest.raises(NotificationError):
        parse_notification(b"[" * 100_000 + b"]" * 100_000)


def test_envelope_error_is_a_value_error() -> None:
    assert issubclass(NotificationError, ValueError)
    assert issubclass(WebhookVerificationError, ValueError)


def test_verify_then_parse_round_trip() -> None:
    signature = sign_nylas(NYLAS_BODY, NYLAS_SECRET)
    verify_nylas_signature(NYLAS_BODY, signature, NYLAS_SECRET)
    note = parse_notification(NYLAS_BODY)
    assert note.notification_id == "notif-1"
    assert note.message_id == "msg-1"
    assert note.object["subject"] == "Hello été"

"""The store's contract values that need no etcd: page cursors and the error -> status mapping."""

from __future__ import annotations

import base64

import grpc
import pytest

from coordinator.api.status import status_code
from coordinator.core.domain import Subject, SubjectKind
from coordinator.core.errors import CoordinatorError, InvalidArgument, StoreUnavailable
from coordinator.core.storage import decode_cursor, encode_cursor


def test_cursor_round_trips_any_subject_id() -> None:
    for subject_id in ("m-1", "a/b%c", "ünï cödé", ":", ""):
        subject = Subject("box/1", SubjectKind.THREAD, subject_id)
        cursor = encode_cursor(subject)
        assert cursor.startswith("v1:")
        assert decode_cursor(cursor, "box/1") == subject


def test_cursor_does_not_show_the_key_layout() -> None:
    assert b"m/" not in base64.urlsafe_b64decode(encode_cursor(Subject("box", SubjectKind.MESSAGE, "m")) + "==")


@pytest.mark.parametrize(
    "cursor",
    [
        "garbage",
        "v2:" + encode_cursor(Subject("box", SubjectKind.MESSAGE, "m"))[3:],
        "v1:not base64!",
        "v1:" + base64.urlsafe_b64encode(b'["box", "nokind", "m"]').decode(),
        "v1:" + base64.urlsafe_b64encode(b'{"mailbox": "box"}').decode(),
        # what a coordinator before versioned cursors issued: a base64 etcd key
        base64.urlsafe_b64encode(b"inbox-coordinator/v1/m/box/s/m/m").decode(),
    ],
)
def test_a_cursor_not_issued_here_is_invalid_argument(cursor: str) -> None:
    with pytest.raises(InvalidArgument, match="start without one") as raised:
        decode_cursor(cursor, "box")
    assert raised.value.field == "page_token"


def test_a_cursor_of_another_mailbox_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="does not belong to this mailbox"):
        decode_cursor(encode_cursor(Subject("other", SubjectKind.MESSAGE, "m")), "box")


def test_a_subclass_of_an_error_answers_as_its_parent() -> None:
    class EtcdDown(StoreUnavailable):
        pass

    class Unclassified(CoordinatorError):
        pass

    assert status_code(EtcdDown("etcd is down")) is grpc.StatusCode.UNAVAILABLE
    assert status_code(InvalidArgument("page_token", "bad")) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_code(Unclassified("no status of its own")) is grpc.StatusCode.INTERNAL

"""What the etcd store reads of a record without decoding it (coordinator/store/etcd/codec.py): a subject's state
(a listing filtered by state) and whether a delivery may hold a text (a search of recent messages). Never a
different answer than decoding gives: a state always the record's, a text never missed."""

from __future__ import annotations

import json

import pytest

from coordinator.core.domain import DeliveryRecord, HolderKind, State, Subject, SubjectKind, SubjectRecord, Summary
from coordinator.store.etcd import codec


@pytest.mark.parametrize("state", [State.CLAIMED, State.SENDING, State.REPLIED, State.IN_DOUBT])
def test_the_state_read_without_decoding_is_the_records(state: State) -> None:
    record = SubjectRecord(state, "agent-a", HolderKind.AGENT, 1, 60, expires_ms=2, note='"s":"r"')
    assert codec.state_of(codec.encode_record(record)) is state


def test_a_value_of_another_shape_is_decoded_whole() -> None:
    spaced = json.dumps({"h": "agent-a", "s": "d", "k": "a"}).encode()  # "s" not first, with spaces
    assert codec.state_of(spaced) is State.IN_DOUBT


@pytest.mark.parametrize(
    ("query", "holds"),
    [
        ("rückerstattung", True),
        ("ZOË".casefold(), True),
        ("strasse", True),  # "Straße" casefolds to "strasse"
        ("m-42", True),  # the subject id
        ('say "hi"', True),  # JSON escapes the quotes: not tested on the bytes, left to the caller
        ("back\\slash", True),
        ("parcel", False),
    ],
)
def test_a_delivery_may_hold_a_text_exactly_when_its_fields_do(query: str, holds: bool) -> None:
    summary = Summary('Rückerstattung für Straße, say "hi", back\\slash', "Zoë <z@example.org>", None)
    delivery = DeliveryRecord(
        "mb", "n-1", "agent-a", 1, "r", Subject("mb", SubjectKind.MESSAGE, "m-42"), None, "", summary
    )
    assert codec.may_contain(codec.encode_delivery(delivery), query) is holds

"""Named limits on every field, and ids that cannot escape their place in the key space."""

from __future__ import annotations

import base64
import json
import urllib.request

import grpc
import pytest

from coordinator.api.quotas import QuotaSettings
from coordinator.core import limits
from coordinator.core.domain import Subject, SubjectKind
from coordinator.core.storage import encode_cursor
from coordinator.store.etcd.process import EtcdServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, message, new_request_id, rpc_error, thread

GRANTED = pb.ClaimReplyResponse.GRANTED

AWKWARD_IDS = [
    "a/b",
    "a%2Fb",
    "a%b",
    "../../etc",
    "s/m/x",
    "<CAFx=y+z@mail.gmail.com>",
    "ünïcødé-✉️-日本語",
    " spaces inside ",
    "x" * limits.SUBJECT_ID_MAX_BYTES,
    "é" * (limits.SUBJECT_ID_MAX_BYTES // 2),
]


def _etcd_keys(etcd: EtcdServer, prefix: str) -> list[bytes]:
    key = prefix.encode()
    body = json.dumps(
        {
            "key": base64.b64encode(key).decode(),
            "range_end": base64.b64encode(key[:-1] + bytes([key[-1] + 1])).decode(),
            "keys_only": True,
        }
    ).encode()
    request = urllib.request.Request(f"{etcd.client_url}/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        kvs = json.load(response).get("kvs", [])
    return [base64.b64decode(kv["key"]) for kv in kvs]


async def test_awkward_ids_are_distinct_subjects_inside_the_prefix(
    agent: Actor, mailbox: str, etcd: EtcdServer, prefix: str
) -> None:
    for subject_id in AWKWARD_IDS:
        response = await agent.claim(message(mailbox, subject_id))
        assert response.result == GRANTED, subject_id
        assert response.status.subject.id == subject_id
    # The mailbox name itself may hold the separators too.
    assert (await agent.claim(message(mailbox + "/s/m", "x"))).result == GRANTED
    keys = _etcd_keys(etcd, prefix)
    assert len(keys) == len(AWKWARD_IDS) + 1
    # Each id maps to exactly one key, all under the prefix, none nested in another's path.
    for key in keys:
        assert key.startswith(prefix.encode())
        assert key[len(prefix) :].count(b"/") == 4  # m/<mailbox>/s/<kind>/<id>
    listing = await agent.list(mailbox)
    assert sorted(s.subject.id for s in listing.subjects) == sorted(AWKWARD_IDS)
    for subject_id in AWKWARD_IDS:
        assert (await agent.status(message(mailbox, subject_id))).holder == "agent-a"


@pytest.mark.parametrize(
    ("subject", "field", "words"),
    [
        (pb.Subject(mailbox="", kind=pb.SUBJECT_KIND_MESSAGE, id="m"), "subject.mailbox", "required"),
        (pb.Subject(mailbox="mb", kind=pb.SUBJECT_KIND_MESSAGE, id=""), "subject.id", "required"),
        (pb.Subject(mailbox="mb", kind=pb.SUBJECT_KIND_UNSPECIFIED, id="m"), "subject.kind", "MESSAGE"),
        (pb.Subject(mailbox="mb", kind=pb.SUBJECT_KIND_MESSAGE, id="x" * 513), "subject.id", "512 bytes"),
        (pb.Subject(mailbox="mb", kind=pb.SUBJECT_KIND_MESSAGE, id="é" * 257), "subject.id", "512 bytes"),
        (pb.Subject(mailbox="m" * 321, kind=pb.SUBJECT_KIND_MESSAGE, id="m"), "subject.mailbox", "320 bytes"),
        (pb.Subject(mailbox="mb", kind=pb.SUBJECT_KIND_MESSAGE, id="a\nb"), "subject.id", "control character"),
        (pb.Subject(mailbox="mb", kind=pb.SUBJECT_KIND_MESSAGE, id="a\x00b"), "subject.id", "control character"),
        (pb.Subject(mailbox="m\x7fb", kind=pb.SUBJECT_KIND_MESSAGE, id="m"), "subject.mailbox", "control character"),
    ],
)
async def test_bad_subjects_are_invalid_arguments(
    agent: Actor, etcd: EtcdServer, prefix: str, subject: pb.Subject, field: str, words: str
) -> None:
    error = await rpc_error(agent.claim(subject))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.details() or ""
    assert details.startswith(field), details
    assert words in details
    assert _etcd_keys(etcd, prefix) == [], "nothing was written for a refused request"


async def test_ttl_limits(agent: Actor, mailbox: str) -> None:
    # The test server's minimum is 2 s (see conftest); the maximum is the product's, 3600 s.
    for ttl in (1, 3601, 100_000):
        error = await rpc_error(agent.claim(message(mailbox, f"ttl-{ttl}"), ttl=ttl))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith("ttl_seconds")
        assert "2..3600" in (error.details() or "")
    assert (await agent.claim(message(mailbox, "max"), ttl=3600)).status.ttl_seconds == 3600
    default = await agent.claim(message(mailbox, "default"))
    assert default.status.ttl_seconds == 60
    error = await rpc_error(agent.renew(message(mailbox, "max"), 1, ttl=4000))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_other_field_limits(agent: Actor, channel: grpc.aio.Channel, mailbox: str) -> None:
    subject = message(mailbox, "m")
    cases = [
        (agent.claim(subject, note="n" * 1025), "note", "1024 bytes"),
        (agent.claim(subject, notification_id="n" * 257), "notification_id", "256 bytes"),
        (agent.claim(subject, request_id="r" * 129), "request_id", "128 bytes"),
        (agent.record_delivery(mailbox, ""), "notification_id", "required"),
        (agent.renew(subject, 0), "fencing_token", "required"),
        (agent.list(mailbox, page_size=1001), "page_size", "1000"),
        (agent.list(mailbox, page_token="not base64!"), "page_token", "start without one"),
        (agent.list(mailbox, page_token="YWJj"), "page_token", "start without one"),
        (agent.list(mailbox, page_token="v1:YWJj"), "page_token", "start without one"),
        (
            agent.list(mailbox, page_token=encode_cursor(Subject(mailbox + "-other", SubjectKind.MESSAGE, "m"))),
            "page_token",
            "does not belong to this mailbox",
        ),
        (Actor(channel, "p" * 129).claim(subject), "principal", "128 bytes"),
        (agent.recent(mailbox, query="q" * 257), "query", "256 bytes"),
        (agent.recent(mailbox, query="a\x07b"), "query", "control character"),
        (agent.recent(mailbox, page_size=101), "page_size", "100"),
        (Actor(channel, "ana", kind="human").takeover(subject, from_person="p" * 129), "from_person", "128 bytes"),
        (Actor(channel, "ana", kind="robot").claim(subject), "x-inbox-principal-kind", "'agent' or 'human'"),
    ]
    for call, field, words in cases:
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert (error.details() or "").startswith(field), error.details()
        assert words in (error.details() or ""), error.details()
    assert (await agent.status(subject)).state == pb.SUBJECT_STATE_FREE


async def test_thread_and_outgoing_field_limits(agent: Actor, mailbox: str) -> None:
    """ClaimReply's thread and received time, and every field of RecordOutgoing, each with its named limit."""
    from google.protobuf.timestamp_pb2 import Timestamp

    def at(seconds: int, nanos: int = 0) -> Timestamp:
        return Timestamp(seconds=seconds, nanos=nanos)

    def claim(subject: pb.Subject, **fields: object) -> pb.ClaimReplyRequest:
        return pb.ClaimReplyRequest(request_id="r-claim", subject=subject, **fields)  # type: ignore[arg-type]

    def outgoing(**fields: object) -> pb.RecordOutgoingRequest:
        request: dict[str, object] = {
            "request_id": "r-out",
            "mailbox": mailbox,
            "message_id": "gmail-1",
            "thread_id": "t-1",
            "sent_at": at(1_700_000_000),
        }
        return pb.RecordOutgoingRequest(**(request | fields))  # type: ignore[arg-type]

    subject = message(mailbox, "m")
    too_long = "x" * (limits.THREAD_ID_MAX_BYTES + 1)
    cases = [
        (claim(subject, thread_id=too_long, received_at=at(1)), "thread_id", f"{limits.THREAD_ID_MAX_BYTES} bytes"),
        (claim(subject, thread_id="t-1"), "received_at", "required with thread_id"),
        (claim(subject, received_at=at(1)), "thread_id", "required with received_at"),
        (claim(subject, thread_id="t-1", received_at=at(-1)), "received_at", "before 1970"),
        (claim(subject, thread_id="t-1", received_at=at(1, -5)), "received_at.nanos", "0..999999999"),
        (claim(thread(mailbox, "t-1"), thread_id="t-2", received_at=at(1)), "thread_id", "another thread"),
        (outgoing(message_id=""), "message_id", "required"),
        (outgoing(message_id="x" * (limits.MESSAGE_ID_MAX_BYTES + 1)), "message_id", "512 bytes"),
        (outgoing(thread_id=""), "thread_id", "required"),
        (outgoing(thread_id=too_long), "thread_id", "512 bytes"),
        (outgoing(sent_at=None), "sent_at", "required"),
        (outgoing(sent_at=at(-60)), "sent_at", "before 1970"),
        (outgoing(sender="s" * (limits.SENDER_MAX_BYTES + 1)), "sender", "512 bytes"),
        (outgoing(sender="Ana\nLima"), "sender", "control character"),
        (outgoing(notification_id="n" * 257), "notification_id", "256 bytes"),
        (outgoing(mailbox=""), "mailbox", "required"),
    ]
    for request, field, words in cases:
        if isinstance(request, pb.ClaimReplyRequest):
            error = await rpc_error(agent.stub.ClaimReply(request, metadata=agent.metadata))
        else:
            assert isinstance(request, pb.RecordOutgoingRequest)
            error = await rpc_error(agent.stub.RecordOutgoing(request, metadata=agent.metadata))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error.details())
        assert (error.details() or "").startswith(field), error.details()
        assert words in (error.details() or ""), error.details()
    assert (await agent.status(subject)).state == pb.SUBJECT_STATE_FREE
    # At the limits, both are accepted.
    longest = "t" * limits.THREAD_ID_MAX_BYTES
    granted = await agent.stub.ClaimReply(claim(subject, thread_id=longest, received_at=at(0)), metadata=agent.metadata)
    assert granted.result == GRANTED
    answer = await agent.stub.RecordOutgoing(
        outgoing(thread_id=longest, sender="s" * limits.SENDER_MAX_BYTES), metadata=agent.metadata
    )
    assert answer.result == pb.RecordOutgoingResponse.ANSWERED_OUTSIDE
    assert [status.subject.id for status in answer.subjects] == ["m"]


async def test_missing_principal_is_unauthenticated(channel: grpc.aio.Channel, mailbox: str) -> None:
    from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

    stub = pb_grpc.CoordinatorStub(channel)
    error = await rpc_error(stub.ClaimReply(pb.ClaimReplyRequest(request_id="r", subject=message(mailbox, "m"))))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "x-inbox-principal" in (error.details() or "")


async def test_list_claims_pages_and_filters(agent: Actor, other_agent: Actor, mailbox: str) -> None:
    tokens = {}
    for n in range(25):
        subject = message(mailbox, f"m-{n:02d}")
        tokens[n] = (await agent.claim(subject)).status.fencing_token
    for n in range(0, 25, 5):
        await agent.begin(message(mailbox, f"m-{n:02d}"), tokens[n])
    await other_agent.claim(message(mailbox + "-other", "elsewhere"))

    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = await agent.list(mailbox, page_size=10, page_token=token)
        pages += 1
        assert len(page.subjects) <= 10
        seen.extend(s.subject.id for s in page.subjects)
        token = page.next_page_token
        if not token:
            break
    assert pages == 3
    assert seen == [f"m-{n:02d}" for n in range(25)]

    sending = await agent.list(mailbox, states=(pb.SUBJECT_STATE_SENDING,), page_size=2)
    collected = [s.subject.id for s in sending.subjects]
    while sending.next_page_token:
        sending = await agent.list(
            mailbox, states=(pb.SUBJECT_STATE_SENDING,), page_size=2, page_token=sending.next_page_token
        )
        collected.extend(s.subject.id for s in sending.subjects)
    assert collected == [f"m-{n:02d}" for n in range(0, 25, 5)]
    assert all(s.state == pb.SUBJECT_STATE_SENDING for s in sending.subjects)


async def test_list_claims_by_state_reads_a_bounded_number_of_ranges_per_page(
    start_coordinator: StartCoordinator, mailbox: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ranges of 100 subjects, 5 a page: 2,500 subjects are 5 pages of 500 read, with one etcd read per range.
    monkeypatch.setattr(limits, "LIST_RANGE_SUBJECTS", 100)
    # No sweeper meanwhile: its reads of the SENDING index are etcd Range calls too.
    coordinator = await start_coordinator(quotas=QuotaSettings(calls_per_second=0), sweep_interval_s=3600)
    channel = grpc.aio.insecure_channel(coordinator.address)
    agent = Actor(channel, "agent-a")
    tokens: dict[int, int] = {}
    for start in range(0, 2500, 250):
        calls = [
            pb.BatchCall(
                claim_reply=pb.ClaimReplyRequest(request_id=new_request_id(), subject=message(mailbox, f"m-{n:04d}"))
            )
            for n in range(start, start + 250)
        ]
        answers = await agent.stub.Batch(pb.BatchRequest(calls=calls), metadata=agent.metadata)
        tokens.update({start + i: r.claim_reply.status.fencing_token for i, r in enumerate(answers.results)})
    sending = (7, 1234, 2499)
    for n in sending:
        await agent.begin(message(mailbox, f"m-{n:04d}"), tokens[n])

    def ranges_read() -> float:
        return (
            coordinator.metrics.value("inbox_coordinator_etcd_request_duration_seconds_count", {"method": "Range"}) or 0
        )

    for state, expected in (
        (pb.SUBJECT_STATE_SENDING, [f"m-{n:04d}" for n in sending]),
        (pb.SUBJECT_STATE_IN_DOUBT, []),
    ):
        found: list[str] = []
        pages = 0
        token = ""
        while True:
            before = ranges_read()
            page = await agent.list(mailbox, states=(state,), page_size=1, page_token=token)
            assert ranges_read() - before <= limits.LIST_RANGES_PER_PAGE
            pages += 1
            found.extend(s.subject.id for s in page.subjects)
            token = page.next_page_token
            if not token:
                break
        assert found == expected
        # A page ends when it is full or has read its 5 ranges: the walk takes at most 2,500 / 500 + one a hit.
        assert pages <= 5 + len(expected)
    await channel.close()

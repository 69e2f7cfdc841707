"""The language-neutral conformance vectors (conformance/*.json, docs/conformance.md): every case of every file,
checked against this client. The Node client's tests (clients/node/test/conformance.test.ts) run the same files,
so neither client's tests ask the other for an expected value.

Some of what the vectors pin down is reachable only through private modules (the summary and text cuts of the
guard, the retry decision, the Batch answer, the wire constants): those are imported from them, and nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from inbox_claims import Coordinator, RetryPolicy, Subject, asgi, nylas
from inbox_claims._automated import automated_reason
from inbox_claims._batch import MAX_BATCHES_IN_FLIGHT, answers
from inbox_claims._effects import Rpc, RpcFailure
from inbox_claims._guard import (
    REASON_MAX_BYTES,
    SUMMARY_SENDER_MAX_BYTES,
    SUMMARY_SUBJECT_LINE_MAX_BYTES,
    clean_text,
    summary_of,
)
from inbox_claims._message_ids import WHITESPACE
from inbox_claims._outgoing import (
    DEFAULT_SENT_FOLDERS,
    MAILBOX_ADDRESSES_ENV,
    SENT_FOLDERS_ENV,
    OutgoingMatch,
    OutgoingRules,
)
from inbox_claims._settings import SETTINGS
from inbox_claims._types import IDEMPOTENCY_KEY_PREFIX
from inbox_claims.errors import NotificationError, WebhookVerificationError
from inbox_claims.testing import sign_nylas, sign_standard_webhook
from inbox_claims.types import DEFAULT_TARGET, MessageSummary, SubjectKind, canonical_message_id, idempotency_key
from inbox_claims.webhooks import (
    ANSWERED_EVENTS,
    NYLAS_SIGNATURE_HEADER,
    Notification,
    nylas_challenge_response,
    parse_notification,
    verify_nylas_signature,
    verify_standard_webhook,
)
from inbox_wire import BATCH_MAX_CALLS, PRINCIPAL_KIND_METADATA, PRINCIPAL_METADATA, RETRY_AFTER_METADATA
from inbox_wire.v1 import coordinator_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
DIR = ROOT / "conformance"
PROTO = (ROOT / "proto" / "inbox" / "coordinator" / "v1" / "coordinator.proto").read_text()
FILES = sorted(path.name for path in DIR.glob("*.json"))
Case = dict[str, Any]


def load(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((DIR / name).read_text(encoding="utf-8"))
    return document


# -- idempotency_keys.json ------------------------------------------------------------------------------------


def idempotency_keys(case: Case) -> None:
    kind = SubjectKind(case["kind"])
    assert re.fullmatch(r"ic1-[0-9a-f]{64}", case["key"])
    assert idempotency_key(case["mailbox"], kind, case["id"]) == case["key"]
    assert Subject(case["mailbox"], kind, case["id"]).idempotency_key == case["key"]
    # The spelled-out steps must agree with the key too: they are what a third client implements from.
    data = bytes.fromhex(case["utf8"])
    assert case["canonical"].encode("utf-8", "surrogatepass") == data
    assert IDEMPOTENCY_KEY_PREFIX + hashlib.sha256(data).hexdigest() == case["key"]


# -- webhook_signatures.json ----------------------------------------------------------------------------------


def signature_call(case: Case) -> Any:
    operation, scheme = case["operation"], case["scheme"]
    if operation == "challenge":
        assert scheme == "nylas"
        return nylas_challenge_response(case["query"])
    body = case["body"].encode()
    if (operation, scheme) == ("sign", "nylas"):
        return sign_nylas(body, case["secret"])
    if (operation, scheme) == ("sign", "standard_webhooks"):
        return sign_standard_webhook(body, msg_id=case["msg_id"], timestamp=case["timestamp"], secret=case["secret"])
    if (operation, scheme) == ("verify", "nylas"):
        return verify_nylas_signature(body, case["header"], case["secret"])
    assert (operation, scheme) == ("verify", "standard_webhooks")
    tolerance = {} if case["tolerance"] is None else {"tolerance": case["tolerance"]}
    return verify_standard_webhook(body, case["headers"], case["secret"], now=case["now"], **tolerance)


def webhook_signatures(case: Case) -> None:
    try:
        outcome, message, value = "valid", None, signature_call(case)
    except WebhookVerificationError as error:
        outcome, message, value = "rejected", str(error), None
    except (ValueError, TypeError) as error:
        outcome, message, value = "misconfigured", str(error), None
    assert outcome == case["outcome"], message
    assert (case["message"] is None) == (outcome == "valid"), "a message is given exactly for a failure"
    if case["message"] is not None:
        assert message is not None
        assert case["message"] in message
    if case["operation"] == "sign":
        assert value == case["signature"]
        if case["scheme"] == "nylas" and value is not None:
            verify_nylas_signature(case["body"].encode(), value, case["secret"])
    if case["operation"] == "challenge":
        assert value == case["answer"]


# -- notifications.json and summaries.json --------------------------------------------------------------------


def summary_json(summary: MessageSummary | None) -> dict[str, Any] | None:
    if summary is None:
        return None
    received = summary.received_at
    return {
        "subject_line": summary.subject_line,
        "sender": summary.sender,
        "received_at": None if received is None else received.timestamp(),
    }


def notification_json(n: Notification) -> dict[str, Any]:
    return {
        "notification_id": n.notification_id,
        "type": n.type,
        "base_type": n.base_type,
        "variant": n.variant.value,
        "object_kind": n.object_kind,
        "action": n.action,
        "source": n.source,
        "specversion": n.specversion,
        "time": n.time,
        "delivery_attempt": n.delivery_attempt,
        "application_id": n.application_id,
        "object_id": n.object_id,
        "grant_id": n.grant_id,
        "thread_id": n.thread_id,
        "mailbox": n.mailbox,
        "message_id": n.message_id,
        "is_message_event": n.is_message_event,
        "answered": n.base_type in ANSWERED_EVENTS and n.is_message_event,
        "summary": summary_json(summary_of(n)),
    }


def notifications(case: Case) -> None:
    # A document is parsed as the decoded object and as its JSON text, which must give the same.
    body = case.get("body")
    inputs: list[Any] = (
        [body.encode()] if body is not None else [case["document"], json.dumps(case["document"]).encode()]
    )
    for raw in inputs:
        if "error" not in case:
            assert notification_json(parse_notification(raw)) == case["notification"]
            continue
        field, message = case["error"]["field"], case["error"]["message"]
        with pytest.raises(NotificationError) as raised:
            parse_notification(raw)
        assert message in str(raised.value)
        if field is not None:
            assert f"'{field}'" in str(raised.value)


def summaries(case: Case) -> None:
    if case["check"] == "summary":
        event = {"id": "conformance", "type": "message.created", "data": {"object": {"id": "m-1", **case["message"]}}}
        assert summary_json(summary_of(event)) == case["summary"]
    else:
        assert case["check"] == "text"
        cut = clean_text(case["text"], case["max_bytes"])
        assert cut == case["cut"]
        assert len(cut.encode()) == case["cut_bytes"]


# -- status_codes.json and backoff.json -----------------------------------------------------------------------


class Edge(random.Random):
    """A random source held at one end of every range, to see the bounds of a wait rather than one draw."""

    def __init__(self, *, high: bool) -> None:
        super().__init__(0)
        self.high = high

    def uniform(self, a: float, b: float) -> float:
        return b if self.high else a


def policy_of(policy: dict[str, Any]) -> RetryPolicy:
    return RetryPolicy(
        attempts=policy["attempts"],
        initial_backoff=policy["initial_backoff_ms"] / 1000,
        max_backoff=policy["max_backoff_ms"] / 1000,
        multiplier=policy["multiplier"],
    )


@contextlib.contextmanager
def client(retry: RetryPolicy | None = None) -> Iterator[Coordinator]:
    coordinator = Coordinator(principal="conformance", retry=retry)
    try:
        yield coordinator
    finally:
        coordinator.close()


def retry_delay_ms(
    coordinator: Coordinator,
    failure: RpcFailure,
    attempt: int,
    *,
    deadline_ms: float | None = None,
    edge: Edge | None = None,
) -> float | None:
    """The client's own decision after ``attempt`` failed attempts (its Core decides for both Python clients),
    its random draw held at one end by ``edge``."""
    if edge is not None:
        coordinator._core._rng = edge
    deadline = None if deadline_ms is None else time.monotonic() + deadline_ms / 1000
    delay = coordinator._core.retry_delay(failure, attempt, deadline)
    return None if delay is None else delay * 1000


def hint(retry_after_ms: int | None) -> float | None:
    return None if retry_after_ms is None else retry_after_ms / 1000


def hint_ms(failure: RpcFailure) -> int | None:
    return None if failure.retry_after is None else round(failure.retry_after * 1000)


class FakeRpcError(grpc.RpcError):
    """What grpc raises for a RESOURCE_EXHAUSTED call, with or without its retry-after-ms trailer."""

    def __init__(self, trailer: str | None) -> None:
        self.trailer = trailer

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "over the call rate"

    def trailing_metadata(self) -> Any:
        return () if self.trailer is None else ((RETRY_AFTER_METADATA, self.trailer),)


def status_codes(case: Case) -> None:
    if case.get("reason"):
        assert re.search(rf"\b{case['reason']}\b", PROTO), "the proto lists no such reason"
    if case["check"] == "decision":
        failure = RpcFailure(grpc.StatusCode[case["code"]], "details", hint(case["retry_after_ms"]))
        assert type(failure.error("ClaimReply", 1)).__name__ == case["error"]
    elif case["check"] == "trailer":
        failure = RpcFailure.from_grpc(FakeRpcError(case["trailer"]))
    else:
        assert case["check"] == "batch_error"
        error = pb.CallError(
            code=case["code_number"],
            message="details",
            retry_after_ms=case["call_error_retry_after_ms"],
            reason=case["reason"],
        )
        call = Rpc("ClaimReply", pb.ClaimReplyRequest(), 1.0)
        answered = answers([call, call], pb.BatchResponse(results=[pb.BatchResult(error=error)] * 2))[0]
        assert isinstance(answered, RpcFailure)
        failure = answered
    assert failure.code.name == case["code"]
    assert hint_ms(failure) == case["retry_after_ms"]
    with client() as coordinator:
        delay = retry_delay_ms(coordinator, failure, 1)
        assert (delay is not None) == case["retried"]
        if case["check"] != "decision":
            return
        assert (case["wait_ms"] is None) == (not case["retried"]), "a wait is given exactly for a retry"
        if delay is not None:
            least, most = case["wait_ms"]
            assert retry_delay_ms(coordinator, failure, 1, edge=Edge(high=False)) == pytest.approx(least, abs=1e-6)
            assert retry_delay_ms(coordinator, failure, 1, edge=Edge(high=True)) == pytest.approx(most, abs=1e-6)


def backoff(case: Case) -> None:
    unavailable = RpcFailure(grpc.StatusCode.UNAVAILABLE, "")
    if case["check"] == "invalid":
        with pytest.raises(ValueError, match="RetryPolicy"):
            policy_of(case["policy"])
    elif case["check"] == "waits":
        policy = policy_of(case["policy"])
        with client(policy) as coordinator:
            for wait in case["waits"]:
                retry, least, most = wait["retry"], wait["min_ms"], wait["max_ms"]
                assert policy.backoff(retry, Edge(high=False)) * 1000 == pytest.approx(least, abs=1e-6)
                assert policy.backoff(retry, Edge(high=True)) * 1000 == pytest.approx(most, abs=1e-6)
                # The client waits the policy's backoff for that retry: retry n follows attempt n + 1.
                low = retry_delay_ms(coordinator, unavailable, retry + 1, edge=Edge(high=False))
                high = retry_delay_ms(coordinator, unavailable, retry + 1, edge=Edge(high=True))
                assert (low, high) == pytest.approx((least, most), abs=1e-6)
            last = case["gives_up_after_attempt"]
            for attempt in range(1, last + 2):
                assert (retry_delay_ms(coordinator, unavailable, attempt) is not None) == (attempt < last), attempt
    else:
        assert case["check"] == "deadline"
        failure = RpcFailure(grpc.StatusCode[case["code"]], "", hint(case["retry_after_ms"]))
        with client() as coordinator:
            retried = retry_delay_ms(coordinator, failure, 1, deadline_ms=case["deadline_in_ms"]) is not None
            assert retried == case["retried"]


# -- outgoing.json --------------------------------------------------------------------------------------------


def outgoing(case: Case) -> None:
    settings, expected = case["settings"], case["match"]
    rules = OutgoingRules.of(settings["sent_folders"], settings["mailbox_addresses"])
    assert rules.match(case["message"]) == (None if expected is None else OutgoingMatch(**expected))


# -- automated.json -------------------------------------------------------------------------------------------


def automated(case: Case) -> None:
    reason = automated_reason(case["headers"], case["sender"], case.get("content_type"))
    assert reason == case["expect"]["reason"]
    assert (reason is not None) == case["expect"]["automated"]


# -- wire_constants.json --------------------------------------------------------------------------------------


def _client_option(name: str, *, from_env: bool = False) -> Any:
    made = Coordinator.from_env({"INBOX_PRINCIPAL": "conformance"}) if from_env else Coordinator(principal="x")
    try:
        return made.kind.value if name == "kind" else getattr(made._core.options, name)
    finally:
        made.close()


DEFAULT_RETRY = RetryPolicy()
CONSTANTS: dict[str, Callable[[], Any]] = {
    "principal_metadata_key": lambda: PRINCIPAL_METADATA,
    "principal_kind_metadata_key": lambda: PRINCIPAL_KIND_METADATA,
    "retry_after_metadata_key": lambda: RETRY_AFTER_METADATA,
    "batch_max_calls": lambda: BATCH_MAX_CALLS,
    "default_max_batch": lambda: _client_option("max_batch"),
    "max_batches_in_flight": lambda: MAX_BATCHES_IN_FLIGHT,
    "default_target": lambda: DEFAULT_TARGET,
    "default_call_timeout_ms": lambda: _client_option("timeout") * 1000,
    "from_env_call_timeout_ms": lambda: _client_option("timeout", from_env=True) * 1000,
    "from_env_kind": lambda: _client_option("kind", from_env=True),
    "environment_variables": lambda: {
        **{setting.name: setting.env for setting in SETTINGS},
        "sent_folders": SENT_FOLDERS_ENV,
        "mailbox_addresses": MAILBOX_ADDRESSES_ENV,
    },
    "default_retry_policy": lambda: {
        "attempts": DEFAULT_RETRY.attempts,
        "initial_backoff_ms": DEFAULT_RETRY.initial_backoff * 1000,
        "max_backoff_ms": DEFAULT_RETRY.max_backoff * 1000,
        "multiplier": DEFAULT_RETRY.multiplier,
    },
    "idempotency_key_prefix": lambda: IDEMPOTENCY_KEY_PREFIX,
    "nylas_max_idempotency_key_length": lambda: nylas.MAX_IDEMPOTENCY_KEY_LENGTH,
    "nylas_signature_header": lambda: NYLAS_SIGNATURE_HEADER,
    "nylas_default_api_base": lambda: nylas.DEFAULT_API_BASE,
    "nylas_send_timeout_ms": lambda: nylas.DEFAULT_TIMEOUT * 1000,
    "nylas_sent_folder_attribute": lambda: nylas.SENT_ATTRIBUTE,
    "default_sent_folders": lambda: sorted(DEFAULT_SENT_FOLDERS),
    "answered_events": lambda: sorted(ANSWERED_EVENTS),
    "webhook_max_body_bytes": lambda: asgi.DEFAULT_MAX_BODY_BYTES,
    "webhook_admission_timeout_ms": lambda: asgi.DEFAULT_ADMISSION_TIMEOUT * 1000,
    "summary_subject_line_max_bytes": lambda: SUMMARY_SUBJECT_LINE_MAX_BYTES,
    "summary_sender_max_bytes": lambda: SUMMARY_SENDER_MAX_BYTES,
    "note_max_bytes": lambda: REASON_MAX_BYTES,
}


def wire_constants(case: Case) -> None:
    assert case["name"] in CONSTANTS, f"this client has no constant {case['name']}"
    assert CONSTANTS[case["name"]]() == case["value"]
    assert case["meaning"]


# -- message_ids.json -----------------------------------------------------------------------------------------


def message_ids(case: Case) -> None:
    if "whitespace" in case:
        assert [f"U+{ord(character):04X}" for character in WHITESPACE] == case["whitespace"]
        return
    canonical = case["canonical"]
    assert canonical_message_id(case["id"]) == canonical
    # Where ids enter: a subject made for a message, and reply_to's (here without a call: its subject is made first).
    assert Subject.message("grant-1", case["id"]).id == canonical
    if canonical:
        with Coordinator("127.0.0.1:1", principal="conformance") as coord:  # no call is made: the subject is made first
            assert coord.reply_to(mailbox="grant-1", message_id=case["id"]).subject.id == canonical
    # Never applied to an id as the coordinator answered it (a subject read back from the wire).
    assert Subject("grant-1", SubjectKind.MESSAGE, case["id"]).id == case["id"]


# -- the runner -----------------------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Case], None]] = {
    "automated.json": automated,
    "backoff.json": backoff,
    "idempotency_keys.json": idempotency_keys,
    "message_ids.json": message_ids,
    "notifications.json": notifications,
    "outgoing.json": outgoing,
    "status_codes.json": status_codes,
    "summaries.json": summaries,
    "webhook_signatures.json": webhook_signatures,
    "wire_constants.json": wire_constants,
}


class Read(dict[str, Any]):
    """A case that remembers which of its fields were read: a field no check reads is a claim nothing tests."""

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        self.read = {"name"}

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


VECTORS = [(name, case) for name in FILES for case in load(name)["cases"]]


def test_every_vector_file_has_a_runner_here_and_every_runner_a_file() -> None:
    assert sorted(RUNNERS) == FILES


def test_every_constant_of_this_clients_table_is_named_by_wire_constants_json() -> None:
    assert sorted(CONSTANTS) == sorted(case["name"] for case in load("wire_constants.json")["cases"])


@pytest.mark.parametrize("name", FILES)
def test_a_vector_file_says_what_its_vectors_mean_and_names_each_case_once(name: str) -> None:
    document = load(name)
    assert sorted(document) == ["about", "cases"]
    assert len(document["about"]) > 100
    names = [case["name"] for case in document["cases"]]
    assert names
    assert len(set(names)) == len(names)


def test_the_outgoing_cases_cover_every_rule_and_both_answers() -> None:
    rules = {case["match"]["rule"] if case["match"] else None for case in load("outgoing.json")["cases"]}
    assert rules == {None, "sent_folder", "mailbox_address"}


def test_the_automated_cases_cover_every_rule_and_both_answers() -> None:
    reasons = {case["expect"]["reason"] for case in load("automated.json")["cases"]}
    rules = {None if reason is None else reason.split(" ")[0].rstrip(":") for reason in reasons}
    assert rules == {
        None,
        "Auto-Submitted",
        "Precedence",
        "List-Id",
        "List-Unsubscribe",
        "X-Autoreply",
        "X-Autorespond",
        "X-Auto-Response-Suppress",
        "delivery",
        "no-reply",
    }


@pytest.mark.parametrize(("name", "case"), VECTORS, ids=[f"{name}: {case['name']}" for name, case in VECTORS])
def test_a_vector(name: str, case: Case) -> None:
    read = Read(case)
    RUNNERS[name](read)
    assert sorted(set(case) - read.read) == [], "fields no check read"

"""The provider seam's vectors (conformance/providers/<name>/cases.json, docs/conformance.md): every case of every
provider, run against this client's provider with the case's API answers and cursor answers, no network and no
coordinator. The Node client's tests run the same files (clients/node/test/providers.conformance.test.ts)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inbox_claims._effects import Invoke, Sleep
from inbox_claims._guard import outgoing_of
from inbox_claims._outgoing import OutgoingRules
from inbox_claims.providers import PROVIDERS, Accepted, Answer, CursorRange, MessageFacts, WebhookRequest
from inbox_claims.providers._seam import Flow, HttpRequest, HttpResponse, RangesTaken

ROOT = Path(__file__).resolve().parents[2] / "conformance" / "providers"
NAMES = sorted(path.name for path in ROOT.iterdir() if path.is_dir())
Case = dict[str, Any]


def load(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((ROOT / name / "cases.json").read_text(encoding="utf-8"))
    return document


class FakeApi:
    """Answers the provider's requests from the case's ``api`` list, in order; anything else fails the case."""

    is_async = False

    def __init__(self, calls: list[dict[str, Any]]) -> None:
        self.calls = list(calls)

    def __call__(self, request: HttpRequest) -> HttpResponse:
        assert self.calls, f"the provider asked for {request.method} {request.full_url}, which the case does not list"
        expected = self.calls.pop(0)
        assert (request.method, request.url) == (expected["method"], expected["url"])
        for name, value in expected.get("query", {}).items():
            given = [v for k, v in request.params if k == name]
            assert given == (value if isinstance(value, list) else [value]), (name, request.params)
        for name, value in (expected.get("json") or {}).items():
            assert isinstance(request.json_body, dict), name
            assert request.json_body.get(name) == value, name
        return HttpResponse(expected["status"], json.dumps(expected["body"]).encode())


class FakeCursors:
    """Answers TakeCursorRange from the case's ``cursors`` and records the advances."""

    def __init__(self, answers: dict[str, dict[str, Any]]) -> None:
        self.answers = answers
        self.advanced: dict[str, dict[str, Any]] = {}

    def take(self, mailbox: str, name: str, through_position: int, ttl: int) -> Flow[CursorRange]:
        answer = self.answers[name]
        return CursorRange(answer["outcome"], answer.get("value", ""), answer.get("position", 0), token=7)
        yield

    def advance(self, mailbox: str, name: str, taken: CursorRange, value: str, position: int) -> Flow[bool]:
        self.advanced[name] = {"value": value, "position": position}
        return True
        yield


def run(flow: Flow[Any]) -> Any:
    answer: Any = None
    while True:
        try:
            effect = flow.send(answer)
        except StopIteration as done:
            return done.value
        if isinstance(effect, Invoke):
            answer = effect.fn(*effect.args, **effect.kwargs)
        elif isinstance(effect, Sleep):
            answer = None
        else:
            raise AssertionError(f"a provider's flow asked the coordinator directly: {effect!r}")


def facts_json(facts: MessageFacts) -> dict[str, Any]:
    return {
        "event": facts.event,
        "mailbox": facts.mailbox,
        "dedup_key": facts.dedup_key,
        "message_id": facts.message_id,
        "thread_id": facts.thread_id,
        "received_at": None if facts.received_at is None else int(facts.received_at.timestamp()),
        "sender": facts.sender,
        "subject_line": facts.subject_line,
        "from_addresses": list(facts.from_addresses),
        "folders": list(facts.folders),
        "outgoing": None if facts.outgoing is None else {"rule": facts.outgoing.rule, "value": facts.outgoing.value},
        "automated": facts.automated.why if facts.automated is not None and facts.automated.automated else None,
        "stamp": None if facts.stamp is None else {"key": facts.stamp.key, "token": facts.stamp.token},
        "reply": {
            "to": list(facts.reply.to),
            "subject": facts.reply.subject,
            "internet_message_id": facts.reply.internet_message_id,
            "references": list(facts.reply.references),
        },
    }


def provider_of(name: str, settings: dict[str, Any], api: FakeApi, now: float) -> Any:
    module, _, cls = PROVIDERS[name].partition(":")
    provider_class = getattr(importlib.import_module(module), cls)
    return provider_class.from_settings(settings, transport=api, clock=lambda: now)


def request_of(case: Case) -> WebhookRequest:
    spec = case["request"]
    if "body_text" in spec:
        body = spec["body_text"].encode()
    else:
        body = json.dumps(spec["body"], separators=(",", ":"), ensure_ascii=False).encode()
    return WebhookRequest(spec["method"], spec["query"], spec["headers"], body)


def vectors() -> Iterator[tuple[str, Case, dict[str, Any]]]:
    for name in NAMES:
        document = load(name)
        for case in document["cases"]:
            yield name, case, document["settings"]


@pytest.mark.parametrize(
    ("name", "case", "defaults"),
    list(vectors()),
    ids=lambda v: v["name"] if isinstance(v, dict) and "name" in v else None,
)
def test_a_provider_vector(name: str, case: Case, defaults: dict[str, Any]) -> None:
    settings = {**defaults, **case.get("settings", {})}
    api = FakeApi(case["api"])
    provider = provider_of(name, settings, api, case.get("now", 1796220300))
    verdict = run(provider.check(request_of(case)))
    expected = case["answer"]
    facts: list[dict[str, Any]] = []
    cursors = FakeCursors(case.get("cursors", {}))
    if isinstance(verdict, Accepted):
        batch = run(provider.open(verdict, cursors))
        rules = OutgoingRules.of(settings.get("sent_folders"), settings.get("mailbox_addresses"))
        for found in batch.facts:
            facts.append(facts_json(_with_outgoing(found, rules, provider.mailbox_addresses)))
        run(batch.commit())
        assert list(batch.actions) == case["actions"]
        verdict = provider.acknowledge()
    else:
        assert case["actions"] == []
    assert isinstance(verdict, Answer)
    assert verdict.status == expected["status"], verdict.body
    if expected["body"] is not None:
        assert verdict.body == expected["body"]
    assert facts == case["facts"]
    assert cursors.advanced == case["advance"]
    assert api.calls == [], f"the provider never asked for {api.calls}"


def _with_outgoing(facts: MessageFacts, rules: OutgoingRules, addresses: tuple[str, ...]) -> MessageFacts:
    import dataclasses

    return dataclasses.replace(facts, outgoing=outgoing_of(rules, facts, addresses))


def test_every_provider_folder_has_a_provider_here() -> None:
    assert sorted(PROVIDERS) == NAMES


def test_each_provider_file_says_what_it_means_and_names_each_case_once() -> None:
    for name in NAMES:
        document = load(name)
        assert len(document["about"]) > 200
        names = [case["name"] for case in document["cases"]]
        assert len(names) == len(set(names))


def test_a_failed_delivery_gives_back_only_the_ranges_it_took_and_did_not_advance() -> None:
    inner = FakeCursors(
        {
            "graph-delta:inbox": {"outcome": "TAKEN", "value": "link-1", "position": 3},
            "graph-delta:sentitems": {"outcome": "TAKEN", "value": "link-2", "position": 2},
            "gmail-history": {"outcome": "COVERED"},
        }
    )
    ranges = RangesTaken(inner)
    inbox = run(ranges.take("box", "graph-delta:inbox", 0, 60))
    run(ranges.take("box", "graph-delta:sentitems", 0, 60))
    run(ranges.take("box", "gmail-history", 9, 60))  # covered: nothing taken, nothing to give back
    run(ranges.advance("box", "graph-delta:inbox", inbox, "link-3", 4))  # this one was committed
    run(ranges.give_back())
    assert inner.advanced == {
        "graph-delta:inbox": {"value": "link-3", "position": 4},
        "graph-delta:sentitems": {"value": "link-2", "position": 2},  # given back at its start
    }
    inner.advanced.clear()
    run(ranges.give_back())  # nothing is given back twice
    assert inner.advanced == {}

"""The Gmail provider's key cache (no coordinator: the push's check alone): Google's keys are fetched once and kept;
a push signed by a key the cache does not hold fetches them again, at most once a minute, so that a rotation is
followed and a stream of pushes with unknown key ids does not become a stream of fetches."""

from __future__ import annotations

from inbox_claims.providers import Accepted, Answer, WebhookRequest
from inbox_claims.providers._httpx import drive
from inbox_claims.providers.gmail import GmailProvider
from tests.providers.fake_gmail import FakeGmail
from tests.providers.support import gmail_provider


def check(provider: GmailProvider, fake: FakeGmail) -> Answer | Accepted:
    headers, body = fake.push()
    answer: Answer | Accepted = drive(provider.check(WebhookRequest("POST", "", headers, body)), provider.transport)  # type: ignore[assignment]
    return answer


def test_keys_are_fetched_once_and_again_for_a_new_key_at_most_once_a_minute() -> None:
    now = [2_000_000_000.0]
    fake = FakeGmail(clock=lambda: now[0])
    provider = gmail_provider(fake, transport=fake.blocking(), clock=lambda: now[0])
    assert isinstance(check(provider, fake), Accepted)
    assert isinstance(check(provider, fake), Accepted)
    assert fake.calls["jwks"] == 1  # kept
    fake.rotate_key()
    now[0] += 30
    refused = check(provider, fake)  # fetched 30 s ago: not again yet; Pub/Sub delivers it again later
    assert isinstance(refused, Answer)
    assert (refused.status, fake.calls["jwks"]) == (401, 1)
    assert "unknown key" in refused.body
    now[0] += 31
    assert isinstance(check(provider, fake), Accepted)  # a minute on: fetched again, the new key found
    assert fake.calls["jwks"] == 2

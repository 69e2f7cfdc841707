"""AgentMail's and Resend's providers as an operator configures them: what is missing or wrong is said at start, with
the setting to fix, never on the first delivery; and what their sends refuse before any request."""

from __future__ import annotations

import pytest

from inbox_claims.providers import ClaimStamp, MessageFacts, ReplyContext
from inbox_claims.providers.agentmail import AgentMailProvider
from inbox_claims.providers.resend import ResendProvider, thread_of
from tests.providers.fake_agentmail import SECRET as AGENTMAIL_SECRET
from tests.providers.fake_resend import SECRET as RESEND_SECRET


def test_from_env_names_the_missing_setting() -> None:
    with pytest.raises(ValueError, match="set AGENTMAIL_API_KEY"):
        AgentMailProvider.from_env({"AGENTMAIL_WEBHOOK_SECRET": AGENTMAIL_SECRET})
    with pytest.raises(ValueError, match="set RESEND_MAILBOX"):
        ResendProvider.from_env({"RESEND_WEBHOOK_SECRET": RESEND_SECRET, "RESEND_API_KEY": "re_x"})
    made = ResendProvider.from_env(
        {"RESEND_WEBHOOK_SECRET": RESEND_SECRET, "RESEND_API_KEY": "re_x", "RESEND_MAILBOX": "help@shop.example"}
    )
    assert (made.sender, made.mailbox_addresses, made.api_base) == (
        "help@shop.example",
        ("help@shop.example",),
        "https://api.resend.com",
    )
    inboxes = AgentMailProvider.from_env(
        {"AGENTMAIL_WEBHOOK_SECRET": AGENTMAIL_SECRET, "AGENTMAIL_API_KEY": "am", "AGENTMAIL_INBOX_IDS": "a@x, b@x"}
    )
    assert inboxes.inbox_ids == {"a@x", "b@x"}


@pytest.mark.parametrize("secret", ["", "whsec_not base64!"])
def test_a_secret_that_is_no_svix_secret_is_refused_at_start(secret: str) -> None:
    with pytest.raises(ValueError, match="the AgentMail webhook secret is"):
        AgentMailProvider(secret, api_key="am")
    with pytest.raises(ValueError, match="the Resend webhook secret is"):
        ResendProvider(secret, "help@shop.example", api_key="re")


def test_an_empty_api_key_or_mailbox_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="api_key is empty"):
        AgentMailProvider(AGENTMAIL_SECRET, api_key="")
    with pytest.raises(ValueError, match="mailbox is empty"):
        ResendProvider(RESEND_SECRET, "", api_key="re")


def test_a_resend_reply_to_an_email_with_no_sender_is_refused_before_any_request() -> None:
    provider = ResendProvider(RESEND_SECRET, "help@shop.example", api_key="re")
    facts = MessageFacts("resend", "message.created", "help@shop.example", "msg_1", "e-1", None, None, "", "")
    with pytest.raises(ValueError, match="no sender address"):
        provider.payload(facts, "hello", ClaimStamp("ic1-" + "a" * 64, 3))


def test_a_resend_reply_is_threaded_and_tagged_with_tag_safe_values() -> None:
    provider = ResendProvider(RESEND_SECRET, "help@shop.example", api_key="re", sender="Shop <help@shop.example>")
    root = "<CAF=1@mail.example.org>"
    reply = ReplyContext(("bea@example.org",), "Re: Hi", "<CAF=2@mail.example.org>", (root,))
    facts = MessageFacts(
        "resend", "message.created", "help@shop.example", "msg_2", "e-2", thread_of(root), None, "", "", reply=reply
    )
    document = provider.payload(facts, "hello", ClaimStamp("ic1-" + "b" * 64, 12))
    assert document["headers"]["In-Reply-To"] == "<CAF=2@mail.example.org>"
    assert document["headers"]["References"] == f"{root} <CAF=2@mail.example.org>"
    assert document["headers"]["Auto-Submitted"] == "auto-replied"
    tags = {tag["name"]: tag["value"] for tag in document["tags"]}
    assert tags == {"inbox_claim": "ic1-" + "b" * 64 + "_12", "inbox_thread": thread_of(root)}
    assert all(c.isalnum() or c in "_-" for value in tags.values() for c in value)

"""The settings that decide which notifications are about a message the mailbox sent. The rules' cases are
shared with the Node client: conformance/outgoing.json, run by tests/client/test_conformance.py."""

from __future__ import annotations

import pytest

from inbox_claims import AsyncCoordinator, Coordinator
from inbox_claims._outgoing import DEFAULT_SENT_FOLDERS, OutgoingMatch, OutgoingRules


def test_settings_come_from_arguments_or_the_environment() -> None:
    rules = OutgoingRules.of(" Sent Items , INBOX.Sent,,", ["Support@Shop.example"])
    assert rules.sent_folders == DEFAULT_SENT_FOLDERS | {"Sent Items", "INBOX.Sent"}
    assert rules.mailbox_addresses == {"support@shop.example"}
    client = Coordinator.from_env(
        {
            "INBOX_PRINCIPAL": "agent-1",
            "INBOX_SENT_FOLDERS": "AAMkSent",
            "INBOX_MAILBOX_ADDRESSES": "support@shop.example,ana@shop.example",
        }
    )
    outgoing = client._core.options.outgoing
    assert outgoing.sent_folders == {"SENT", "AAMkSent"}
    assert outgoing.mailbox_addresses == {"support@shop.example", "ana@shop.example"}
    explicit = AsyncCoordinator(principal="agent-1", sent_folders=["Sent"], mailbox_addresses="a@b.example")
    assert explicit._core.options.outgoing == OutgoingRules.of(["Sent"], ["a@b.example"])
    assert Coordinator(principal="agent-1")._core.options.outgoing == OutgoingRules()


def test_a_bad_setting_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="mailbox_addresses: 'support' is not an email address"):
        Coordinator(principal="agent-1", mailbox_addresses="support")
    with pytest.raises(TypeError, match="sent_folders must be strings"):
        Coordinator(principal="agent-1", sent_folders=[3])  # type: ignore[list-item]


def test_the_reason_reads_as_a_sentence() -> None:
    assert str(OutgoingMatch("sent_folder", "SENT")) == "it is in the sent folder 'SENT'"
    assert str(OutgoingMatch("mailbox_address", "ana@shop.example")) == (
        "it is from the mailbox's own address 'ana@shop.example'"
    )

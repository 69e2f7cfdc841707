"""Which notifications are about a message the mailbox sent: never answered, reported to the coordinator instead.

Nylas sends ``message.created`` for every message of the mailbox, the ones it sends included: the agent's own
replies, and what people send from Gmail, Outlook or a helpdesk. A message is outgoing when

* one of its ``folders`` is a sent folder: Google's ``SENT`` label (always), or an id from the settings (for
  Microsoft and IMAP, folder ids are opaque or the server's folder names: the ids of the grant's folders whose
  ``attributes`` hold ``\\Sent``, as ``GET /v3/grants/{grant_id}/folders`` lists them; ``inbox_claims.nylas``'s
  ``sent_folder_ids`` fetches them); or
* one of its ``from`` addresses is one of the mailbox's own (compared without case).

The rules are data both clients share: conformance/outgoing.json holds the cases each client's tests run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["DEFAULT_SENT_FOLDERS", "OutgoingMatch", "OutgoingRules"]

DEFAULT_SENT_FOLDERS = frozenset({"SENT"})
"""Google's label id of sent mail: the same for every Gmail and Workspace grant."""

SENT_FOLDERS_ENV = "INBOX_SENT_FOLDERS"
MAILBOX_ADDRESSES_ENV = "INBOX_MAILBOX_ADDRESSES"


@dataclass(frozen=True, slots=True)
class OutgoingMatch:
    """Why a message is outgoing: the rule that matched and the folder id or address it matched on."""

    rule: Literal["sent_folder", "mailbox_address"]
    value: str

    def __str__(self) -> str:
        if self.rule == "sent_folder":
            return f"it is in the sent folder {self.value!r}"
        return f"it is from the mailbox's own address {self.value!r}"


def _normal_address(address: str) -> str:
    return address.strip().lower()


def split_setting(value: str | Iterable[str] | None, name: str) -> tuple[str, ...]:
    """A setting given as a comma-separated string (the environment) or as strings, without empty entries."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(item, str) for item in items):
        raise TypeError(f"{name} must be strings (or one comma-separated string), not {value!r}")
    return tuple(item.strip() for item in items if item.strip())


@dataclass(frozen=True, slots=True)
class OutgoingRules:
    """The client's settings for telling outgoing messages: sent folder ids (added to :data:`DEFAULT_SENT_FOLDERS`)
    and the mailbox's own addresses."""

    sent_folders: frozenset[str] = DEFAULT_SENT_FOLDERS
    mailbox_addresses: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls, sent_folders: str | Iterable[str] | None = None, mailbox_addresses: str | Iterable[str] | None = None
    ) -> OutgoingRules:
        folders = split_setting(sent_folders, "sent_folders")
        addresses = split_setting(mailbox_addresses, "mailbox_addresses")
        for address in addresses:
            if "@" not in address:
                raise ValueError(f"mailbox_addresses: {address!r} is not an email address")
        return cls(DEFAULT_SENT_FOLDERS | frozenset(folders), frozenset(_normal_address(a) for a in addresses))

    def judge(
        self, folders: Iterable[str], from_addresses: Iterable[str], more_addresses: Iterable[str] = ()
    ) -> OutgoingMatch | None:
        """Why a message is outgoing, from the neutral facts every provider gives (its folder or label ids, its
        sender addresses), or None when it is incoming. ``more_addresses``: the mailbox's addresses a provider knows
        besides the settings (Gmail's user). A claim stamp alone never makes a message outgoing: anyone can write
        the header into a mail they send (docs/design.md#providers)."""
        for folder in folders:
            if folder in self.sent_folders:
                return OutgoingMatch("sent_folder", folder)
        own = self.mailbox_addresses | {_normal_address(a) for a in more_addresses}
        for address in from_addresses:
            if _normal_address(address) in own:
                return OutgoingMatch("mailbox_address", _normal_address(address))
        return None

    def match(self, message: Mapping[str, Any]) -> OutgoingMatch | None:
        """Why the Nylas message object ``message`` is outgoing (its ``folders`` and ``from``), or None when it is
        incoming. Fields of another shape than Nylas documents are ignored, never an error."""
        folders = message.get("folders")
        senders = message.get("from")
        return self.judge(
            [f for f in folders if isinstance(f, str)] if isinstance(folders, list) else [],
            [
                s["email"]
                for s in (senders if isinstance(senders, list) else [])
                if isinstance(s, dict) and isinstance(s.get("email"), str)
            ],
        )

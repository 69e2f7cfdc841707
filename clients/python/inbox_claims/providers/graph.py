"""Microsoft 365 behind the provider seam: Graph change notifications in, ``createReply`` + ``send`` out
(docs/providers.md, "Microsoft 365"; the vectors: conformance/providers/graph). Needs ``httpx`` (the ``graph`` extra).

* The handshake: ``?validationToken=`` is echoed, decoded, as ``text/plain`` (on the notification and lifecycle URLs).
* Authenticity: every notification of the POST carries the subscription's ``clientState``, compared in constant time.
* A notification only names the message: it is read (immutable ids), and the dedup key is ``<id>@<change key>``.
* Lifecycle: ``reauthorizationRequired`` renews, ``subscriptionRemoved`` subscribes again, ``missed`` reads the Inbox
  and Sent Items by delta query from the delta links the coordinator keeps as cursors (``graph-delta:<folder>``); a
  first round (no link yet, or an expired one: 410) reads only the last day's messages.
* Send: ``createReply`` in MIME (base64, ``Content-Type: text/plain``: the only way Graph takes headers that are not
  ``X-`` ones, and an agent's reply says ``Auto-Submitted: auto-replied``; the draft carries ``In-Reply-To``,
  ``References`` and the claim's stamp, ``X-Inbox-Claim``; its immutable id is the id of its copy in Sent Items) then
  ``send`` (202).
"""

from __future__ import annotations

import base64
import hmac
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from .._errors import InboxClaimsError, SendRejected
from ._httpx import AsyncHttp, HttpTransport, current_stamp, drive
from ._seam import (
    STAMP_HEADER,
    Accepted,
    Answer,
    Automated,
    Batch,
    ClaimStamp,
    CursorRange,
    Cursors,
    Flow,
    HttpRequest,
    MessageFacts,
    ProviderError,
    ReplyContext,
    WebhookRequest,
    display,
    header,
    http,
    message_ids,
    newer_than,
    parse_stamp,
    reply_mime,
    reply_subject,
)

__all__ = ["DEFAULT_API_BASE", "GraphProvider", "GraphSendOutcomeUnknown", "GraphSendRejected"]

DEFAULT_API_BASE = "https://graph.microsoft.com/v1.0"
IMMUTABLE_IDS = ("Prefer", 'IdType="ImmutableId"')
SELECT = (
    "id,changeKey,conversationId,receivedDateTime,subject,from,replyTo,parentFolderId,internetMessageId,"
    "internetMessageHeaders"
)
FOLDERS = ("inbox", "sentitems")
# Outlook message subscriptions last at most 7 days; renewed for 3, well inside it.
SUBSCRIPTION_SECONDS = 3 * 24 * 3600
RANGE_TTL = 60
RESYNC_SECONDS = 24 * 3600
_EVENTS = {"created": "message.created", "updated": "message.updated"}


class GraphSendRejected(SendRejected):
    """Graph refused the draft or its send: nothing went out (``claim.send`` aborts: FREE)."""


class GraphSendOutcomeUnknown(InboxClaimsError):
    """The send may have gone out (a 5xx, a timeout): the subject stays SENDING, then IN_DOUBT, until its stamped
    copy in Sent Items settles it (RecordOutgoing) or a person does."""


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(int(seconds), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _received(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def _etag_key(etag: Any) -> str | None:
    if not isinstance(etag, str) or not etag:
        return None
    return etag.removeprefix("W/").strip('"') or None


class GraphProvider:
    """Microsoft Graph change notifications for one mailbox (``user``: its id or address)."""

    name = "graph"

    def __init__(
        self,
        client_state: str,
        user: str,
        *,
        token: str | Callable[[], str],
        api_base: str = DEFAULT_API_BASE,
        notification_url: str = "",
        lifecycle_url: str = "",
        subscription_ids: Sequence[str] = (),
        sent_items_folder_id: str | None = None,
        mailbox_addresses: Sequence[str] = (),
        transport: HttpTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not client_state or len(client_state) > 255:
            raise ValueError("client_state must be 1 to 255 characters (the clientState given when subscribing)")
        if not user:
            raise ValueError("user is empty: the Graph user id or address whose mailbox this is")
        self.client_state = client_state
        self.user = user
        self.token = token
        self.api_base = api_base.rstrip("/")
        self.notification_url = notification_url
        self.lifecycle_url = lifecycle_url or notification_url
        self.subscription_ids = frozenset(subscription_ids)
        self.sent_items_folder_id = sent_items_folder_id
        self.mailbox_addresses = tuple(mailbox_addresses)
        self.transport = transport or AsyncHttp()
        self.clock = clock

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GraphProvider:
        """From ``GRAPH_CLIENT_STATE``, ``GRAPH_USER``, ``GRAPH_TOKEN``, ``GRAPH_API_BASE`` (default
        ``https://graph.microsoft.com/v1.0``), ``GRAPH_NOTIFICATION_URL`` and ``INBOX_MAILBOX_ADDRESSES``."""
        env = os.environ if environ is None else environ
        for name in ("GRAPH_CLIENT_STATE", "GRAPH_USER", "GRAPH_TOKEN"):
            if not env.get(name):
                raise ValueError(f"set {name} (docs/providers.md, Microsoft 365)")
        arguments: dict[str, Any] = {
            "token": env["GRAPH_TOKEN"],
            "api_base": env.get("GRAPH_API_BASE") or DEFAULT_API_BASE,
            "notification_url": env.get("GRAPH_NOTIFICATION_URL", ""),
            "mailbox_addresses": [a.strip() for a in env.get("INBOX_MAILBOX_ADDRESSES", "").split(",") if a.strip()],
        }
        arguments.update(overrides)
        return cls(env["GRAPH_CLIENT_STATE"], env["GRAPH_USER"], **arguments)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], **overrides: Any) -> GraphProvider:
        """From a vector file's settings (conformance/providers/graph)."""
        return cls(
            settings["client_state"],
            settings["user"],
            token=settings["token"],
            api_base=settings["api_base"],
            notification_url=settings.get("notification_url", ""),
            subscription_ids=settings.get("subscription_ids") or (),
            sent_items_folder_id=settings.get("sent_items_folder_id"),
            mailbox_addresses=settings.get("mailbox_addresses") or (),
            **overrides,
        )

    # -- requests --------------------------------------------------------------------------------------------

    def _headers(self, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
        token = self.token() if callable(self.token) else self.token
        return (("Authorization", f"Bearer {token}"), IMMUTABLE_IDS, *extra)

    def _user_url(self, path: str) -> str:
        return f"{self.api_base}/users/{quote(self.user, safe='@')}/{path}"

    def _request(
        self, method: str, url: str, *, params: Sequence[tuple[str, str]] = (), body: Any = None
    ) -> HttpRequest:
        return HttpRequest(method, url, tuple(params), self._headers(), body)

    # -- check ---------------------------------------------------------------------------------------------------

    def check(self, request: WebhookRequest) -> Flow[Answer | Accepted]:
        return self.verify(request)
        yield  # no effect

    def verify(self, request: WebhookRequest) -> Answer | Accepted:
        for name, value in parse_qsl(request.query, keep_blank_values=True):
            if name == "validationToken":  # Graph validating a new or renewed subscription's endpoint
                return Answer(200, value) if value else Answer(400, "validationToken is empty")
        if request.method != "POST":
            return Answer(405, "Graph posts notifications; GET is not one", (("allow", "POST"),))
        try:
            document = json.loads(request.body)
        except ValueError:
            return Answer(400, "the body is not JSON: not a Graph notification collection")
        notes = document.get("value") if isinstance(document, dict) else None
        if not isinstance(notes, list) or not all(isinstance(note, dict) for note in notes):
            return Answer(400, "the body has no 'value' array of notifications")
        expected = self.client_state.encode()
        for note in notes:
            state = note.get("clientState")
            given = state.encode() if isinstance(state, str) else b""
            if not hmac.compare_digest(given, expected):
                return Answer(401, "clientState does not match this subscription's: refused, nothing recorded")
            if self.subscription_ids and note.get("subscriptionId") not in self.subscription_ids:
                return Answer(401, f"subscription {note.get('subscriptionId')!r} is not one of this endpoint's")
        return Accepted(tuple(notes))

    def acknowledge(self) -> Answer:
        return Answer(202, "")

    # -- open ------------------------------------------------------------------------------------------------------

    def open(self, accepted: Accepted, cursors: Cursors) -> Flow[Batch]:
        facts: list[MessageFacts] = []
        actions: list[str] = []
        taken: list[tuple[str, CursorRange, str, int]] = []
        if any(n.get("changeType") in _EVENTS or n.get("lifecycleEvent") == "missed" for n in accepted.delivery):
            yield from self._sent_items()  # once, before any message is read: what tells a sent one
        for note in accepted.delivery:
            event = note.get("lifecycleEvent")
            if event == "reauthorizationRequired":
                yield from self._renew(str(note.get("subscriptionId", "")))
                actions.append(f"renewed {note.get('subscriptionId')}")
            elif event == "subscriptionRemoved":
                resource = str(note.get("resource", ""))
                yield from self.subscribe(resource)
                actions.append(f"recreated {resource}")
            elif event == "missed":
                for folder in FOLDERS:
                    found = yield from self._resync(folder, cursors, taken)
                    facts += found
            elif note.get("changeType") in _EVENTS:
                message_id = (note.get("resourceData") or {}).get("id")
                if not isinstance(message_id, str) or not message_id:
                    continue
                message = yield from self._read(message_id)
                if message is not None:
                    change_key = _etag_key((note.get("resourceData") or {}).get("@odata.etag"))
                    facts.append((yield from self.facts(message, _EVENTS[note["changeType"]], change_key)))

        def commit() -> Flow[None]:
            for name, range_, value, position in taken:
                yield from cursors.advance(self.user, name, range_, value, position)

        def abandon() -> Flow[None]:
            for name, range_, _value, _position in taken:
                yield from cursors.advance(self.user, name, range_, range_.value, range_.position)

        return Batch(tuple(facts), commit, abandon, tuple(actions))

    def _read(self, message_id: str) -> Flow[dict[str, Any] | None]:
        url = self._user_url(f"messages/{quote(message_id, safe='=')}")
        response = yield from http(self.transport, self._request("GET", url, params=[("$select", SELECT)]))
        if response.status == 404:
            return None  # gone before it was read: nothing to answer
        document = response.json()
        if response.status != 200 or not isinstance(document, dict):
            raise ProviderError(f"reading message {message_id!r} answered HTTP {response.status}")
        return document

    def _sent_items(self) -> Flow[str]:
        if self.sent_items_folder_id is None:
            url = self._user_url("mailFolders/sentitems")
            response = yield from http(self.transport, self._request("GET", url, params=[("$select", "id")]))
            document = response.json()
            if response.status != 200 or not isinstance(document, dict) or not isinstance(document.get("id"), str):
                raise ProviderError(f"reading the Sent Items folder answered HTTP {response.status}")
            self.sent_items_folder_id = document["id"]
        return self.sent_items_folder_id

    def facts(self, message: Mapping[str, Any], event: str, change_key: str | None = None) -> Flow[MessageFacts]:
        """The facts of a Graph message (as read with ``SELECT``)."""
        sent_items = yield from self._sent_items()
        sender = (message.get("from") or {}).get("emailAddress") or {}
        name, address = str(sender.get("name") or ""), str(sender.get("address") or "")
        headers = [
            (h.get("name"), h.get("value")) for h in message.get("internetMessageHeaders") or [] if isinstance(h, dict)
        ]
        folder = message.get("parentFolderId")
        folders = (folder, "SENT") if folder == sent_items else (folder,) if isinstance(folder, str) else ()
        reply_to = [
            r["emailAddress"]["address"]
            for r in message.get("replyTo") or []
            if isinstance(r, dict) and isinstance((r.get("emailAddress") or {}).get("address"), str)
        ]
        subject = str(message.get("subject") or "")
        stamp: ClaimStamp | None = parse_stamp(header(headers, STAMP_HEADER))
        return MessageFacts(
            provider=self.name,
            event=event,
            mailbox=self.user,
            dedup_key=f"{message['id']}@{change_key or message.get('changeKey') or ''}",
            message_id=str(message["id"]),
            thread_id=message.get("conversationId") or None,
            received_at=_received(message.get("receivedDateTime")),
            sender=display(name, address),
            subject_line=subject,
            from_addresses=(address,) if address else (),
            folders=folders,
            automated=Automated.of(headers, address),
            stamp=stamp,
            reply=ReplyContext(
                to=tuple(reply_to) or ((address,) if address else ()),
                subject=reply_subject(subject),
                internet_message_id=message.get("internetMessageId") or None,
                references=message_ids(header(headers, "References")),
            ),
            source=dict(message),
        )

    def _resync(
        self, folder: str, cursors: Cursors, taken: list[tuple[str, CursorRange, str, int]]
    ) -> Flow[list[MessageFacts]]:
        """A delta query of ``folder`` from its delta link, every page (``missed``)."""
        name = f"graph-delta:{folder}"
        range_ = yield from cursors.take(self.user, name, 0, RANGE_TTL)
        if range_.outcome != "TAKEN":
            return []  # another worker resyncs it now
        first = self._user_url(f"mailFolders('{folder}')/messages/delta")
        # A first round lists the folder: only the last day of it, as Gmail's resync (an older message is not one to
        # answer now, and a mailbox's whole Inbox would be a storm of replies).
        since = _iso(self.clock() - RESYNC_SECONDS)
        first_params = [("$select", SELECT), ("$filter", f"receivedDateTime ge {since}")]
        url, params = (range_.value, []) if range_.value else (first, first_params)
        found: list[MessageFacts] = []
        while True:
            split = urlsplit(url)
            query = [(k, v) for k, v in parse_qsl(split.query, keep_blank_values=True)] + params
            base = f"{split.scheme}://{split.netloc}{unquote(split.path)}"
            response = yield from http(self.transport, self._request("GET", base, params=query))
            if response.status == 410 and url == range_.value:  # the delta link expired: a first round again
                url, params, found = first, first_params, []
                continue
            document = response.json()
            if response.status != 200 or not isinstance(document, dict):
                raise ProviderError(f"the delta query of {folder} answered HTTP {response.status}")
            for item in document.get("value") or []:
                if isinstance(item, dict) and "@removed" not in item and isinstance(item.get("id"), str):
                    found.append((yield from self.facts(item, "message.created")))
            if isinstance(document.get("@odata.nextLink"), str):
                url, params = document["@odata.nextLink"], []
                continue
            link = document.get("@odata.deltaLink")
            if not isinstance(link, str):
                raise ProviderError(f"the delta query of {folder} ended without a delta link")
            taken.append((name, range_, link, range_.position + 1))
            return found

    # -- subscriptions ---------------------------------------------------------------------------------------

    def subscribe(self, resource: str) -> Flow[str]:
        """Creates a subscription to ``resource`` (``created,updated``, this endpoint's clientState and URLs); its
        id. Made with immutable ids, so that its notifications name messages by them."""
        body = {
            "changeType": "created,updated",
            "resource": resource,
            "clientState": self.client_state,
            "notificationUrl": self.notification_url,
            "lifecycleNotificationUrl": self.lifecycle_url,
            "expirationDateTime": _iso(self.clock() + SUBSCRIPTION_SECONDS),
        }
        response = yield from http(self.transport, self._request("POST", f"{self.api_base}/subscriptions", body=body))
        document = response.json()
        if response.status != 201 or not isinstance(document, dict) or not isinstance(document.get("id"), str):
            raise ProviderError(f"creating the subscription to {resource} answered HTTP {response.status}")
        return str(document["id"])

    def subscriptions(self) -> Flow[list[str]]:
        """The two subscriptions a mailbox needs: its Inbox and its Sent Items (a person's reply from Outlook)."""
        ids = []
        for folder in FOLDERS:
            ids.append((yield from self.subscribe(f"users/{self.user}/mailFolders('{folder}')/messages")))
        return ids

    def create_subscriptions(self) -> Any:
        """Makes the mailbox's two subscriptions now (run on this provider's transport: awaited with an asyncio one);
        their ids."""
        return drive(self.subscriptions(), self.transport)

    def _renew(self, subscription_id: str) -> Flow[None]:
        """Renews and reauthorizes in one request (PATCH with a new expirationDateTime)."""
        url = f"{self.api_base}/subscriptions/{quote(subscription_id, safe='')}"
        body = {"expirationDateTime": _iso(self.clock() + SUBSCRIPTION_SECONDS)}
        response = yield from http(self.transport, self._request("PATCH", url, body=body))
        if response.status != 200:
            raise ProviderError(f"renewing subscription {subscription_id!r} answered HTTP {response.status}")

    def renew(self, subscription_id: str) -> Any:
        """Renews a subscription now (run on this provider's transport)."""
        return drive(self._renew(subscription_id), self.transport)

    # -- look before you send ----------------------------------------------------------------------------------

    def look(self, message: MessageFacts) -> Flow[tuple[MessageFacts, ...]]:
        """The conversation's messages received after ``message`` (one list call: ``$filter`` on conversationId and
        receivedDateTime, its first page), for the guard's look right before the commit point."""
        if not message.thread_id or message.received_at is None:
            return ()
        since = message.received_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        conversation = message.thread_id.replace("'", "''")
        query = [
            ("$select", SELECT),
            ("$filter", f"conversationId eq '{conversation}' and receivedDateTime gt {since}"),
        ]
        response = yield from http(self.transport, self._request("GET", self._user_url("messages"), params=query))
        document = response.json()
        if response.status != 200 or not isinstance(document, dict):
            raise ProviderError(f"listing conversation {message.thread_id!r} answered HTTP {response.status}")
        found = []
        for item in document.get("value") or []:
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                found.append((yield from self.facts(item, "message.created")))
        return tuple(newer_than(message, found))

    # -- send ------------------------------------------------------------------------------------------------

    def reply(self, message: MessageFacts, body: str) -> Any:
        """``claim.send(provider.reply, message, body=...)``: the draft (``createReply``, stamped with the current
        claim), then its send; the draft's immutable id, which its copy in Sent Items keeps: a ``str`` on a blocking
        transport (``Claim.send``), a coroutine of it on an asyncio one (``AsyncClaim.send``), typed ``Any`` so that
        both type-check."""
        return drive(self._reply(message, body, current_stamp()), self.transport)

    def mime_reply(self, message: MessageFacts, body: str, stamp: ClaimStamp) -> bytes:
        """The reply's MIME for ``createReply``: ``To`` the sender (its ``Reply-To``), ``In-Reply-To`` and
        ``References``, the stamp, and an agent's ``Auto-Submitted`` (JSON ``internetMessageHeaders`` take only
        ``X-`` headers)."""
        return bytes(reply_mime(message, body, stamp))

    def _reply(self, message: MessageFacts, body: str, stamp: ClaimStamp) -> Flow[str]:
        url = self._user_url(f"messages/{quote(message.message_id, safe='=')}/createReply")
        mime = base64.b64encode(self.mime_reply(message, body, stamp))
        request = HttpRequest("POST", url, (), self._headers(("Content-Type", "text/plain")), content=mime)
        try:
            created = yield from http(self.transport, request)
        except ProviderError as error:
            raise GraphSendRejected(f"the reply's draft could not be made, nothing was sent: {error}") from error
        document = created.json()
        if created.status != 201 or not isinstance(document, dict) or not isinstance(document.get("id"), str):
            raise GraphSendRejected(f"Graph refused the reply's draft (HTTP {created.status}); nothing was sent")
        draft_id = document["id"]
        send_url = self._user_url(f"messages/{quote(draft_id, safe='=')}/send")
        try:
            sent = yield from http(self.transport, self._request("POST", send_url))
        except ProviderError as error:
            raise GraphSendOutcomeUnknown(f"the send may have gone out: {error}") from error
        if sent.status == 202:
            return str(draft_id)
        if 400 <= sent.status < 500:
            raise GraphSendRejected(f"Graph refused to send the draft (HTTP {sent.status}); nothing was sent")
        raise GraphSendOutcomeUnknown(f"Graph answered HTTP {sent.status} to the send: it may have gone out")

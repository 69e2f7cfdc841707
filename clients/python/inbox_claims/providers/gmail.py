"""Gmail behind the provider seam: Cloud Pub/Sub push in, ``messages.send`` out (docs/providers.md, "Gmail"; the
vectors: conformance/providers/gmail). Needs ``httpx`` and PyJWT with cryptography (the ``gmail`` extra).

* Authenticity: the push's OIDC token (``Authorization: Bearer``), RS256 by a key of Google's JWKS (the URL is a
  setting, so that a test double signs with its own key), issuer Google, the configured audience, not expired.
* A push holds no message, only ``{emailAddress, historyId}``: the worker takes a range of the mailbox's
  ``gmail-history`` cursor in the coordinator, reads the history since it (``messageAdded``), reads each message and
  hands the batch back; the cursor advances only once every message was recorded (docs/design.md#cursors).
* A history id too old (404): a bounded resync of the last day's messages, the cursor set to the profile's.
* Send: a raw RFC 2822 reply with ``threadId``, ``In-Reply-To`` and ``References``, stamped with the claim.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import jwt

from .._effects import Sleep
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
    header,
    http,
    message_ids,
    newer_than,
    parse_stamp,
    reply_mime,
    reply_subject,
    split_address,
)

__all__ = ["DEFAULT_API_BASE", "DEFAULT_JWKS_URL", "GmailProvider", "GmailSendOutcomeUnknown", "GmailSendRejected"]

DEFAULT_API_BASE = "https://gmail.googleapis.com"
DEFAULT_JWKS_URL = "https://www.googleapis.com/oauth2/v3/certs"
ISSUERS = frozenset({"https://accounts.google.com", "accounts.google.com"})
CURSOR = "gmail-history"
RANGE_TTL = 60
METADATA_HEADERS = (
    "From",
    "To",
    "Subject",
    "Date",
    "Message-ID",
    "References",
    "In-Reply-To",
    "Reply-To",
    STAMP_HEADER,
    # The automated-mail rules' headers (conformance/automated.json): in the same messages.get, no extra call.
    "Auto-Submitted",
    "Precedence",
    "List-Id",
    "List-Unsubscribe",
    "X-Autoreply",
    "X-Autorespond",
    "X-Auto-Response-Suppress",
    "Content-Type",
)
RESYNC_QUERY = "newer_than:1d"
RESYNC_MAX = 500
JWKS_REFRESH_S = 60.0
DEFAULT_HISTORY_CHECK_S = 60.0
"""How often the webhook adapters run the periodic history check (what a dropped push would have said)."""
# A range another worker holds: look again this often, this many times, then ask Pub/Sub to deliver again.
BUSY_WAIT_S = 0.25
BUSY_LOOKS = 16
PERIODIC = 0
"""The periodic check's "push": through position 0, which no cursor covers (a push's history id is positive)."""


class GmailSendRejected(SendRejected):
    """Gmail refused the send: nothing went out (``claim.send`` aborts: FREE)."""


class GmailSendOutcomeUnknown(InboxClaimsError):
    """The send may have gone out (a 5xx, a timeout): SENDING, then IN_DOUBT until its stamped ``SENT`` copy
    settles it, or a person does."""


class GmailProvider:
    """Gmail's Pub/Sub push for one mailbox (``user``: its address, the mailbox the claims are in)."""

    name = "gmail"

    def __init__(
        self,
        audience: str,
        user: str,
        *,
        token: str | Callable[[], str],
        api_base: str = DEFAULT_API_BASE,
        jwks_url: str = DEFAULT_JWKS_URL,
        service_account: str = "",
        mailbox_addresses: Sequence[str] = (),
        transport: HttpTransport | None = None,
        clock: Callable[[], float] = time.time,
        history_check_interval: float = DEFAULT_HISTORY_CHECK_S,
    ) -> None:
        if not audience:
            raise ValueError("audience is empty: the audience of the push subscription's OIDC token")
        if "@" not in user:
            raise ValueError(f"user must be the mailbox's address, not {user!r}")
        if not history_check_interval >= 0:
            raise ValueError(f"history_check_interval must be 0 (off) or seconds, not {history_check_interval}")
        self.audience = audience
        self.user = user
        self.token = token
        self.api_base = api_base.rstrip("/")
        self.jwks_url = jwks_url
        self.service_account = service_account
        self.mailbox_addresses = (user, *mailbox_addresses)
        self.transport = transport or AsyncHttp()
        self.clock = clock
        self.periodic_interval = float(history_check_interval)
        """Seconds between the periodic history checks the webhook adapters run; 0: none."""
        self._keys: dict[str, jwt.PyJWK] = {}
        self._keys_at = float("-inf")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GmailProvider:
        """From ``GMAIL_PUSH_AUDIENCE``, ``GMAIL_USER``, ``GMAIL_TOKEN``, ``GMAIL_API_BASE`` (default
        ``https://gmail.googleapis.com``), ``GMAIL_JWKS_URL``, ``GMAIL_PUSH_SERVICE_ACCOUNT`` and
        ``GMAIL_HISTORY_CHECK_SECONDS`` (default 60; 0 turns the periodic history check off)."""
        env = os.environ if environ is None else environ
        for name in ("GMAIL_PUSH_AUDIENCE", "GMAIL_USER", "GMAIL_TOKEN"):
            if not env.get(name):
                raise ValueError(f"set {name} (docs/providers.md, Gmail)")
        arguments: dict[str, Any] = {
            "token": env["GMAIL_TOKEN"],
            "api_base": env.get("GMAIL_API_BASE") or DEFAULT_API_BASE,
            "jwks_url": env.get("GMAIL_JWKS_URL") or DEFAULT_JWKS_URL,
            "service_account": env.get("GMAIL_PUSH_SERVICE_ACCOUNT", ""),
        }
        interval = env.get("GMAIL_HISTORY_CHECK_SECONDS", "").strip()
        if interval:
            try:
                arguments["history_check_interval"] = float(interval)
            except ValueError:
                raise ValueError(f"GMAIL_HISTORY_CHECK_SECONDS must be a number of seconds, not {interval!r}") from None
        arguments.update(overrides)
        return cls(env["GMAIL_PUSH_AUDIENCE"], env["GMAIL_USER"], **arguments)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], **overrides: Any) -> GmailProvider:
        return cls(
            settings["audience"],
            settings["user"],
            token=settings["token"],
            api_base=settings["api_base"],
            jwks_url=settings["jwks_url"],
            service_account=settings.get("service_account") or "",
            **overrides,
        )

    def _api(self, method: str, path: str, params: Sequence[tuple[str, str]] = (), body: Any = None) -> HttpRequest:
        token = self.token() if callable(self.token) else self.token
        url = f"{self.api_base}/gmail/v1/users/me/{path}"
        return HttpRequest(method, url, tuple(params), (("Authorization", f"Bearer {token}"),), body)

    # -- check -------------------------------------------------------------------------------------------------

    def check(self, request: WebhookRequest) -> Flow[Answer | Accepted]:
        if request.method != "POST":
            return Answer(405, "Pub/Sub posts its pushes", (("allow", "POST"),))
        authorization = request.headers.get("authorization", "")
        if not authorization.startswith("Bearer ") or not authorization[7:].strip():
            return Answer(401, "no OIDC token (Authorization: Bearer): refused, nothing recorded")
        refusal = yield from self._verify(authorization[7:].strip())
        if refusal is not None:
            return Answer(401, f"the push's token is refused: {refusal}")
        try:
            document = json.loads(request.body)
            data = base64.b64decode(document["message"]["data"], validate=False)
            push = json.loads(data)
            email, history = push["emailAddress"], int(push["historyId"])
        except (ValueError, KeyError, TypeError, binascii.Error):
            return Answer(400, "not a Gmail push: message.data is not base64 of {emailAddress, historyId}")
        if not isinstance(email, str) or email.lower() != self.user.lower():
            return Answer(403, f"a push for {email!r}, not for this endpoint's mailbox: refused, nothing recorded")
        return Accepted(history)

    def _verify(self, token: str) -> Flow[str | None]:
        """None when the token is Google's, for this audience, current; else why not."""
        try:
            kid = jwt.get_unverified_header(token).get("kid")
        except jwt.PyJWTError as error:
            return f"not a JWT ({error})"
        key = self._keys.get(kid) if isinstance(kid, str) else None
        if key is None and self.clock() - self._keys_at >= JWKS_REFRESH_S:
            yield from self._fetch_keys()
            key = self._keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            return f"signed by an unknown key ({kid!r})"
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=["RS256"],
                audience=self.audience,
                # The times are checked below on this provider's clock.
                options={"verify_exp": False, "verify_iat": False, "verify_nbf": False, "require": ["exp", "iss"]},
            )
        except jwt.PyJWTError as error:
            return str(error)
        now = self.clock()
        if not isinstance(claims.get("exp"), int | float) or claims["exp"] <= now:
            return "expired"
        if claims.get("iss") not in ISSUERS:
            return f"issuer {claims.get('iss')!r} is not Google's"
        if claims.get("email_verified") is not True:
            return "its email is not verified"
        if self.service_account and claims.get("email") != self.service_account:
            return f"from {claims.get('email')!r}, not the configured service account"
        return None

    def _fetch_keys(self) -> Flow[None]:
        response = yield from http(self.transport, HttpRequest("GET", self.jwks_url))
        document = response.json()
        if response.status != 200 or not isinstance(document, dict):
            raise ProviderError(f"Google's keys ({self.jwks_url}) answered HTTP {response.status}")
        keys = {}
        for entry in document.get("keys") or []:
            try:
                key = jwt.PyJWK(entry)
            except jwt.PyJWTError:
                continue
            if key.key_id:
                keys[key.key_id] = key
        self._keys, self._keys_at = keys, self.clock()

    def acknowledge(self) -> Answer:
        return Answer(200, "ok")

    def periodic(self) -> Accepted:
        """What the periodic history check opens: a push that reaches everything (what a dropped push said). The
        webhook adapters run it every ``periodic_interval`` seconds."""
        return Accepted(PERIODIC)

    # -- open ------------------------------------------------------------------------------------------------

    def open(self, accepted: Accepted, cursors: Cursors) -> Flow[Batch]:
        through = int(accepted.delivery)
        for _ in range(BUSY_LOOKS):
            range_ = yield from cursors.take(self.user, CURSOR, through, RANGE_TTL)
            if range_.outcome != "BUSY":
                break
            if through == PERIODIC:
                return Batch()  # another worker reads the history now: what the check would find, it records
            yield Sleep(BUSY_WAIT_S)  # another worker reads this history now: what it records may cover ours
        else:
            raise ProviderError("another worker held the mailbox's history range too long")
        if range_.outcome == "COVERED":
            return Batch()
        found = yield from self._history(range_)
        if found is None:  # the cursor is too old, or was never set: a bounded resync
            ids, end = yield from self._resync()
        else:
            ids, end = found
        facts = []
        for message_id in ids:
            message = yield from self._message(message_id)
            if message is not None:
                facts.append(self.facts(message))

        def commit() -> Flow[None]:
            yield from cursors.advance(self.user, CURSOR, range_, str(end), max(end, range_.position))

        def abandon() -> Flow[None]:
            yield from cursors.advance(self.user, CURSOR, range_, range_.value, range_.position)

        return Batch(tuple(facts), commit, abandon)

    def _history(self, range_: CursorRange) -> Flow[tuple[list[str], int] | None]:
        if not range_.value:
            return None
        ids: list[str] = []
        page = ""
        while True:
            params = [("startHistoryId", range_.value), ("historyTypes", "messageAdded")]
            if page:
                params.append(("pageToken", page))
            response = yield from http(self.transport, self._api("GET", "history", params))
            if response.status == 404:
                return None
            document = response.json()
            if response.status != 200 or not isinstance(document, dict):
                raise ProviderError(f"history.list answered HTTP {response.status}")
            for record in document.get("history") or []:
                for added in record.get("messagesAdded") or []:
                    message_id = (added.get("message") or {}).get("id")
                    if isinstance(message_id, str) and message_id not in ids:
                        ids.append(message_id)
            page = document.get("nextPageToken") or ""
            if not page:
                return ids, int(document.get("historyId") or range_.position)

    def _resync(self) -> Flow[tuple[list[str], int]]:
        profile = yield from http(self.transport, self._api("GET", "profile"))
        document = profile.json()
        if profile.status != 200 or not isinstance(document, dict):
            raise ProviderError(f"getProfile answered HTTP {profile.status}")
        end = int(document["historyId"])
        params = [("q", RESYNC_QUERY), ("maxResults", str(RESYNC_MAX))]
        listed = yield from http(self.transport, self._api("GET", "messages", params))
        page = listed.json()
        if listed.status != 200 or not isinstance(page, dict):
            raise ProviderError(f"messages.list answered HTTP {listed.status}")
        return [
            m["id"] for m in page.get("messages") or [] if isinstance(m, dict) and isinstance(m.get("id"), str)
        ], end

    def _message(self, message_id: str) -> Flow[dict[str, Any] | None]:
        params = [("format", "metadata")] + [("metadataHeaders", name) for name in METADATA_HEADERS]
        response = yield from http(self.transport, self._api("GET", f"messages/{message_id}", params))
        if response.status == 404:
            return None  # deleted since the history named it
        document = response.json()
        if response.status != 200 or not isinstance(document, dict):
            raise ProviderError(f"messages.get {message_id!r} answered HTTP {response.status}")
        return document

    def facts(self, message: Mapping[str, Any]) -> MessageFacts:
        headers = [
            (h.get("name"), h.get("value"))
            for h in (message.get("payload") or {}).get("headers") or []
            if isinstance(h, dict)
        ]
        name, address = split_address(header(headers, "From") or "")
        reply_to = header(headers, "Reply-To")
        subject = header(headers, "Subject") or ""
        internal = message.get("internalDate")
        received = datetime.fromtimestamp(int(internal) / 1000, tz=UTC) if isinstance(internal, str | int) else None
        return MessageFacts(
            provider=self.name,
            event="message.created",
            mailbox=self.user,
            dedup_key=str(message["id"]),
            message_id=str(message["id"]),
            thread_id=message.get("threadId") or None,
            received_at=received,
            sender=f"{name} <{address}>" if name and address else name or address,
            subject_line=subject,
            from_addresses=(address,) if address else (),
            folders=tuple(label for label in message.get("labelIds") or [] if isinstance(label, str)),
            automated=Automated.of(headers, address),
            stamp=parse_stamp(header(headers, STAMP_HEADER)),
            reply=ReplyContext(
                to=(split_address(reply_to)[1],) if reply_to else ((address,) if address else ()),
                subject=reply_subject(subject),
                internet_message_id=header(headers, "Message-ID"),
                references=message_ids(header(headers, "References")),
            ),
            source=dict(message),
        )

    # -- look before you send ----------------------------------------------------------------------------------

    def look(self, message: MessageFacts) -> Flow[tuple[MessageFacts, ...]]:
        """The thread's messages received after ``message`` (``threads.get`` in metadata form: one call), for the
        guard's look right before the commit point (docs/providers.md, "Look before you send")."""
        if not message.thread_id or message.received_at is None:
            return ()
        params = [("format", "metadata")] + [("metadataHeaders", name) for name in METADATA_HEADERS]
        response = yield from http(self.transport, self._api("GET", f"threads/{quote(message.thread_id)}", params))
        if response.status == 404:
            return ()
        document = response.json()
        if response.status != 200 or not isinstance(document, dict):
            raise ProviderError(f"threads.get {message.thread_id!r} answered HTTP {response.status}")
        found = (self.facts(m) for m in document.get("messages") or [] if isinstance(m, dict) and "id" in m)
        return tuple(newer_than(message, found))

    # -- send ------------------------------------------------------------------------------------------------

    def reply(self, message: MessageFacts, body: str) -> Any:
        """``claim.send(provider.reply, message, body=...)``: a raw reply in the message's thread, stamped with the
        current claim; the sent message's id (its ``SENT`` copy's): a ``str`` on a blocking transport
        (``Claim.send``), a coroutine of it on an asyncio one (``AsyncClaim.send``), typed ``Any`` so that both
        type-check."""
        return drive(self._reply(message, body, current_stamp()), self.transport)

    def raw_reply(self, message: MessageFacts, body: str, stamp: ClaimStamp) -> bytes:
        """The RFC 2822 reply: ``To`` the sender (its ``Reply-To``), ``In-Reply-To`` and ``References``, the stamp."""
        reply = reply_mime(message, body, stamp)
        reply["From"] = self.user
        reply["Message-ID"] = stamp.message_id(self.user.rpartition("@")[2])
        return bytes(reply)

    def _reply(self, message: MessageFacts, body: str, stamp: ClaimStamp) -> Flow[str]:
        raw = base64.urlsafe_b64encode(self.raw_reply(message, body, stamp)).decode().rstrip("=")
        document: dict[str, Any] = {"raw": raw}
        if message.thread_id:
            document["threadId"] = message.thread_id
        try:
            sent = yield from http(self.transport, self._api("POST", "messages/send", body=document))
        except ProviderError as error:
            raise GmailSendOutcomeUnknown(f"the send may have gone out: {error}") from error
        answer = sent.json()
        if sent.status == 200 and isinstance(answer, dict) and isinstance(answer.get("id"), str):
            return str(answer["id"])
        if 400 <= sent.status < 500:
            raise GmailSendRejected(f"Gmail refused the send (HTTP {sent.status}); nothing was sent")
        raise GmailSendOutcomeUnknown(f"Gmail answered HTTP {sent.status} to the send: it may have gone out")

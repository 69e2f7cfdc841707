"""The mail SDKs people already send with, under the guard (docs/providers.md, "The SDKs"): the official Nylas
Python SDK (``nylas`` 6.x), Resend's (``resend``) and AgentMail's (``agentmail``), as published.

Each send goes through the fenced commit point as ``claim.send`` takes it, with the claim's key as the API's
``Idempotency-Key`` passed through the SDK's own per-request options, the claim's stamp (``X-Inbox-Claim``) and
``Auto-Submitted: auto-replied`` (RFC 3834) as headers, the sent id returned (and so recorded), and the SDK's errors
mapped as our own adapters map the answers: a 4xx other than 409 is :class:`~inbox_claims.SendRejected` (nothing went
out: the message is FREE again), anything else leaves the send IN_DOUBT::

    await claim.send(sdks.nylas_send, nylas_client, grant_id, {"to": [...], "subject": ..., "body": ...})
    await claim.send(sdks.resend_send, {"from": ..., "to": [...], "subject": ..., "text": ...})
    await claim.send(sdks.agentmail_reply, agentmail_client, inbox_id, message_id, text=...)

A send through one of these SDKs made inside a guarded claim but not through ``claim.send`` (``nylas.messages.send``
called straight in a ``@guard``-ed handler, or its result handed to ``claim.send``) is refused before it reaches the
API: :class:`UnguardedSend` says what to write instead. The guard watches every SDK imported when a claim is
entered (:func:`watch`); outside a guarded claim the SDKs work as they always do.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ._current import CurrentClaim, agent_headers, current_claim_base
from ._errors import InboxClaimsError, SendRejected
from .providers._seam import STAMP_HEADER

__all__ = [
    "SdkSendOutcomeUnknown",
    "SdkSendRejected",
    "UnguardedSend",
    "agentmail_reply",
    "nylas_send",
    "resend_send",
    "watch",
]


class UnguardedSend(InboxClaimsError):
    """An SDK send inside a guarded claim that did not go through ``claim.send``: refused before it was made."""


class SdkSendRejected(SendRejected):
    """The API refused the send through the SDK (a 4xx other than 409): nothing went out (the message is FREE)."""

    def __init__(self, reason: str, *, status_code: int | None) -> None:
        super().__init__(reason)
        self.status_code = status_code


class SdkSendOutcomeUnknown(InboxClaimsError):
    """The send through the SDK may have gone out (5xx, 409, timeout, connection error): IN_DOUBT."""

    def __init__(self, reason: str, *, status_code: int | None = None) -> None:
        super().__init__(reason)
        self.status_code = status_code


def _claim(sdk: str) -> CurrentClaim:
    claim = current_claim_base()
    if claim is None:
        raise RuntimeError(f"a {sdk} send outside a guarded claim: call it as claim.send(sdks.<send>, ...)")
    return claim


def _stamp_headers(claim: CurrentClaim) -> dict[str, str]:
    # A person's reply is never marked automatic (docs/design.md#reply-storms).
    return {STAMP_HEADER: f"{claim.idempotency_key}.{claim.token}", **dict(agent_headers())}


def _outcome(sdk: str, status: int | None, detail: str) -> InboxClaimsError:
    if status is not None and 400 <= status < 500 and status != 409:
        reason = f"{sdk} refused the send (HTTP {status}), nothing was sent: {detail}"
        return SdkSendRejected(reason, status_code=status)
    said = f"HTTP {status}" if status is not None else "no answer"
    return SdkSendOutcomeUnknown(f"{sdk} send may have gone out ({said}): {detail}", status_code=status)


def _blocking(call: Callable[[], str | None]) -> Any:
    """A blocking SDK's call: run at once in a blocking claim (``Claim.send``); in an asyncio one, a coroutine that
    runs it in a thread (the claim, a context variable, goes with it), so that ``AsyncClaim.send`` awaits it without
    blocking the event loop."""
    claim = current_claim_base()
    if claim is not None and inspect.iscoroutinefunction(getattr(claim, "send", None)):  # an AsyncClaim
        return asyncio.to_thread(call)
    return call()


# -- Nylas ------------------------------------------------------------------------------------------------------


def nylas_send(client: Any, identifier: str, request_body: Mapping[str, Any], overrides: Any = None) -> Any:
    """``claim.send(sdks.nylas_send, client, grant_id, request_body)``: ``client.messages.send`` of the Nylas SDK
    (``nylas.Client``) with ``Idempotency-Key`` in its ``overrides``, the stamp and Auto-Submitted in
    ``custom_headers``; the sent message's id."""
    claim = _claim("Nylas")
    body = dict(request_body)
    custom = [h for h in body.get("custom_headers") or () if isinstance(h, Mapping)]
    body["custom_headers"] = [*custom, *({"name": k, "value": v} for k, v in _stamp_headers(claim).items())]
    given = dict(overrides or {})
    given["headers"] = {**dict(given.get("headers") or {}), "Idempotency-Key": claim.idempotency_key}

    def call() -> str | None:
        from nylas.models.errors import AbstractNylasApiError  # type: ignore[import-untyped]

        try:
            response = client.messages.send(identifier=identifier, request_body=body, overrides=given)
        except AbstractNylasApiError as error:
            raise _outcome("Nylas", error.status_code, str(error)) from error
        except Exception as error:  # the SDK's timeouts and requests' connection errors: nobody can know
            raise _outcome("Nylas", None, f"{type(error).__name__}: {error}") from error
        sent_id = getattr(getattr(response, "data", None), "id", None)
        return sent_id if isinstance(sent_id, str) and sent_id else None

    return _blocking(call)


# -- Resend -----------------------------------------------------------------------------------------------------


def resend_send(params: Mapping[str, Any], options: Mapping[str, Any] | None = None) -> Any:
    """``claim.send(sdks.resend_send, params)``: ``resend.Emails.send`` with the claim's ``idempotency_key`` in its
    options, the stamp and Auto-Submitted in ``headers``; the sent email's id."""
    claim = _claim("Resend")
    body = dict(params)
    body["headers"] = {**dict(body.get("headers") or {}), **_stamp_headers(claim)}
    given = {**dict(options or {}), "idempotency_key": claim.idempotency_key}

    def call() -> str | None:
        import resend

        try:
            response = resend.Emails.send(body, given)  # type: ignore[arg-type]
        except resend.exceptions.ResendError as error:
            code = int(error.code) if str(error.code).isdigit() else None
            # The SDK reports a request that got no answer as code 500, type HttpClientError: unknown, as a 5xx.
            raise _outcome("Resend", code, error.message) from error
        except Exception as error:
            raise _outcome("Resend", None, f"{type(error).__name__}: {error}") from error
        sent_id = response.get("id") if isinstance(response, Mapping) else None
        return sent_id if isinstance(sent_id, str) and sent_id else None

    return _blocking(call)


# -- AgentMail ----------------------------------------------------------------------------------------------------


def agentmail_reply(client: Any, inbox_id: str, message_id: str, **fields: Any) -> Any:
    """``claim.send(sdks.agentmail_reply, client, inbox_id, message_id, text=...)``:
    ``client.inboxes.messages.reply`` of the AgentMail SDK (``AgentMail`` or ``AsyncAgentMail``) with the claim's
    ``idempotency_key``, the stamp and Auto-Submitted in ``headers``; the sent message's id."""
    claim = _claim("AgentMail")
    fields["headers"] = {**dict(fields.get("headers") or {}), **_stamp_headers(claim)}
    fields["idempotency_key"] = claim.idempotency_key
    try:
        made = client.inboxes.messages.reply(inbox_id, message_id, **fields)
    except Exception as error:
        raise _agentmail_failure(error) from error
    if inspect.isawaitable(made):
        return _agentmail_async(made)
    return _agentmail_sent(made)


async def _agentmail_async(made: Any) -> str | None:
    try:
        return _agentmail_sent(await made)
    except Exception as error:
        raise _agentmail_failure(error) from error


def _agentmail_sent(response: Any) -> str | None:
    sent_id = getattr(response, "message_id", None)
    return sent_id if isinstance(sent_id, str) and sent_id else None


def _agentmail_failure(error: Exception) -> InboxClaimsError:
    from agentmail.core.api_error import ApiError

    if isinstance(error, InboxClaimsError):
        return error
    if isinstance(error, ApiError):  # the SDK's errors (ValidationError, ConflictError...) carry the status
        return _outcome("AgentMail", error.status_code, str(error.body))
    return _outcome("AgentMail", None, f"{type(error).__name__}: {error}")


# -- the watch ----------------------------------------------------------------------------------------------------

_HOW = {
    "nylas": "await claim.send(sdks.nylas_send, nylas_client, grant_id, request_body)",
    "resend": "await claim.send(sdks.resend_send, params)",
    "agentmail": "await claim.send(sdks.agentmail_reply, agentmail_client, inbox_id, message_id, text=...)",
}
_WATCHED: set[str] = set()
_WATCHING = threading.Lock()


def _refuse_outside_send(sdk: str, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def check() -> None:
        claim = current_claim_base()
        if claim is not None and not claim.sending:
            raise UnguardedSend(
                f"{name} was called inside a guarded claim on {claim.subject} but not through claim.send, so "
                f"nothing would stop a second reply and nothing would record this one: refused, nothing was sent. "
                f"Send it as: {_HOW[sdk]} (docs/providers.md, 'The SDKs')"
            )

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def watched_async(*args: Any, **kwargs: Any) -> Any:
            check()
            return await method(*args, **kwargs)

        return watched_async

    @functools.wraps(method)
    def watched(*args: Any, **kwargs: Any) -> Any:
        check()
        return method(*args, **kwargs)

    return watched


def watch() -> None:
    """Refuses, inside a guarded claim, every send of an imported SDK that does not go through ``claim.send``
    (each SDK once, when it is imported; the guard calls this on entering a claim)."""
    if {"nylas", "resend", "agentmail"} <= _WATCHED:
        return
    with _WATCHING:
        _watch()


def _watch() -> None:
    if "nylas" not in _WATCHED and "nylas.resources.messages" in sys.modules:
        _WATCHED.add("nylas")
        messages = sys.modules["nylas.resources.messages"].Messages
        messages.send = _refuse_outside_send("nylas", "nylas messages.send", messages.send)
        drafts = sys.modules.get("nylas.resources.drafts")
        if drafts is not None:
            drafts.Drafts.send = _refuse_outside_send("nylas", "nylas drafts.send", drafts.Drafts.send)
    if "resend" not in _WATCHED and "resend" in sys.modules and hasattr(sys.modules["resend"], "Emails"):
        _WATCHED.add("resend")
        emails = sys.modules["resend"].Emails
        for name in ("send", "send_async"):
            if name in vars(emails):
                method = getattr(emails, name)
                setattr(emails, name, staticmethod(_refuse_outside_send("resend", f"resend.Emails.{name}", method)))
    if "agentmail" not in _WATCHED and "agentmail.inboxes.messages.client" in sys.modules:
        _WATCHED.add("agentmail")
        module = sys.modules["agentmail.inboxes.messages.client"]
        for cls_name in ("MessagesClient", "AsyncMessagesClient"):
            cls = getattr(module, cls_name, None)
            for name in ("send", "reply", "reply_all", "forward"):
                if cls is not None and callable(getattr(cls, name, None)):
                    method = getattr(cls, name)
                    setattr(cls, name, _refuse_outside_send("agentmail", f"agentmail inboxes.messages.{name}", method))

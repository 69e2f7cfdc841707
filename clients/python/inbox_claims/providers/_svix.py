"""What the providers that deliver through Svix share (AgentMail, Resend): the signature, checked as Standard Webhooks
(Svix's scheme under its own header names: ``svix-id``, ``svix-timestamp``, ``svix-signature``) on the raw body,
and what a send's answer means for ``claim.send`` (both take an ``Idempotency-Key``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import InboxClaimsError, SendRejected
from .._webhooks import WebhookVerificationError, sign_standard_webhook, verify_standard_webhook
from ._seam import AUTO_SUBMITTED, Answer, HttpResponse, WebhookRequest

__all__ = [
    "AUTO_SUBMITTED",
    "SvixSendOutcomeUnknown",
    "SvixSendRejected",
    "check_secret",
    "send_outcome",
    "verify_svix",
]

_HEADERS = {"svix-id": "webhook-id", "svix-timestamp": "webhook-timestamp", "svix-signature": "webhook-signature"}


class SvixSendRejected(SendRejected):
    """The provider refused the send (a 4xx other than 409): nothing went out (``claim.send`` aborts: FREE)."""

    def __init__(self, reason: str, *, status_code: int) -> None:
        super().__init__(reason)
        self.status_code = status_code


class SvixSendOutcomeUnknown(InboxClaimsError):
    """The send may have gone out (a 5xx, a timeout, a 409 for a key already used): the subject stays SENDING, then
    IN_DOUBT, until the sent copy's stamp settles it or a person does."""

    def __init__(self, reason: str, *, status_code: int | None = None) -> None:
        super().__init__(reason)
        self.status_code = status_code


def check_secret(secret: str, provider: str) -> None:
    """Raises at start, not on the first request, for a secret that is not Svix's ``whsec_<base64>``."""
    if not isinstance(secret, str) or not secret:
        raise ValueError(f"the {provider} webhook secret is empty: set it to the endpoint's 'whsec_...' secret")
    try:
        sign_standard_webhook(b"", msg_id="config-check", timestamp=0, secret=secret)
    except ValueError as error:
        raise ValueError(f"the {provider} webhook secret is not a signing secret ('whsec_<base64>'): {error}") from None


def verify_svix(
    request: WebhookRequest, secret: str, tolerance: float, clock: Callable[[], float], provider: str
) -> Answer | dict[str, Any]:
    """The delivery's JSON document when its Svix signature holds (on the raw body, within ``tolerance`` seconds of
    ``clock()``); else the refusal: 405 not a POST, 401 the signature, 400 not a JSON object."""
    if request.method != "POST":
        return Answer(405, f"{provider} posts its events; {request.method} is not one", (("allow", "POST"),))
    headers = {_HEADERS.get(name.lower(), name.lower()): value for name, value in request.headers.items()}
    try:
        verify_standard_webhook(request.body, headers, secret, tolerance=tolerance, now=clock())
    except WebhookVerificationError as error:
        text = str(error)
        for svix, standard in _HEADERS.items():
            text = text.replace(standard, svix)
        return Answer(401, f"signature refused: {text}; nothing recorded")
    try:
        document = json.loads(request.body)
    except ValueError:
        return Answer(400, f"the body is not JSON: not a {provider} event")
    if not isinstance(document, dict):
        return Answer(400, f"the body is not a JSON object: not a {provider} event")
    return document


def detail(response: HttpResponse) -> str:
    document = response.json()
    if isinstance(document, Mapping):
        for name in ("message", "error", "name"):
            value = document.get(name)
            if isinstance(value, str) and value:
                return value
    return response.content[:200].decode("utf-8", "replace")


def send_outcome(provider: str, response: HttpResponse, sent_id: Callable[[Any], str | None]) -> str | None:
    """The sent message's id from a 2xx answer (None when it has none readable: it went out all the same), else the
    exception that tells ``claim.send`` what happened."""
    if 200 <= response.status < 300:
        return sent_id(response.json())
    if response.status == 409:
        raise SvixSendOutcomeUnknown(
            f"{provider} answered 409: a send with this idempotency key went out or is in flight ({detail(response)})",
            status_code=409,
        )
    if 400 <= response.status < 500:
        raise SvixSendRejected(
            f"{provider} refused the send (HTTP {response.status}), nothing was sent: {detail(response)}",
            status_code=response.status,
        )
    raise SvixSendOutcomeUnknown(
        f"{provider} answered HTTP {response.status} to the send: it may have gone out", status_code=response.status
    )

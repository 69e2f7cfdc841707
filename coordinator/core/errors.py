"""The errors the domain and the store raise; the service maps each to one gRPC status code.

Each error also carries a ``reason``: a stable, machine-readable name of the error kind, sent to the client as
the ``reason`` of a ``google.rpc.ErrorInfo`` (and as ``CallError.reason`` in a Batch), so that a client
branches on it instead of on message text. The proto lists every reason; a reason once published never
changes meaning.
"""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of every error that is reported to the caller as a status, never as a crash."""

    reason = "INTERNAL"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class InvalidArgument(CoordinatorError):
    """A request field breaks a named limit. The message names the field and the limit."""

    reason = "INVALID_FIELD"

    def __init__(self, field: str, problem: str, *, reason: str | None = None) -> None:
        super().__init__(f"{field}: {problem}", reason=reason)
        self.field = field


class FailedPrecondition(CoordinatorError):
    """The call does not fit the subject's state (a client bug, not a race)."""

    reason = "WRONG_STATE"


class PermissionDenied(CoordinatorError):
    """The caller may not do this (for example, use another principal's fencing token)."""

    reason = "PERMISSION_DENIED"


class Unauthenticated(CoordinatorError):
    """The call carries no usable identity."""

    reason = "UNAUTHENTICATED"


class ResourceExhausted(CoordinatorError):
    """A quota was hit; ``retry_after_s`` says when trying again can succeed."""

    reason = "RATE_LIMITED"

    def __init__(self, message: str, retry_after_s: float, *, reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s


class StoreUnavailable(CoordinatorError):
    """etcd could not be reached or did not answer in time; the call may be retried with its request id."""

    reason = "STORE_UNAVAILABLE"


class StoreConflict(CoordinatorError):
    """A compare-and-swap kept losing to concurrent writers; retrying later is safe."""

    reason = "STORE_CONFLICT"


class SlowConsumer(CoordinatorError):
    """A Watch stream's client did not keep up; it must watch again and start from a fresh snapshot."""

    reason = "SLOW_CONSUMER"


class WatcherBehind(SlowConsumer):
    """A watcher that had more changes waiting every time it took one, for ``lag_s`` seconds. The API layer
    words it with the server's settings that bound it."""

    def __init__(self, lag_s: float) -> None:
        super().__init__(f"this watcher stayed behind the mailbox's changes for {lag_s:g} s and is cut off")
        self.lag_s = lag_s

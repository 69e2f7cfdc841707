"""The errors the domain and the store raise; the service maps each to one gRPC status code."""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of every error that is reported to the caller as a status, never as a crash."""


class InvalidArgument(CoordinatorError):
    """A request field breaks a named limit. The message names the field and the limit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class FailedPrecondition(CoordinatorError):
    """The call does not fit the subject's state (a client bug, not a race)."""


class PermissionDenied(CoordinatorError):
    """The caller may not do this (for example, use another principal's fencing token)."""


class Unauthenticated(CoordinatorError):
    """The call carries no usable identity."""


class ResourceExhausted(CoordinatorError):
    """A quota was hit; ``retry_after_s`` says when trying again can succeed."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreUnavailable(CoordinatorError):
    """etcd could not be reached or did not answer in time; the call may be retried with its request id."""


class StoreConflict(CoordinatorError):
    """A compare-and-swap kept losing to concurrent writers; retrying later is safe."""


class SlowConsumer(CoordinatorError):
    """A Watch stream's client did not keep up; it must watch again and start from a fresh snapshot."""

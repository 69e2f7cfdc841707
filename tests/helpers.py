"""A thin typed wrapper over the generated stub, acting as one principal, for the tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from coordinator.ops.server import CoordinatorServer
from coordinator.store.etcd.store import EtcdStore
from inbox_wire import PRINCIPAL_KIND_METADATA, PRINCIPAL_METADATA
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

T = TypeVar("T")


def missing_on_this_machine(what: str) -> NoReturn:
    """Skips a test that needs something this machine lacks; fails it in CI (``CI`` set), where .ci/run installs
    everything the suite needs, so a missing piece can never pass as a skip there."""
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide this: {what}")
    pytest.skip(what)


def etcd_store_of(server: CoordinatorServer) -> EtcdStore:
    """The server's store, for a test that reads what only the etcd store has (group commit, raft term)."""
    assert isinstance(server.store, EtcdStore), server.store
    return server.store


def message(mailbox: str, message_id: str) -> pb.Subject:
    return pb.Subject(mailbox=mailbox, kind=pb.SUBJECT_KIND_MESSAGE, id=message_id)


def thread(mailbox: str, thread_id: str) -> pb.Subject:
    return pb.Subject(mailbox=mailbox, kind=pb.SUBJECT_KIND_THREAD, id=thread_id)


def new_request_id() -> str:
    return uuid.uuid4().hex


class Actor:
    """One principal (agent or human) talking to a coordinator."""

    def __init__(
        self, channel: grpc.aio.Channel, principal: str, kind: str = "agent", *, token: str | None = None
    ) -> None:
        self.stub = pb_grpc.CoordinatorStub(channel)
        self.name = principal
        # With a token the server takes the principal from it; without, from the development-mode metadata.
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),)
            if token is not None
            else ((PRINCIPAL_METADATA, principal), (PRINCIPAL_KIND_METADATA, kind))
        )

    async def claim(
        self,
        subject: pb.Subject,
        *,
        ttl: int = 0,
        notification_id: str = "",
        request_id: str | None = None,
        note: str = "",
    ) -> pb.ClaimReplyResponse:
        return await self.stub.ClaimReply(
            pb.ClaimReplyRequest(
                request_id=request_id or new_request_id(),
                subject=subject,
                notification_id=notification_id,
                ttl_seconds=ttl,
                note=note,
            ),
            metadata=self.metadata,
        )

    async def record_delivery(
        self, mailbox: str, notification_id: str, request_id: str | None = None
    ) -> pb.RecordDeliveryResponse:
        return await self.stub.RecordDelivery(
            pb.RecordDeliveryRequest(
                request_id=request_id or new_request_id(), mailbox=mailbox, notification_id=notification_id
            ),
            metadata=self.metadata,
        )

    async def renew(
        self, subject: pb.Subject, token: int, ttl: int = 0, request_id: str | None = None
    ) -> pb.RenewClaimResponse:
        return await self.stub.RenewClaim(
            pb.RenewClaimRequest(
                request_id=request_id or new_request_id(), subject=subject, fencing_token=token, ttl_seconds=ttl
            ),
            metadata=self.metadata,
        )

    async def release(self, subject: pb.Subject, token: int, request_id: str | None = None) -> pb.ReleaseClaimResponse:
        return await self.stub.ReleaseClaim(
            pb.ReleaseClaimRequest(request_id=request_id or new_request_id(), subject=subject, fencing_token=token),
            metadata=self.metadata,
        )

    async def begin(self, subject: pb.Subject, token: int, request_id: str | None = None) -> pb.BeginSendResponse:
        return await self.stub.BeginSend(
            pb.BeginSendRequest(request_id=request_id or new_request_id(), subject=subject, fencing_token=token),
            metadata=self.metadata,
        )

    async def confirm(
        self, subject: pb.Subject, token: int, sent_message_id: str = "sent-1", request_id: str | None = None
    ) -> pb.ConfirmSentResponse:
        return await self.stub.ConfirmSent(
            pb.ConfirmSentRequest(
                request_id=request_id or new_request_id(),
                subject=subject,
                fencing_token=token,
                sent_message_id=sent_message_id,
            ),
            metadata=self.metadata,
        )

    async def abort(
        self, subject: pb.Subject, token: int, reason: str = "refused", request_id: str | None = None
    ) -> pb.AbortSendResponse:
        return await self.stub.AbortSend(
            pb.AbortSendRequest(
                request_id=request_id or new_request_id(), subject=subject, fencing_token=token, reason=reason
            ),
            metadata=self.metadata,
        )

    async def mark_replied(
        self,
        subject: pb.Subject,
        token: int,
        sent_message_id: str = "",
        note: str = "",
        request_id: str | None = None,
    ) -> pb.MarkRepliedResponse:
        return await self.stub.MarkReplied(
            pb.MarkRepliedRequest(
                request_id=request_id or new_request_id(),
                subject=subject,
                fencing_token=token,
                sent_message_id=sent_message_id,
                note=note,
            ),
            metadata=self.metadata,
        )

    async def status(self, subject: pb.Subject) -> pb.SubjectStatus:
        response = await self.stub.GetStatus(pb.GetStatusRequest(subject=subject), metadata=self.metadata)
        return response.status

    async def takeover(
        self, subject: pb.Subject, ttl: int = 0, note: str = "", from_person: str = ""
    ) -> pb.TakeoverResponse:
        return await self.stub.Takeover(
            pb.TakeoverRequest(
                request_id=new_request_id(), subject=subject, ttl_seconds=ttl, note=note, from_person=from_person
            ),
            metadata=self.metadata,
        )

    async def recent(self, mailbox: str, query: str = "", page_size: int = 0) -> pb.ListRecentMessagesResponse:
        return await self.stub.ListRecentMessages(
            pb.ListRecentMessagesRequest(mailbox=mailbox, query=query, page_size=page_size), metadata=self.metadata
        )

    async def resolve(
        self, subject: pb.Subject, outcome: int, sent_message_id: str = "", note: str = ""
    ) -> pb.ResolveInDoubtResponse:
        return await self.stub.ResolveInDoubt(
            pb.ResolveInDoubtRequest(
                request_id=new_request_id(),
                subject=subject,
                outcome=outcome,  # type: ignore[arg-type]
                sent_message_id=sent_message_id,
                note=note,
            ),
            metadata=self.metadata,
        )

    async def list(
        self, mailbox: str, states: tuple[int, ...] = (), page_size: int = 0, page_token: str = ""
    ) -> pb.ListClaimsResponse:
        return await self.stub.ListClaims(
            pb.ListClaimsRequest(
                mailbox=mailbox,
                states=states,  # type: ignore[arg-type]
                page_size=page_size,
                page_token=page_token,
            ),
            metadata=self.metadata,
        )

    async def batch(self, *calls: pb.BatchCall) -> tuple[pb.BatchResult, ...]:
        response = await self.stub.Batch(pb.BatchRequest(calls=calls), metadata=self.metadata)
        assert len(response.results) == len(calls)
        return tuple(response.results)

    def watch(self, mailbox: str) -> AsyncIterator[pb.WatchResponse]:
        return self.stub.Watch(pb.WatchRequest(mailbox=mailbox), metadata=self.metadata).__aiter__()


async def eventually(check: Callable[[], Awaitable[Any]], *, within: float = 10.0, interval: float = 0.1) -> Any:
    """Polls ``check`` until it returns a truthy value; fails with its last value after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within} s; last value: {value!r}")
        await asyncio.sleep(interval)


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """Awaits a call that must fail, and returns its error."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the call succeeded; an error status was expected")


def spawn(command: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """A process (``env`` added to its environment) whose output, stdout and stderr, is read line by line with
    ``wait_for_line``."""
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def wait_for_line(process: subprocess.Popen[str], needle: str) -> str:
    """The output up to the first line with ``needle``; fails (and kills the process) when it never comes."""
    assert process.stdout is not None
    seen = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen += line
        if needle in line:
            return seen
    process.kill()
    # Reaped and its pipes closed here: left to the garbage collector, they warn inside whichever test runs next.
    process.communicate()
    raise AssertionError(f"{needle!r} never printed:\n{seen}")


def error_reason(error: grpc.aio.AioRpcError) -> tuple[str, str, dict[str, str]]:
    """The google.rpc.ErrorInfo of an error status, as a client reads it: (reason, domain, metadata)."""
    info = _detail(error, error_details_pb2.ErrorInfo())
    assert info is not None, "the error's details hold no ErrorInfo"
    return info.reason, info.domain, dict(info.metadata)


def error_retry_delay_ms(error: grpc.aio.AioRpcError) -> int | None:
    """The google.rpc.RetryInfo delay of an error status, in milliseconds, when it has one."""
    retry = _detail(error, error_details_pb2.RetryInfo())
    return retry.retry_delay.ToMilliseconds() if retry is not None else None


def _detail(error: grpc.aio.AioRpcError, kind: T) -> T | None:
    view: Any = _CallView(error)
    status = rpc_status.from_call(view)
    assert status is not None, "the error carries no google.rpc.Status details"
    for detail in status.details:
        if detail.Unpack(kind):
            return kind
    return None


class _CallView:
    """What rpc_status.from_call reads of a (sync) grpc.Call, over an aio error, which has the same parts."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        self._error = error

    def code(self) -> grpc.StatusCode:
        return self._error.code()

    def details(self) -> str | None:
        return self._error.details()

    def trailing_metadata(self) -> Any:
        return tuple(self._error.trailing_metadata() or ())


@contextlib.contextmanager
def serve_process(*flags: str, env: Mapping[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """``inbox-coordinator serve`` in a process of its own (with ``env`` added to its environment), once it says
    it serves; stopped with SIGTERM after, and it must then exit 0 (a crash shows as a signal)."""
    process = spawn([sys.executable, "-m", "coordinator", "serve", *flags], env)
    wait_for_line(process, "serving gRPC on")
    try:
        yield process
    finally:
        stop_serving(process)


def stop_serving(process: subprocess.Popen[str]) -> None:
    """SIGTERM, and the process must exit 0 within 20 s (a crash shows as a signal, a hang as -9)."""
    assert process.stdout is not None
    process.terminate()
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.stdout.close()
    assert process.returncode == 0, f"the coordinator exited with {process.returncode}"


# A command run with a descriptor limit of its own (soft, hard), as `prlimit --nofile` would: set in a small Python
# that then execs the command, never in a preexec_fn (forking a process with grpc's threads and running Python in
# the child before exec can crash the child: a test run saw "Fatal Python error: Segmentation fault" there).
_LIMITED = (
    "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)


def with_descriptor_limit(command: list[str], soft: int, hard: int) -> list[str]:
    """``command`` run with RLIMIT_NOFILE set to (soft, hard); its first item must be an absolute path."""
    return [sys.executable, "-c", _LIMITED, str(soft), str(hard), *command]

"""The other hot paths through the coordinator, each against the raw etcd transactions that do the same work,
in the same run, alternating:

- ``contended``: every client claims one of a few hot subjects; after the first claim each answer is HELD.
  Raw etcd: the same put-if-absent on the same hot keys, failing and reading the holder.
- ``dedup``: ClaimReply with a notification_id (claim and delivery record in one transaction); a share of the
  calls redeliver an earlier notification (another worker, same webhook) and must answer DUPLICATE_DELIVERY.
  Raw etcd: one two-key put-if-absent transaction per call.
- ``cycle``: the full reply cycle, ClaimReply, BeginSend, ConfirmSent, on a fresh subject; one operation is a
  whole cycle. Raw etcd: the three transactions a client that keeps the revisions would need (create;
  compare-revision and write SENDING plus its deadline index; compare-revision and write REPLIED).
"""

from __future__ import annotations

import argparse
import contextlib
import random
from collections.abc import Callable
from typing import Any

from aetcd import rpc

from inbox_claims import AsyncCoordinator, Subject
from inbox_claims.types import ClaimOutcome
from inbox_wire.v1 import coordinator_pb2 as pb

from ._common import Environment, SetupError, Workload, add_common_arguments, alternate, run_id
from ._load import (
    COORDINATORS_HELP,
    Coordinators,
    Operation,
    add_shim_arguments,
    channel,
    client_objects,
    coordinator_stub,
    coordinator_workload,
    etcd_workload,
    metadata,
    parse_coordinators,
    put_if_absent,
    shim_counts,
    subject,
)

# Long enough that no claim expires during a run: etcd revoking the leases of an earlier round's claims would
# charge its CPU to whichever workload runs at that moment (the raw loop, whose keys never expire, most of all).
TTL_SECONDS = 3600
GRANTED = pb.ClaimReplyResponse.GRANTED
HELD = pb.ClaimReplyResponse.HELD
DUPLICATE = pb.ClaimReplyResponse.DUPLICATE_DELIVERY
OK = pb.FENCE_RESULT_OK


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_common_arguments(parser, seconds=4.0)
    parser.add_argument(
        "--coordinators",
        default="64x2,1",
        help=COORDINATORS_HELP,
    )
    add_shim_arguments(parser)
    if command == "contended":
        parser.add_argument("--hot", type=int, default=4, help="hot subjects all clients claim (default %(default)s)")
    if command == "dedup":
        parser.add_argument(
            "--redelivered",
            type=float,
            default=0.5,
            help="share of calls that redeliver an earlier notification (default %(default)s)",
        )


def _stamp(value: int) -> bytes:
    return f"rev-{value}".encode()


class _Paths:
    """The operations of one benchmark, for raw etcd and for a coordinator."""

    def __init__(self, command: str, options: argparse.Namespace, run: str) -> None:
        self.command = command
        self.options = options
        self.run = run

    def raw(self, kv: Any) -> Operation:
        run = self.run
        if self.command == "contended":
            hot = self.options.hot

            async def contend(index: int, n: int) -> None:
                await kv.Txn(put_if_absent(f"bench-raw/{run}/hot/{n % hot}".encode()))

            return contend
        if self.command == "dedup":
            redeliver = _Redeliveries(self.options.redelivered)

            async def dedup(index: int, n: int) -> None:
                key, notification, again = redeliver.next(index, n)
                response = await kv.Txn(
                    put_if_absent(
                        f"bench-raw/{run}/s/{key}".encode(), b"holder", f"bench-raw/{run}/d/{notification}".encode()
                    )
                )
                assert response.succeeded != again

            return dedup

        async def cycle(index: int, n: int) -> None:
            key = f"bench-raw/{run}/s/{n}".encode()
            index_key = f"bench-raw/{run}/x/{n}".encode()
            created = await kv.Txn(put_if_absent(key, b"CLAIMED"))
            assert created.succeeded
            sending = await kv.Txn(
                rpc.TxnRequest(
                    compare=[_same_revision(key, created.header.revision)],
                    success=[_put(key, b"SENDING"), _put(index_key, key)],
                )
            )
            assert sending.succeeded
            replied = await kv.Txn(
                rpc.TxnRequest(
                    compare=[_same_revision(key, sending.header.revision)],
                    success=[
                        _put(key, b"REPLIED"),
                        rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=index_key)),
                    ],
                )
            )
            assert replied.succeeded

        return cycle

    def coordinator(self, stub: Any, mailbox: str) -> Operation:
        if self.command == "contended":
            hot = self.options.hot

            async def contend(index: int, n: int) -> None:
                response = await stub.ClaimReply(
                    pb.ClaimReplyRequest(
                        request_id=f"{n}", subject=subject(mailbox, f"hot-{n % hot}"), ttl_seconds=3600
                    ),
                    metadata=metadata(index),
                )
                assert response.result in (GRANTED, HELD), response

            return contend
        if self.command == "dedup":
            redeliver = _Redeliveries(self.options.redelivered)

            async def dedup(index: int, n: int) -> None:
                key, notification, again = redeliver.next(index, n)
                response = await stub.ClaimReply(
                    pb.ClaimReplyRequest(
                        request_id=f"{n}",
                        subject=subject(mailbox, key),
                        ttl_seconds=TTL_SECONDS,
                        notification_id=notification,
                    ),
                    # A redelivery reaches another worker: another principal.
                    metadata=metadata(index + 10_000 if again else index),
                )
                assert response.result == (DUPLICATE if again else GRANTED), response

            return dedup

        async def cycle(index: int, n: int) -> None:
            who = metadata(index)
            target = subject(mailbox, f"{n}")
            claimed = await stub.ClaimReply(
                pb.ClaimReplyRequest(request_id=f"c{n}", subject=target, ttl_seconds=TTL_SECONDS), metadata=who
            )
            assert claimed.result == GRANTED, claimed
            token = claimed.status.fencing_token
            begun = await stub.BeginSend(
                pb.BeginSendRequest(request_id=f"b{n}", subject=target, fencing_token=token), metadata=who
            )
            assert begun.result == OK, begun
            confirmed = await stub.ConfirmSent(
                pb.ConfirmSentRequest(request_id=f"s{n}", subject=target, fencing_token=token, sent_message_id=f"m{n}"),
                metadata=who,
            )
            assert confirmed.result == OK, confirmed

        return cycle

    def shim(self, clients: list[AsyncCoordinator], mailbox: str) -> Operation:
        """The same operations through ``inbox_claims.AsyncCoordinator`` objects, client ``i`` on object
        ``i % len(clients)``: what each object's tasks call at the same time goes in one Batch RPC."""
        count = len(clients)
        if self.command == "contended":
            hot = self.options.hot

            async def contend(index: int, n: int) -> None:
                result = await clients[index % count].claim(Subject.message(mailbox, f"hot-{n % hot}"), ttl=3600)
                assert result.outcome in (ClaimOutcome.GRANTED, ClaimOutcome.HELD), result

            return contend
        if self.command == "dedup":
            redeliver = _Redeliveries(self.options.redelivered)

            async def dedup(index: int, n: int) -> None:
                key, notification, again = redeliver.next(index, n)
                result = await clients[index % count].claim(
                    Subject.message(mailbox, key), ttl=TTL_SECONDS, notification_id=notification
                )
                wanted = ClaimOutcome.DUPLICATE_DELIVERY if again else ClaimOutcome.GRANTED
                assert result.outcome is wanted, result

            return dedup

        async def cycle(index: int, n: int) -> None:
            client = clients[index % count]
            target = Subject.message(mailbox, f"{n}")
            claimed = await client.claim(target, ttl=TTL_SECONDS)
            assert claimed.granted, claimed
            assert (await client.begin_send(target, claimed.token)).ok
            assert (await client.confirm_sent(target, claimed.token, f"m{n}")).ok

        return cycle


class _Redeliveries:
    """Per client: a fresh (subject, notification) pair, or, with probability ``share``, the client's previous
    pair again (each pair is redelivered at most once)."""

    def __init__(self, share: float) -> None:
        self._share = share
        self._random = random.Random(7)
        self._last: dict[int, tuple[str, str]] = {}

    def next(self, index: int, n: int) -> tuple[str, str, bool]:
        last = self._last.pop(index, None)
        if last is not None and self._random.random() < self._share:
            return last[0], last[1], True
        pair = (f"{n}", f"notification-{n}")
        self._last[index] = pair
        return pair[0], pair[1], False


def _same_revision(key: bytes, revision: int) -> Any:
    return rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, mod_revision=revision)


def _put(key: bytes, value: bytes) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))


DESCRIPTIONS = {
    "contended": "ClaimReply on {hot} hot subjects (answers HELD after the first)",
    "dedup": "ClaimReply with notification_id, {redelivered:.0%} redelivered (DUPLICATE_DELIVERY)",
    "cycle": "full reply cycle: ClaimReply + BeginSend + ConfirmSent (one op = one cycle)",
}
RAW_NAMES = {
    "contended": "raw etcd put-if-absent, hot keys",
    "dedup": "raw etcd 2-key put-if-absent",
    "cycle": "raw etcd cycle: 3 txns",
}


def runner(command: str) -> Callable[[argparse.Namespace, Environment], Any]:
    async def run(options: argparse.Namespace, env: Environment) -> int:
        if command == "dedup" and not 0 <= options.redelivered < 1:
            raise SetupError("--redelivered is a share in [0, 1)")
        description = DESCRIPTIONS[command].format(**vars(options))
        print(f"== {command}: {description}; {options.clients} concurrent clients, {options.seconds:g} s rounds")
        print(env.describe())
        run_name = run_id()
        paths = _Paths(command, options, run_name)
        async with contextlib.AsyncExitStack() as stack:
            kv = rpc.KVStub(await stack.enter_async_context(channel(env.etcd.endpoint)))
            workloads: list[Workload] = [etcd_workload(env, RAW_NAMES[command], options.clients, paths.raw(kv))]
            variants = parse_coordinators(options.coordinators)
            coordinators = stack.enter_context(Coordinators(env, variants, run_name, rate_limit=options.rate_limit))
            for label, process in coordinators.processes:
                stub = coordinator_stub(await stack.enter_async_context(channel(process.address)))
                operation = paths.coordinator(stub, f"bench-{run_name}")
                workloads.append(
                    coordinator_workload(env, process, f"coordinator {command}, {label}", options.clients, operation)
                )
            for shims in shim_counts(options):
                label, process = coordinators.processes[0]
                clients = client_objects(stack, process.address, shims)
                operation = paths.shim(clients, f"bench-{run_name}-shim{shims}")
                name = f"coordinator {command} via inbox_claims, {shims} client object(s), {label}"
                workloads.append(coordinator_workload(env, process, name, options.clients, operation))
            await alternate(workloads, options.rounds, options.seconds)
        return 0

    return run

"""What replies written outside the coordinator cost (docs/design.md#replies-written-outside), on one coordinator,
alternating in the same run, against the baseline of a ClaimReply without a thread (the call as it was before):

- ``ClaimReply with a thread``: the same claim, with the message's thread and received time: one more key
  written in the transaction (the claim entering its thread) and one compare (the thread's latest outside reply).
- ``RecordOutgoing, nothing to end``: a reply written outside in a thread nobody claimed (its record only):
  one read of the thread's keys and one write.
- ``ClaimReply + RecordOutgoing ending it``: a claim made, then ended by a person's reply in its thread (one op is
  both calls): the RecordOutgoing reads the thread, reads the subject, and in one transaction ends the claim and
  records the reply. Its cost is this row's less the ClaimReply row's.
- ``the copy of an agent's reply``: ClaimReply, BeginSend, ConfirmSent, then RecordOutgoing of the sent message
  (OWN_REPLY, nothing written but the delivery record), against ``the reply cycle alone``.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from inbox_wire.v1 import coordinator_pb2 as pb

from ._common import Environment, add_common_arguments, alternate, run_id
from ._load import (
    Coordinators,
    Operation,
    Variant,
    channel,
    coordinator_stub,
    coordinator_workload,
    metadata,
    subject,
)

TTL_SECONDS = 3600  # no claim expires during a run (see bench/calls.py)
GRANTED = pb.ClaimReplyResponse.GRANTED
ANSWERED = pb.RecordOutgoingResponse.ANSWERED_OUTSIDE
OWN = pb.RecordOutgoingResponse.OWN_REPLY
OK = pb.FENCE_RESULT_OK
ASKED, ANSWERED_AT = Timestamp(seconds=1_700_000_000), Timestamp(seconds=1_700_000_300)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, seconds=4.0)


class _Operations:
    def __init__(self, stub: Any, mailbox: str) -> None:
        self.stub = stub
        self.mailbox = mailbox

    async def claim(self, index: int, n: int, tag: str, *, threaded: bool) -> pb.ClaimReplyResponse:
        thread = {"thread_id": f"t-{tag}-{n}", "received_at": ASKED} if threaded else {}
        request = pb.ClaimReplyRequest(
            request_id=f"c{tag}{n}",
            subject=subject(self.mailbox, f"{tag}-{n}"),
            ttl_seconds=TTL_SECONDS,
            **thread,  # type: ignore[arg-type]
        )
        response = await self.stub.ClaimReply(request, metadata=metadata(index))
        assert response.result == GRANTED, response
        return response  # type: ignore[no-any-return]

    async def outgoing(self, index: int, n: int, tag: str, message_id: str) -> pb.RecordOutgoingResponse:
        request = pb.RecordOutgoingRequest(
            request_id=f"o{tag}{n}",
            mailbox=self.mailbox,
            notification_id=f"n-{tag}-{n}",
            message_id=message_id,
            thread_id=f"t-{tag}-{n}",
            sent_at=ANSWERED_AT,
            sender="ana@shop.example",
        )
        return await self.stub.RecordOutgoing(request, metadata=metadata(index))  # type: ignore[no-any-return]

    async def cycle(self, index: int, n: int, tag: str) -> str:
        claimed = await self.claim(index, n, tag, threaded=True)
        target, token, who = subject(self.mailbox, f"{tag}-{n}"), claimed.status.fencing_token, metadata(index)
        begun = await self.stub.BeginSend(
            pb.BeginSendRequest(request_id=f"b{tag}{n}", subject=target, fencing_token=token), metadata=who
        )
        assert begun.result == OK, begun
        sent = f"sent-{tag}-{n}"
        confirmed = await self.stub.ConfirmSent(
            pb.ConfirmSentRequest(request_id=f"s{tag}{n}", subject=target, fencing_token=token, sent_message_id=sent),
            metadata=who,
        )
        assert confirmed.result == OK, confirmed
        return sent

    def operations(self) -> list[tuple[str, Operation]]:
        async def plain_claim(index: int, n: int) -> None:
            await self.claim(index, n, "plain", threaded=False)

        async def threaded_claim(index: int, n: int) -> None:
            await self.claim(index, n, "threaded", threaded=True)

        async def record_alone(index: int, n: int) -> None:
            answer = await self.outgoing(index, n, "alone", f"gmail-alone-{n}")
            assert answer.result == ANSWERED, answer
            assert not answer.subjects, answer

        async def claim_then_end(index: int, n: int) -> None:
            await self.claim(index, n, "ended", threaded=True)
            answer = await self.outgoing(index, n, "ended", f"gmail-ended-{n}")
            assert answer.result == ANSWERED, answer
            assert answer.subjects[0].replied_outside, answer

        async def cycle(index: int, n: int) -> None:
            await self.cycle(index, n, "cycle")

        async def cycle_and_copy(index: int, n: int) -> None:
            sent = await self.cycle(index, n, "copy")
            answer = await self.outgoing(index, n, "copy", sent)
            assert answer.result == OWN, answer

        return [
            ("ClaimReply, no thread (baseline)", plain_claim),
            ("ClaimReply with a thread", threaded_claim),
            ("RecordOutgoing, nothing to end", record_alone),
            ("ClaimReply + RecordOutgoing ending it", claim_then_end),
            ("the reply cycle alone (3 calls)", cycle),
            ("the reply cycle + its copy (OWN_REPLY)", cycle_and_copy),
        ]


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(
        f"== outgoing: what replies written outside cost; {options.clients} concurrent clients, {options.seconds:g} s"
    )
    print(env.describe())
    name = run_id()
    async with contextlib.AsyncExitStack() as stack:
        coordinators = stack.enter_context(Coordinators(env, [Variant(64, 2, False, False)], name, rate_limit=0))
        _, process = coordinators.processes[0]
        stub = coordinator_stub(await stack.enter_async_context(channel(process.address)))
        operations = _Operations(stub, f"bench-{name}").operations()
        workloads = [
            coordinator_workload(env, process, label, options.clients, operation) for label, operation in operations
        ]
        await alternate(workloads, options.rounds, options.seconds)
    return 0

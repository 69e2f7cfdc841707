"""Watch streams that never read, in a process of their own (as an abusive client would be), for the
slow-watchers benchmark and its test:

    python -m bench._hang ADDRESS MAILBOX STREAMS [--fixed-window]

Opens STREAMS Watch streams of the principal ``slow-watcher`` on MAILBOX, reads each one's snapshot, prints
``ready``, then reads nothing more until its standard input closes. Then it reads each stream to its end (at
most 10 s) and prints one JSON line: how many streams ended with each status ("still open" when none came)
and the process's peak RSS. ``--fixed-window`` turns gRPC's BDP probing off, so each stream's HTTP/2 receive
window stays at 64 KiB instead of growing (a client that stops reading then fills it sooner).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import sys
from collections import Counter

import grpc

from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

STREAMS_PER_CONNECTION = 100
PRINCIPAL = (("x-inbox-principal", "slow-watcher"),)


async def _final_status(call: grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchResponse]) -> str:
    try:
        async with asyncio.timeout(10.0):
            while await call.read() is not grpc.aio.EOF:
                pass
        return "OK"
    except TimeoutError:
        call.cancel()
        return "still open"
    except grpc.aio.AioRpcError as error:
        return error.code().name


async def _main(address: str, mailbox: str, streams: int, fixed_window: bool) -> None:
    async with contextlib.AsyncExitStack() as stack:
        stubs = []
        for _ in range(-(-streams // STREAMS_PER_CONNECTION)):
            options = [("grpc.use_local_subchannel_pool", 1)]
            if fixed_window:
                options.append(("grpc.http2.bdp_probe", 0))
            ch = grpc.aio.insecure_channel(address, options=options)
            stack.push_async_callback(ch.close)
            stubs.append(pb_grpc.CoordinatorStub(ch))
        calls = []
        for index in range(streams):
            call = stubs[index % len(stubs)].Watch(pb.WatchRequest(mailbox=mailbox), metadata=PRINCIPAL)
            await call.read()  # the snapshot
            calls.append(call)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        endings = Counter(await asyncio.gather(*(_final_status(c) for c in calls)))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({"endings": dict(endings), "peak_rss": peak}), flush=True)


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--fixed-window" in sys.argv[4:]))

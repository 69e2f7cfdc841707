"""The HTTP face under the attacks of docs/security.md ("The HTTP face under attack"), each against a real
``inbox-coordinator serve``: a DNS-rebinding page in Chromium, request heads that never end, connections that
never finish a request, more connections than the process has descriptors, bodies too large with or without a
length, a malformed Watch, principal names gRPC could not carry."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import resource
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from playwright.async_api import async_playwright

from coordinator.store.etcd.process import EtcdServer, free_port, free_ports
from inbox_wire.http_guard import DESCRIPTOR_RESERVE, HeadLimits
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, eventually, message, spawn, stop_serving, wait_for_line, with_descriptor_limit
from tests.server.test_board import CHROMIUM

pytestmark = pytest.mark.etcd  # starts coordinators on the shared etcd itself

CLI = [sys.executable, "-m", "coordinator"]
API = "/inbox.coordinator.v1.Coordinator/"
LIMITS = HeadLimits()


@dataclass
class Served:
    process: subprocess.Popen[str]
    grpc: str
    http: str
    metrics: str
    banner: str

    @property
    def http_host_port(self) -> tuple[str, int]:
        host, _, port = self.http.rpartition(":")
        return host, int(port)

    def peak_rss(self) -> int:
        """VmHWM: the most memory the process ever held."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def metric(self, sample: str) -> float:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(sample + " "):
                    return float(line.split()[-1])
        return 0.0

    def health(self) -> str:
        done = subprocess.run(
            [*CLI, "health", "--address", self.grpc, "--timeout", "3"], capture_output=True, text=True, check=False
        )
        return done.stdout.strip() or done.stderr.strip()


@contextlib.contextmanager
def served(etcd: EtcdServer, prefix: str, *flags: str, nofile: tuple[int, int] | None = None) -> Iterator[Served]:
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    command = [*CLI, "serve", "--listen", addresses[0], "--http-listen", addresses[1]]
    command += ["--metrics-listen", addresses[2], "--etcd-endpoints", etcd.endpoint, "--prefix", prefix, *flags]
    if nofile is not None:
        command = with_descriptor_limit(command, *nofile)
    process = spawn(command)
    banner = wait_for_line(process, "claims board on")
    try:
        yield Served(process, addresses[0], addresses[1], addresses[2], banner)
    finally:
        stop_serving(process)


def _raise_own_descriptor_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        assert hard >= needed, f"this test needs {needed} descriptors; the hard limit here is {hard}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _claim(address: str, subject: pb.Subject, who: str = "bystander") -> pb.ClaimReplyResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await asyncio.wait_for(Actor(channel, who).claim(subject), 5)


def _head(served: Served, *lines: str) -> bytes:
    return ("\r\n".join((f"POST {API}GetCaller HTTP/1.1", f"Host: {served.http}", *lines)) + "\r\n").encode()


async def _answer(reader: asyncio.StreamReader, within: float = 5.0) -> bytes:
    """What the coordinator answered before it closed the connection (b"" when it just closed)."""
    with contextlib.suppress(ConnectionError):
        return await asyncio.wait_for(reader.read(), within)
    return b""


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One answer, its head and its body (of the length it says), on a connection that stays open."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


# --- 1. DNS rebinding ----------------------------------------------------------------------------------------


async def test_a_dns_rebinding_page_in_chromium_can_neither_read_nor_take_a_claim(
    etcd: EtcdServer, prefix: str, mailbox: str
) -> None:
    with served(etcd, prefix) as coordinator:
        subject = message(mailbox, "invoice")
        assert (await _claim(coordinator.grpc, subject, "agent-a")).result == pb.ClaimReplyResponse.GRANTED
        _host, port = coordinator.http_host_port
        # The attacker's name resolves to this machine, as a rebinding DNS server makes it do; Private Network
        # Access (which would ask the coordinator first) is off, as in browsers that do not have it.
        args = [
            "--no-sandbox",
            "--disable-gpu",
            "--host-resolver-rules=MAP rebind.attacker.test 127.0.0.1",
            "--disable-features=PrivateNetworkAccessSendPreflights,PrivateNetworkAccessRespectPreflightResults,"
            "BlockInsecurePrivateNetworkRequests,LocalNetworkAccessChecks",
        ]
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=args)
            try:
                page = await browser.new_page()
                board = await page.goto(f"http://127.0.0.1:{port}/?mailbox={mailbox}")
                assert board is not None
                assert board.status == 200
                landing = await page.goto(f"http://rebind.attacker.test:{port}/")
                assert landing is not None
                assert landing.status == 421
                # The attacker's script, same-origin as far as the browser knows.
                answers = await page.evaluate(
                    """async ([mailbox, id]) => {
                        const headers = {"content-type": "application/json", "x-inbox-principal": "mallory",
                                         "x-inbox-principal-kind": "human"};
                        const post = async (method, body) => {
                          const r = await fetch("/inbox.coordinator.v1.Coordinator/" + method,
                                                {method: "POST", headers, body: JSON.stringify(body)});
                          return [r.status, await r.text()];
                        };
                        const subject = {mailbox, kind: "SUBJECT_KIND_MESSAGE", id};
                        return [await post("ListClaims", {mailbox}),
                                await post("Takeover", {requestId: "r1", subject, note: "mine now"})];
                    }""",
                    [mailbox, "invoice"],
                )
            finally:
                await browser.close()
        for status, body in answers:
            assert status == 421, body
            assert "invoice" not in body
        assert "--http-allowed-hosts" in answers[0][1]
        async with grpc.aio.insecure_channel(coordinator.grpc) as channel:
            status = await Actor(channel, "agent-a").status(subject)
        assert (status.state, status.holder) == (pb.SUBJECT_STATE_CLAIMED, "agent-a")
        assert coordinator.metric('inbox_coordinator_http_refusals_total{reason="host_not_allowed"}') >= 3


def _curl(*args: str, data: bytes | None = None) -> tuple[int, str]:
    """curl's status and body; ``data`` is sent as the body (``--data-binary @-``), as it is."""
    curl = shutil.which("curl")
    assert curl is not None, "curl is needed (apt-get install curl; .ci/run installs it)"
    stdin = ["--data-binary", "@-"] if data is not None else []
    done = subprocess.run(
        [curl, "-s", "-o", "-", "-w", "\n%{http_code}", *args, *stdin], input=data, capture_output=True, check=False
    )
    body, _, code = done.stdout.decode().rpartition("\n")
    return int(code), body


def test_curl_with_another_host_or_a_cross_origin_page_is_refused_and_a_proxy_name_is_served(
    etcd: EtcdServer, prefix: str
) -> None:
    caller = ["-H", "content-type: application/json", "-H", "x-inbox-principal: mallory", "-d", "{}"]
    with served(etcd, prefix, "--http-allowed-hosts", "inbox.example.com") as coordinator:
        url = f"http://{coordinator.http}{API}GetCaller"
        assert _curl(url, *caller)[0] == 200
        assert _curl(url, "-H", f"Host: localhost:{coordinator.http_host_port[1]}", *caller)[0] == 200
        code, body = _curl(url, "-H", "Host: evil.example:8081", *caller)
        assert code == 421
        assert "evil.example" in json.loads(body)["message"]
        assert "roles" not in body
        # Behind a proxy: the name it forwards is served, same-origin calls from its pages too.
        assert _curl(url, "-H", "Host: inbox.example.com", *caller)[0] == 200
        proxied = ["-H", "Host: inbox.example.com", "-H", "Origin: https://inbox.example.com"]
        assert _curl(url, *proxied, *caller)[0] == 200
        # A page of another origin (another site, another local port, a sandboxed frame) calls in vain.
        for origin in ("http://evil.example", f"http://127.0.0.1:{free_port()}", "null"):
            code, body = _curl(url, "-H", f"Origin: {origin}", *caller)
            assert code == 403, origin
            assert json.loads(body)["code"] == "permission_denied"
        assert _curl(url, "-H", f"Origin: http://{coordinator.http}", *caller)[0] == 200


# --- 2. request heads ----------------------------------------------------------------------------------------


async def test_a_request_head_that_never_ends_is_cut_off_before_it_costs_memory(etcd: EtcdServer, prefix: str) -> None:
    with served(etcd, prefix) as coordinator:
        before = coordinator.peak_rss()
        host, port = coordinator.http_host_port
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_head(coordinator) + b"X-Big: ")
        answered = asyncio.create_task(_answer(reader, within=30))
        sent = 0
        with contextlib.suppress(ConnectionError):
            block = b"a" * (1 << 20)
            while sent < 64 << 20 and not answered.done():
                writer.write(block)
                await writer.drain()
                await asyncio.sleep(0)  # drain() does not yield while the socket takes everything
                sent += len(block)
        answer = await answered
        writer.close()
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert f"over {LIMITS.header_line_max_bytes} bytes".encode() in answer
        # Answered while the line was still coming (what is sent meanwhile fills the sockets' buffers).
        assert sent < 32 << 20, f"answered only after {sent >> 20} MiB of one header line"
        assert coordinator.peak_rss() - before < 16 << 20
        # Many small header lines, their sum, a long request line: each has its limit.
        for head, status, words in (
            (_head(coordinator, *(f"X-{n}: b" for n in range(LIMITS.header_count_max + 1))), b"431", b"headers"),
            (_head(coordinator, *(f"X-{n}: {'c' * 1000}" for n in range(40))), b"431", b"headers are over 32768"),
            (f"GET /{'d' * (LIMITS.request_line_max_bytes + 1)} HTTP/1.1\r\n".encode(), b"414", b"request line"),
        ):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head + b"\r\n")
            answer = await _answer(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
            assert words in answer
        # The coordinator goes on answering.
        assert (await _claim(coordinator.grpc, message("heads", "m"))).result == pb.ClaimReplyResponse.GRANTED


# --- 3. connections held -------------------------------------------------------------------------------------


@dataclass
class _Held:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    closed_after: float | None = None
    answer: bytes = b""


async def _hold(served: Served, first: bytes, trickle: bytes = b"", every: float = 0.0) -> _Held:
    host, port = served.http_host_port
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(first)
    held = _Held(reader, writer)
    started = time.monotonic()

    async def watch() -> None:
        held.answer = await _answer(reader, within=30)
        held.closed_after = time.monotonic() - started
        writer.close()

    async def feed() -> None:
        with contextlib.suppress(ConnectionError):
            while every and held.closed_after is None:
                await asyncio.sleep(every)
                writer.write(trickle)
                await writer.drain()

    held_tasks.update({asyncio.create_task(watch()), asyncio.create_task(feed())})
    return held


held_tasks: set[asyncio.Task[None]] = set()


@pytest.fixture(autouse=True)
async def _no_task_left() -> AsyncIterator[None]:
    yield
    for task in held_tasks:
        task.cancel()
    await asyncio.gather(*held_tasks, return_exceptions=True)
    held_tasks.clear()


async def test_connections_that_never_finish_a_request_are_closed_and_others_are_served_meanwhile(
    etcd: EtcdServer, prefix: str
) -> None:
    timeouts = ["--http-header-timeout", "1s", "--http-idle-timeout", "1s", "--request-timeout", "1s"]
    with served(etcd, prefix, *timeouts) as coordinator:
        body = _head(coordinator, "content-type: application/json", "content-length: 100000", "") + b'{"a'
        kept_alive = _head(coordinator, "content-type: application/json", "x-inbox-principal: ana", "content-length: 2")
        groups = {
            "idle": [await _hold(coordinator, b"") for _ in range(100)],
            "slowloris": [
                await _hold(coordinator, b"GET / HTTP/1.1\r\n", b"X-a: b\r\n", every=0.3) for _ in range(100)
            ],
            "unfinished body": [await _hold(coordinator, body) for _ in range(50)],
            "kept alive": [await _hold(coordinator, kept_alive + b"\r\n{}") for _ in range(20)],
        }
        every = [held for group in groups.values() for held in group]
        assert coordinator.metric("inbox_coordinator_http_connections") > 0
        assert (await _claim(coordinator.grpc, message("held", "m"))).result == pb.ClaimReplyResponse.GRANTED
        assert "SERVING" in coordinator.health()
        deadline = time.monotonic() + 6
        while any(held.closed_after is None for held in every) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        for name, group in groups.items():
            still_open = sum(held.closed_after is None for held in group)
            assert still_open == 0, f"{still_open} of {len(group)} {name} connections still open after 6 s"
        assert {held.answer for held in groups["idle"]} == {b""}  # never asked anything: closed, no answer
        for name in ("slowloris", "unfinished body"):
            assert all(held.answer.startswith(b"HTTP/1.1 408 ") for held in groups[name]), name
        assert all(held.answer.startswith(b"HTTP/1.1 200 ") for held in groups["kept alive"])
        assert all(b"HTTP/1.1" not in held.answer.split(b"\r\n\r\n", 1)[1] for held in groups["kept alive"])
        await eventually(lambda: _none_open(coordinator), within=3)
        assert coordinator.metric('inbox_coordinator_http_refusals_total{reason="body_timeout"}') == 50


async def _none_open(coordinator: Served) -> bool:
    return coordinator.metric("inbox_coordinator_http_connections") == 0


async def test_under_a_descriptor_limit_no_number_of_http_connections_stops_grpc_or_health(
    etcd: EtcdServer, prefix: str
) -> None:
    _raise_own_descriptor_limit(1400)
    with served(etcd, prefix, nofile=(1024, 1024)) as coordinator:
        cap = 1024 - DESCRIPTOR_RESERVE
        assert f"at most {cap} connections, lowered from 1000" in coordinator.banner
        line = b"GET / HTTP/1.1\r\nHost: " + coordinator.http.encode() + b"\r\n"
        held = []
        for index in range(1100):
            held.append(await _hold(coordinator, line, b"X-a: b\r\n", every=0.5))
            if index % 100 == 99:
                await asyncio.sleep(0.05)
        await asyncio.sleep(1)
        started = time.monotonic()
        assert (await _claim(coordinator.grpc, message("fds", "m"))).result == pb.ClaimReplyResponse.GRANTED
        health = coordinator.health()
        assert health.endswith("SERVING"), health
        assert time.monotonic() - started < 5
        refused = [h for h in held if h.closed_after is not None]
        assert len(refused) >= 1100 - cap
        # Refused at once: a 503 saying why, or (when the client's first bytes crossed the refusal) just a reset.
        assert all(h.closed_after is not None and h.closed_after < 3 for h in refused)
        assert {h.answer[:13] for h in refused} <= {b"HTTP/1.1 503 ", b""}
        assert any(b"--http-max-connections" in h.answer for h in refused)
        assert coordinator.metric("inbox_coordinator_http_connections") <= cap
        assert coordinator.metric('inbox_coordinator_http_refusals_total{reason="over_capacity"}') >= 1100 - cap


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one_at_start(etcd: EtcdServer, prefix: str) -> None:
    with served(etcd, prefix, nofile=(1024, 4096)) as coordinator:
        assert "at most 1000 connections)" in coordinator.banner
        limits = Path(f"/proc/{coordinator.process.pid}/limits").read_text()
        assert any(
            line.startswith("Max open files") and line.split()[3:5] == ["4096", "4096"] for line in limits.splitlines()
        )


# --- 4., 8. bodies, streams, principals ----------------------------------------------------------------------


async def test_a_body_over_the_limit_is_413_chunked_or_not_and_a_malformed_watch_says_why(
    etcd: EtcdServer, prefix: str
) -> None:
    with served(etcd, prefix, "--max-message-bytes", "65536") as coordinator:
        host, port = coordinator.http_host_port
        json_headers = ("content-type: application/json", "x-inbox-principal: ana")
        for framing in ("transfer-encoding: chunked", f"content-length: {160 * 65536}"):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(_head(coordinator, *json_headers, framing, ""))
            with contextlib.suppress(ConnectionError):
                chunk = b"a" * 65536
                for _ in range(160):  # 10 MiB, in 64 KiB chunks (or one body of that length)
                    writer.write(b"10000\r\n" + chunk + b"\r\n" if "chunked" in framing else chunk)
                    await writer.drain()
            answer = await asyncio.wait_for(_response(reader), 5)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 413 "), (framing, answer[:200])
            assert b"--max-message-bytes" in answer
        watch = f"http://{coordinator.http}{API}Watch"
        request = json.dumps({"mailbox": "box"}).encode()
        stream_headers = ["-H", "content-type: application/connect+json", "-H", "x-inbox-principal: ana"]
        for body in (request, struct.pack(">BI", 0, len(request) + 9) + request):  # no envelope; a wrong length
            code, text = _curl(watch, *stream_headers, "-H", "transfer-encoding: chunked", data=body)
            assert code == 400, text
            assert "not one Connect envelope" in json.loads(text)["message"]
        # One envelope, chunked: the stream starts with its snapshot.
        enveloped = struct.pack(">BI", 0, len(request)) + request
        reader, writer = await asyncio.open_connection(host, port)
        head = f"POST {API}Watch HTTP/1.1\r\nHost: {coordinator.http}\r\ncontent-type: application/connect+json\r\n"
        head += "x-inbox-principal: ana\r\ntransfer-encoding: chunked\r\n\r\n"
        writer.write(head.encode() + b"%x\r\n" % len(enveloped) + enveloped + b"\r\n0\r\n\r\n")
        first = await asyncio.wait_for(reader.readuntil(b"snapshot"), 5)
        writer.close()
        assert first.startswith(b"HTTP/1.1 200 ")


async def test_principal_headers_and_page_tokens_over_http_are_checked_as_over_grpc(
    etcd: EtcdServer, prefix: str
) -> None:
    with served(etcd, prefix) as coordinator:
        host, port = coordinator.http_host_port
        for value in (b"Jos\xe9", "José".encode(), b"ana\tb"):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                _head(coordinator, "content-type: application/json", "content-length: 2").replace(
                    b"\r\ncontent-type", b"\r\nx-inbox-principal: " + value + b"\r\ncontent-type"
                )
                + b"\r\n{}"
            )
            answer = await asyncio.wait_for(_response(reader), 5)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
            assert b"x-inbox-principal header" in answer
            assert b"printable ASCII" in answer
        # A body that is not the protobuf it says it is: the caller's error, not the server's.
        code, text = _curl(
            f"http://{coordinator.http}{API}GetCaller",
            *("-H", "content-type: application/proto", "-H", "x-inbox-principal: ana"),
            data=b"\xff\xff\xff",
        )
        assert code == 400, text
        assert json.loads(text)["code"] == "invalid_argument"
        nested = "v1:" + base64.urlsafe_b64encode(b"[" * 1400 + b"]" * 1400).decode()
        code, body = _curl(
            f"http://{coordinator.http}{API}ListClaims",
            *("-H", "content-type: application/json", "-H", "x-inbox-principal: ana"),
            *("-d", json.dumps({"mailbox": "box", "pageToken": nested})),
        )
        assert code == 400, body
        assert "page_token" in json.loads(body)["message"]


# --- 8. ports taken ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("face", ["--listen", "--http-listen"])
def test_a_taken_port_is_one_line_naming_it(etcd: EtcdServer, prefix: str, face: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        grpc_port, http_port = free_ports(2)
        ports = {"--listen": f"127.0.0.1:{grpc_port}", "--http-listen": f"127.0.0.1:{http_port}", face: address}
        done = subprocess.run(
            [
                *CLI,
                "serve",
                *(item for pair in ports.items() for item in pair),
                "--metrics-listen",
                "",
                "--etcd-endpoints",
                etcd.endpoint,
                "--prefix",
                prefix,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert address in lines[0], lines[0]
    assert "taken" in lines[0], lines[0]
    assert face in lines[0], lines[0]

"""The provider doubles over real HTTP: an ASGI face for a double's ``answer(HttpRequest) -> HttpResponse``, served
by uvicorn in a thread of its own (for agents in other processes: the examples, the benchmark)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

import uvicorn

from inbox_claims.providers._seam import HttpRequest, HttpResponse

Answerer = Callable[[HttpRequest], HttpResponse]
Scope = MutableMapping[str, Any]


def asgi_of(answer: Answerer) -> Callable[[Scope, Any, Any], Awaitable[None]]:
    """An ASGI app that hands every request to ``answer`` as the providers' ``HttpRequest`` (the URL as requested,
    the query as parameters, the JSON body decoded, and the body's bytes as sent) and writes back its
    ``HttpResponse``."""

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"])
        host = dict(headers).get("host", "localhost")
        try:
            document = json.loads(body) if body else None
        except ValueError:
            document = None
        request = HttpRequest(
            scope["method"],
            f"{scope['scheme']}://{host}{scope['path']}",
            tuple(parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)),
            headers,
            document,
            body or None,  # the body's bytes as sent (Graph's base64 MIME, an idempotency key's payload)
        )
        response = answer(request)
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()]
        await send({"type": "http.response.start", "status": response.status, "headers": out})
        await send({"type": "http.response.body", "body": response.content})

    return app


@contextlib.contextmanager
def served(answer: Answerer) -> Iterator[str]:
    """Serves ``answer`` on a free loopback port from a thread of its own; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(asgi_of(answer), log_level="warning", lifespan="off", ws="none"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the double's server did not start")
            threading.Event().wait(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        loop.close()
        sock.close()

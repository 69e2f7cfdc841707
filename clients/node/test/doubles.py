"""Serves one of the repository's provider doubles (tests/providers/fake_graph.py, fake_gmail.py, fake_nylas_api.py:
they follow the providers' documented behaviour, never our code) over real HTTP for the Node client's scenario tests,
which start it as a process: ``$PYTHON clients/node/test/doubles.py gmail '{"address": "a@b.example"}'`` (the
double's settings) prints ``listening on http://127.0.0.1:<port>`` and serves until stdin closes.

* Every request but ``/_double`` goes to the double's ``answer(HttpRequest)``, with the double's own origin in the
  URL (``https://graph.test``, ``https://gmail.test``) and the served origin in its answer (Graph's delta links).
* ``POST /_double`` drives the double as a test does in Python: ``{"call": "receive", "args": [...], "kwargs":
  {...}}`` calls a method, ``{"get": "sends"}`` reads an attribute, ``{"set": "send_failure", "value": ...}``
  sets one; with ``"at"``, a path of attribute and item names, the call is made on what the path reaches
  (``{"at": ["failing"], "call": "__setitem__", "args": ["messages.get", 1]}``), as a Python test changes the
  double's state in place; the answer is the result as JSON (bytes as text, dataclasses as objects).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import uvicorn

from inbox_claims.providers._seam import HttpRequest, HttpResponse
from tests.providers.serving import asgi_of


def _double(name: str, settings: dict[str, Any]) -> tuple[Any, str]:
    """The double (made with ``settings`` as keyword arguments) and its own origin."""
    if name == "graph":
        from tests.providers import fake_graph

        return fake_graph.FakeGraph(**settings), "{0.scheme}://{0.netloc}".format(urlsplit(fake_graph.BASE))
    if name == "gmail":
        from tests.providers import fake_gmail

        return fake_gmail.FakeGmail(**settings), fake_gmail.BASE
    if name == "nylas":
        from tests.providers import fake_nylas_api

        return fake_nylas_api.FakeNylasApi(**settings), fake_nylas_api.BASE
    raise SystemExit(f"no double called {name!r}: graph, gmail or nylas")


def _plain(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def main() -> None:
    double, origin = _double(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections wait in the backlog until uvicorn accepts them
    served = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def answer(request: HttpRequest) -> HttpResponse:
        if request.url == f"{served}/_double":
            order = request.json_body
            target = double
            for step in order.get("at", []):
                target = target[step] if isinstance(target, dict) else getattr(target, step)
            if "call" in order:
                result = getattr(target, order["call"])(*order.get("args", []), **order.get("kwargs", {}))
            elif "set" in order:
                setattr(double, order["set"], order["value"])
                result = None
            else:
                result = getattr(double, order["get"])
            return HttpResponse(200, json.dumps(result, default=_plain).encode(), {"content-type": "application/json"})
        url = origin + request.url[len(served) :]
        asked = HttpRequest(request.method, url, request.params, request.headers, request.json_body, request.content)
        given = double.answer(asked)
        return HttpResponse(given.status, given.content.replace(origin.encode(), served.encode()), dict(given.headers))

    server = uvicorn.Server(uvicorn.Config(asgi_of(answer), log_level="warning", lifespan="off", ws="none"))
    threading.Thread(target=lambda: (sys.stdin.read(), setattr(server, "should_exit", True)), daemon=True).start()
    print(f"listening on {served}", flush=True)
    asyncio.run(server.serve(sockets=[sock]))


if __name__ == "__main__":
    main()

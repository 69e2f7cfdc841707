"""``inbox-coordinator``: run a coordinator, on an embedded etcd by default."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from .domain import Rules
from .etcd_process import EtcdMemberSpec, EtcdNotFound, EtcdServer, EtcdStartError, free_port
from .limits import Limits
from .server import CoordinatorServer, ServerSettings
from .store import EtcdSettings, channel_target

log = logging.getLogger("inbox_coordinator")


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "inbox-coordinator"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inbox-coordinator",
        description="Claims on email replies for shared inboxes: a gRPC lease service on etcd.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run a coordinator",
        description=(
            "Run a coordinator. Without --etcd-endpoints it starts a private single-member etcd on loopback "
            "(development mode; data kept in --data-dir)."
        ),
        epilog=(
            "examples:\n"
            "  inbox-coordinator serve\n"
            "  inbox-coordinator serve --listen 0.0.0.0:50051 --etcd-endpoints 10.0.0.5:2379,10.0.0.6:2379"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT for gRPC (default %(default)s)")
    serve.add_argument(
        "--etcd-endpoints",
        default=os.environ.get("INBOX_COORDINATOR_ETCD_ENDPOINTS", ""),
        help="comma-separated etcd client endpoints HOST:PORT; empty starts the embedded etcd",
    )
    serve.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"where the embedded etcd keeps its data (default {default_data_dir()})",
    )
    serve.add_argument("--prefix", default="inbox-coordinator/v1/", help="etcd key prefix (default %(default)s)")
    serve.add_argument("--default-ttl", type=int, default=60, help="claim TTL when a call gives none, seconds")
    serve.add_argument("--send-timeout", type=float, default=120.0, help="seconds from BeginSend to IN_DOUBT")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def _embedded_spec(data_dir: Path) -> EtcdMemberSpec:
    """The embedded member's ports, chosen once and kept beside its data so that restarts find it again."""
    ports_file = data_dir / "ports.json"
    if ports_file.exists():
        ports = json.loads(ports_file.read_text())
        return EtcdMemberSpec("embedded", ports["client"], ports["peer"])
    spec = EtcdMemberSpec("embedded", free_port(), free_port())
    data_dir.mkdir(parents=True, exist_ok=True)
    ports_file.write_text(json.dumps({"client": spec.client_port, "peer": spec.peer_port}))
    return spec


@contextlib.contextmanager
def _embedded_etcd(data_dir: Path) -> Iterator[EtcdServer]:
    etcd = EtcdServer(data_dir / "etcd", spec=_embedded_spec(data_dir), log_path=data_dir / "etcd.log")
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.stop()


async def _serve(settings: ServerSettings) -> None:
    server = CoordinatorServer(settings)
    await server.start()
    print(f"inbox-coordinator: serving gRPC on {server.address}; stop with Ctrl-C or SIGTERM", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    print("inbox-coordinator: stopping (finishing calls in flight)", flush=True)
    await server.stop()


def serve(options: argparse.Namespace) -> int:
    logging.basicConfig(level=options.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    endpoints = [e.strip() for e in options.etcd_endpoints.split(",") if e.strip()]
    try:
        if endpoints:
            channel_target(endpoints)
        limits = Limits(ttl_default_seconds=options.default_ttl)
        limits.ttl(options.default_ttl)
    except ValueError as error:
        print(f"inbox-coordinator: {error}", file=sys.stderr)
        return 2
    rules = Rules(limits, send_timeout_ms=int(options.send_timeout * 1000))

    def settings_for(etcd_endpoints: Sequence[str]) -> ServerSettings:
        return ServerSettings(EtcdSettings(etcd_endpoints, prefix=options.prefix), listen=options.listen, rules=rules)

    try:
        if endpoints:
            asyncio.run(_serve(settings_for(endpoints)))
            return 0
        data_dir = options.data_dir or default_data_dir()
        print(
            f"inbox-coordinator: DEVELOPMENT MODE: embedded single-member etcd, data in {data_dir} "
            "(use --etcd-endpoints for a real cluster)",
            flush=True,
        )
        with _embedded_etcd(data_dir) as etcd:
            print(f"inbox-coordinator: embedded etcd {etcd.endpoint} (log: {etcd.log_path})", flush=True)
            asyncio.run(_serve(settings_for([etcd.endpoint])))
        return 0
    except (EtcdNotFound, EtcdStartError, OSError) as error:
        print(f"inbox-coordinator: {error}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if options.command == "serve":
        return serve(options)
    raise AssertionError(options.command)


if __name__ == "__main__":
    sys.exit(main())

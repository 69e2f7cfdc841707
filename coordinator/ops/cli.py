"""``inbox-coordinator``: run a coordinator (on an embedded etcd by default), check a configuration, probe health.

Exit codes: 0 done; 1 a runtime failure (etcd unreachable, a port taken, no etcd binary, not SERVING);
2 a configuration error (the message names the setting and where its value came from).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import resource
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator import tracing
from coordinator.api import tls_log
from coordinator.api.addresses import parse_host_port
from coordinator.api.auth import ROLES, TokenAuthenticator, TokenFileError, new_token
from coordinator.core.errors import StoreUnavailable
from coordinator.ops import logs
from coordinator.ops.config import (
    SETTINGS,
    Config,
    ConfigError,
    default_data_dir,
    describe,
    format_duration,
    format_size,
    load,
)
from coordinator.ops.server import SERVICE_NAME, CoordinatorServer, ServerSettings, wall_clock_ms
from coordinator.store.etcd.clock_frames import ClockFrames
from coordinator.store.etcd.embedded import (
    EmbeddedEtcd,
    EmbeddedEtcdError,
    EmbeddedSettings,
    etcd_for_data_dir,
    version_problem,
)
from coordinator.store.etcd.process import (
    EtcdNotFound,
    EtcdStartError,
    etcd_version,
    is_broken_version,
    version_tuple,
)
from coordinator.store.etcd.store import EtcdStore
from inbox_wire.http_guard import DESCRIPTOR_RESERVE, raise_descriptor_limit

log = logging.getLogger("inbox_coordinator")

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG = 0, 1, 2

_PRECEDENCE = (
    "Every setting is also read from the environment (INBOX_COORDINATOR_<SETTING>, e.g. INBOX_COORDINATOR_LISTEN) "
    "and from the TOML file of --config (top-level keys named like the flags, with underscores: default_ttl = 60). "
    "Flags win over the environment, which wins over the file. Durations are seconds or take a unit: 250ms, 90s, "
    "5m, 72h, 1d."
)


def _add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="a TOML file of settings (default: $INBOX_COORDINATOR_CONFIG, else none)",
    )
    for setting in SETTINGS:
        shown = f" (default {setting.show(setting.default)})" if setting.default not in ((), None, False, "") else ""
        if isinstance(setting.default, bool):
            # A switch: given alone it means true; a value (true/false) is accepted too, as in the file.
            parser.add_argument(
                setting.flag,
                dest=setting.name,
                default=None,
                nargs="?",
                const="true",
                metavar="BOOL",
                help=setting.help,
            )
            continue
        parser.add_argument(
            setting.flag,
            *setting.aliases,
            dest=setting.name,
            default=None,
            metavar=setting.metavar or setting.name.upper(),
            help=f"{setting.help}{shown}",
        )


def build_parser() -> argparse.ArgumentParser:
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
            "(development mode; data kept in --data-dir). " + _PRECEDENCE
        ),
        epilog=(
            "examples:\n"
            "  inbox-coordinator serve\n"
            "  inbox-coordinator serve --listen 0.0.0.0:50051 --etcd-endpoints 10.0.0.5:2379,10.0.0.6:2379\n"
            "  inbox-coordinator serve --config /etc/inbox-coordinator/config.toml"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_settings(serve)
    check = commands.add_parser(
        "check",
        help="validate the configuration and reach every etcd endpoint",
        description=(
            "Validate the configuration (as serve would read it), connect to each etcd endpoint and print its "
            "version. Exits 2 for a configuration error, 1 when an etcd endpoint is unreachable. " + _PRECEDENCE
        ),
    )
    _add_settings(check)
    health = commands.add_parser(
        "health",
        help="ask a running coordinator whether it is SERVING (for container health checks)",
        description="grpc.health.v1 Check against a coordinator. Exits 0 when SERVING, 1 otherwise.",
    )
    health.add_argument("--config", metavar="FILE.toml", default=None, help="read listen from this TOML file")
    health.add_argument(
        "--address",
        default=None,
        help="HOST:PORT to ask (default: the listen setting, with 0.0.0.0 or [::] asked on loopback)",
    )
    health.add_argument(
        "--service", default=SERVICE_NAME, help="the health service name (default %(default)s; '' for the server)"
    )
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    health.add_argument(
        "--ca-file",
        type=Path,
        default=None,
        help="ask over TLS, trusting this CA (default: over TLS trusting tls_cert when the configuration has one)",
    )
    health.add_argument(
        "--cert-file",
        type=Path,
        default=None,
        help="a client certificate (PEM) to present, for a coordinator that requires one (mTLS)",
    )
    health.add_argument("--key-file", type=Path, default=None, help="the client certificate's private key (PEM)")
    health.add_argument(
        "--server-name", default=None, help="the name the server's certificate carries, when not the address's host"
    )
    token = commands.add_parser(
        "token",
        help="make a bearer token for a principal",
        description=(
            "Print a new random bearer token (give it to the client, once) and the line that stores its SHA-256 in "
            "the token file. The coordinator never sees or stores the token itself."
        ),
        epilog="example:\n  inbox-coordinator token new --id support-agent-1 --kind agent --mailbox 'acme-*'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    token_commands = token.add_subparsers(dest="token_command", required=True)
    new = token_commands.add_parser("new", help="a new token and its token-file entry")
    new.add_argument("--id", required=True, help="the principal's id (the holder name of its claims)")
    new.add_argument("--kind", choices=("agent", "human"), default="agent")
    new.add_argument("--mailbox", action="append", default=[], help="a granted mailbox or glob (repeatable)")
    new.add_argument("--role", action="append", default=[], choices=sorted(ROLES), help="a role (repeatable)")
    return parser


def _load(options: argparse.Namespace) -> Config | None:
    flags = {setting.name: getattr(options, setting.name, None) for setting in SETTINGS}
    try:
        config = load(flags, config_file=options.config)
    except ConfigError as error:
        print(f"inbox-coordinator: configuration error: {error}", file=sys.stderr)
        return None
    for warning in config.warnings:
        print(f"inbox-coordinator: warning: {warning}", file=sys.stderr)
    return config


# --- serve ---------------------------------------------------------------------------------------------------


def server_settings(config: Config, endpoints: Sequence[str] | None = None) -> ServerSettings:
    """Raises TokenFileError when the token file cannot be used."""
    return ServerSettings(
        config.etcd_settings(endpoints),
        listen=config.listen,
        rules=config.rules(),
        shutdown_grace_s=config.shutdown_grace,
        metrics_listen=config.metrics_listen,
        # The default port may be taken by another coordinator on this machine: then there is no /metrics.
        # A port that was asked for is a start-up error.
        metrics_optional=config.origin("metrics_listen") == "default",
        key_count_interval_s=config.key_count_interval,
        authenticator=TokenAuthenticator(config.token_file) if config.token_file is not None else None,
        tls=config.tls(),
        quotas=config.quotas(),
        max_message_bytes=config.max_message_bytes,
        request_timeout_s=config.request_timeout,
        access_log=config.access_log,
        max_streams_per_connection=config.max_streams_per_connection,
        http_listen=config.http_address,
        # The default port may be taken by another development coordinator: then there is no HTTP face.
        http_optional=config.origin("http_listen") == "default",
        http_header_timeout_s=config.http_header_timeout,
        http_idle_timeout_s=config.http_idle_timeout,
        http_max_connections=config.http_max_connections,
        http_allowed_hosts=config.http_allowed_hosts,
    )


def board_line(server: CoordinatorServer) -> str:
    """The banner's line about the HTTP face: where the claims board is (and, when its default port was taken,
    that it moved), or why there is none; empty when it was not asked for."""
    settings = server.settings
    if server.http is not None:
        scheme = "https" if settings.tls is not None else "http"
        cap = server.http.connection_cap
        lowered = (
            f", lowered from {settings.http_max_connections} to keep {DESCRIPTOR_RESERVE} of the process's "
            f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]} descriptors for gRPC and etcd"
            if cap < settings.http_max_connections
            else ""
        )
        moved = (
            f"; port {server.http.taken_port} is taken by another program, so this coordinator took the next free "
            "one (--http-listen chooses)"
            if server.http.taken_port is not None
            else ""
        )
        return (
            f"inbox-coordinator: claims board on {scheme}://{server.http.address}/ "
            f"(HTTP/JSON API under /{SERVICE_NAME}/; at most {cap} connections{lowered}{moved})"
        )
    if server.http_problem:
        return f"inbox-coordinator: no claims board: {server.http_problem} (--http-listen chooses)"
    return ""


async def _serve(settings: ServerSettings, embedded: EmbeddedEtcd | None = None) -> None:
    """Serve until SIGINT or SIGTERM; the embedded etcd's keeper (``embedded.supervise``) ending with an error
    stops the server too, and that error is raised after the drain."""
    supervise: Callable[[], Coroutine[Any, Any, None]] | None = embedded.supervise if embedded is not None else None
    # Handlers first: a SIGTERM that comes the moment the banner is out must still drain and stop etcd.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    etcd = settings.etcd
    assert etcd is not None, "serve runs on etcd"
    traces = tracing.start_from_environment()  # the OTEL_* variables (docs/operations.md#traces)
    server = CoordinatorServer(settings)
    if embedded is not None and embedded.clocks is not None and isinstance(server.store, EtcdStore):
        # Before serving: a claim this run makes is its own clock's (the store remembers it as it writes it).
        await _adopt_claims(server.store, embedded.clocks)
    await server.start()
    print(f"inbox-coordinator: serving gRPC on {server.address}; stop with Ctrl-C or SIGTERM", flush=True)
    if server.metrics_server is not None:
        print(f"inbox-coordinator: metrics on http://{server.metrics_server.address}/metrics", flush=True)
    board = board_line(server)
    if board:
        print(board, flush=True)
    if traces is not None:
        print(f"inbox-coordinator: traces on: {traces.destination}", flush=True)
    log.info(
        "serving",
        extra={
            "fields": {
                "event": "start",
                "listen": server.address,
                "etcd_endpoints": ",".join(etcd.endpoints),
                "etcd_prefix": etcd.prefix,
                "metrics": server.metrics_server.address if server.metrics_server is not None else "",
            }
        },
    )
    authenticator = settings.authenticator
    if authenticator is None:
        print(
            "inbox-coordinator: DEVELOPMENT MODE: no token file, every caller is who its metadata says "
            "(set --token-file; see docs/security.md)",
            flush=True,
        )
    if isinstance(authenticator, TokenAuthenticator):
        loop.add_signal_handler(signal.SIGHUP, _reload_tokens, authenticator)
    tasks: list[asyncio.Task[Any]] = [asyncio.create_task(stop.wait())]
    if supervise is not None:
        tasks.append(asyncio.create_task(supervise()))
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    keeper = tasks[1] if len(tasks) > 1 else None
    failure = keeper.exception() if keeper is not None and keeper.done() else None
    for task in tasks:
        task.cancel()
        # A keeper cancelled mid-restart must not leave a restart running while etcd is being stopped.
        with contextlib.suppress(asyncio.CancelledError, EmbeddedEtcdError):
            await task
    print(
        f"inbox-coordinator: stopping (NOT_SERVING; finishing calls in flight, up to {settings.shutdown_grace_s:g} s)",
        flush=True,
    )
    await server.stop()
    await asyncio.to_thread(tracing.close)
    log.info("stopped", extra={"fields": {"event": "stop"}})
    if failure is not None:
        raise failure


ADOPT_TRIES = 10


async def _adopt_claims(store: EtcdStore, clocks: ClockFrames) -> None:
    """The claims the embedded etcd held when it stopped: it started their leases again, a whole TTL from its
    start; each is ended when its time has passed on the clock of the serve that wrote it instead
    (docs/design.md#leases-and-expiry, "Across an outage or a restart"). When etcd does not answer within
    ADOPT_TRIES s, they are left to their leases (later than their time, never earlier)."""
    for attempt in range(ADOPT_TRIES):
        try:
            revision = await store.current_revision()
            clocks.begin(revision + 1)
            adopted = await store.adopt_claims(
                lambda record, mod_revision: clocks.seconds_left(record.expires_ms or 0, mod_revision), revision
            )
            break
        except StoreUnavailable as error:
            if attempt == ADOPT_TRIES - 1:
                log.warning("the claims held before this start are left to etcd's leases: %s", error)
                return
            await asyncio.sleep(1.0)
    if adopted:
        log.info(
            "%d claim(s) held when the embedded etcd stopped end when their time has passed, not a TTL from now",
            adopted,
            extra={"fields": {"event": "claims_adopted", "claims": adopted}},
        )


def _reload_tokens(authenticator: TokenAuthenticator) -> None:
    """SIGHUP: read the token file again; a broken file keeps the principals in force and says why."""
    try:
        count = authenticator.reload()
    except TokenFileError as error:
        log.error("token file not reloaded: %s", error, extra={"fields": {"event": "tokens_reload_failed"}})
        print(f"inbox-coordinator: token file NOT reloaded, the previous one stays in force: {error}", flush=True)
        return
    log.info("token file reloaded", extra={"fields": {"event": "tokens_reloaded", "principals": count}})
    print(f"inbox-coordinator: token file reloaded: {count} principal(s)", flush=True)


def serve(options: argparse.Namespace) -> int:
    config = _load(options)
    if config is None:
        return EXIT_CONFIG
    raise_descriptor_limit()  # before the embedded etcd starts: it inherits the limit too
    if config.tls_cert is not None:
        tls_log.capture_handshake_failures()  # before the log set-up: it moves sys.stderr
    logs.setup(config.log_level, config.log_format)
    try:
        if not config.embedded_etcd:
            asyncio.run(_serve(server_settings(config)))
            return EXIT_OK
        data_dir = config.data_dir or default_data_dir()
        print(
            f"inbox-coordinator: DEVELOPMENT MODE: embedded single-member etcd, data in {data_dir} "
            "(use --etcd-endpoints for a real cluster)",
            flush=True,
        )
        embedded = EmbeddedEtcd(EmbeddedSettings(data_dir, config.embedded_etcd_compaction, config.embedded_etcd_quota))
        try:
            etcd = embedded.start()
            print(
                f"inbox-coordinator: embedded etcd {etcd.endpoint} (pid {etcd.pid}, log: {etcd.log_path}; "
                f"compaction every {format_duration(config.embedded_etcd_compaction)}, "
                f"quota {format_size(config.embedded_etcd_quota)})",
                flush=True,
            )
            asyncio.run(_serve(server_settings(config, [etcd.endpoint]), embedded))
        finally:
            embedded.stop()
        return EXIT_OK
    except TokenFileError as error:
        print(f"inbox-coordinator: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except (EtcdNotFound, EtcdStartError, EmbeddedEtcdError, OSError, ValueError) as error:
        print(f"inbox-coordinator: {error}", file=sys.stderr)
        return EXIT_FAILURE


# --- check ---------------------------------------------------------------------------------------------------


def version_warning(version: str) -> str | None:
    """Why this etcd version should not run in production, or None."""
    parts = version_tuple(version)
    if len(parts) < 3:
        return f"cannot tell which etcd version {version!r} is; run 3.4.23+ or 3.5.3+"
    if is_broken_version(version):
        return (
            f"etcd {version} can lose consistency when a member is killed under load (fixed in 3.5.3): "
            "NEVER run etcd 3.5.0 to 3.5.2 in production; upgrade to 3.5.3 or later"
        )
    if parts < (3, 4, 23):
        return f"etcd {version} is older than the versions tested (3.4.23+, 3.5.3+); upgrade"
    return None


async def _probe(config: Config) -> int:
    status = EXIT_OK
    for endpoint in config.etcd_endpoints:
        store = EtcdStore(config.etcd_settings([endpoint]), wall_clock_ms)
        try:
            version = await store.ping()
        except StoreUnavailable as error:
            print(f"etcd {endpoint}: UNREACHABLE: {error}")
            status = EXIT_FAILURE
            continue
        finally:
            await store.close()
        print(f"etcd {endpoint}: version {version}")
        warning = version_warning(version)
        if warning is not None:
            print(f"\n!!! WARNING: etcd {endpoint}: {warning} !!!\n", file=sys.stderr)
    store = EtcdStore(config.etcd_settings(), wall_clock_ms)
    try:
        revision = await store.current_revision()
        print(f"etcd cluster: a linearizable read answered at revision {revision}")
    except StoreUnavailable as error:
        print(f"etcd cluster: UNREACHABLE (no quorum answered a linearizable read): {error}")
        status = EXIT_FAILURE
    finally:
        await store.close()
    return status


def check(options: argparse.Namespace) -> int:
    config = _load(options)
    if config is None:
        return EXIT_CONFIG
    print("configuration OK:")
    for setting in SETTINGS:
        print(f"  {describe(config, setting.name)}")
    if config.embedded_etcd:
        data_dir = (config.data_dir or default_data_dir()).expanduser().resolve()
        try:
            binary = etcd_for_data_dir(data_dir)
            version = etcd_version(binary)
        except (EtcdNotFound, RuntimeError) as error:
            print(f"no etcd endpoints, and no etcd for the embedded development mode: {error}", file=sys.stderr)
            return EXIT_FAILURE
        print(f"no etcd endpoints: serve would start an embedded DEVELOPMENT etcd ({binary}, version {version})")
        problem = version_problem(data_dir, binary, version)
        if problem is not None:
            print(f"inbox-coordinator check: serve would refuse to start: {problem}", file=sys.stderr)
            return EXIT_FAILURE
        return EXIT_OK
    status = asyncio.run(_probe(config))
    if status != EXIT_OK:
        print("inbox-coordinator check: etcd is unreachable; serve would report NOT_SERVING", file=sys.stderr)
    return status


# --- health --------------------------------------------------------------------------------------------------


def local_address(listen: str) -> str:
    """Where a process on this machine reaches a server listening on ``listen``."""
    host, port = parse_host_port(listen)
    if host in ("0.0.0.0", "", "*"):
        host = "127.0.0.1"
    elif host == "[::]":
        host = "[::1]"
    return f"{host}:{port}"


@dataclass(frozen=True)
class _HealthTls:
    ca_file: Path | None
    server_name: str | None
    cert_file: Path | None
    key_file: Path | None


def _health_channel(address: str, tls: _HealthTls) -> grpc.aio.Channel:
    if tls.ca_file is None:
        return grpc.aio.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.ca_file.read_bytes(),
        private_key=tls.key_file.read_bytes() if tls.key_file else None,
        certificate_chain=tls.cert_file.read_bytes() if tls.cert_file else None,
    )
    return grpc.aio.secure_channel(address, credentials, options=options)


async def _health(address: str, service: str, deadline_s: float, tls: _HealthTls) -> str:
    async with _health_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=deadline_s)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def health(options: argparse.Namespace) -> int:
    address = options.address
    ca_file: Path | None = options.ca_file
    if (options.cert_file is None) != (options.key_file is None):
        print("inbox-coordinator: --cert-file and --key-file go together (mTLS)", file=sys.stderr)
        return EXIT_CONFIG
    if address is None or ca_file is None:
        try:
            config = load(config_file=options.config)
        except ConfigError as error:
            print(f"inbox-coordinator: configuration error: {error}", file=sys.stderr)
            return EXIT_CONFIG
        address = address or local_address(config.listen)
        ca_file = ca_file or config.tls_cert
    if options.cert_file is not None and ca_file is None:
        print("inbox-coordinator: a client certificate needs TLS: pass --ca-file", file=sys.stderr)
        return EXIT_CONFIG
    try:
        tls = _HealthTls(ca_file, options.server_name, options.cert_file, options.key_file)
        status = asyncio.run(_health(address, options.service, options.timeout, tls))
    except grpc.aio.AioRpcError as error:
        print(f"{address}: {error.code().name}: {error.details()}")
        return EXIT_FAILURE
    print(f"{address} {options.service or '(server)'}: {status}")
    return EXIT_OK if status == "SERVING" else EXIT_FAILURE


def token(options: argparse.Namespace) -> int:
    secret, digest = new_token()
    entry = (
        "[[principals]]\n"
        f"id = {json.dumps(options.id)}\n"
        f'kind = "{options.kind}"\n'
        f"mailboxes = {json.dumps(options.mailbox)}\n"
        f"roles = {json.dumps(options.role)}\n"
        f'token_sha256 = ["{digest}"]\n'
    )
    print(f"# the token, for the client only (it is not stored anywhere):\n# {secret}\n")
    print("# add to the token file, then send SIGHUP to the coordinators:")
    print(entry, end="")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    if options.command == "token":
        return token(options)
    if options.command == "serve":
        return serve(options)
    if options.command == "check":
        return check(options)
    if options.command == "health":
        return health(options)
    raise AssertionError(options.command)


if __name__ == "__main__":
    sys.exit(main())

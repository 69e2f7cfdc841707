"""A coordinator's settings: from flags, the environment, a TOML file and defaults, in that order of precedence.

Every setting has one name, spelled three ways: ``--default-ttl`` (flag), ``INBOX_COORDINATOR_DEFAULT_TTL``
(environment) and ``default_ttl`` (a top-level key of the TOML file given with ``--config`` or
``INBOX_COORDINATOR_CONFIG``). Everything is checked before anything starts; an error names the setting and
where its value came from, e.g. ``INBOX_COORDINATOR_DEFAULT_TTL=abc: not an integer``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.api.addresses import is_ip, is_loopback, parse_host_port
from coordinator.api.auth import TlsSettings, TokenFileError, load_token_file
from coordinator.api.quotas import QuotaSettings
from coordinator.core.domain import Rules
from coordinator.core.limits import Limits
from coordinator.core.storms import DEFAULT_CORRESPONDENT_BUDGET, DEFAULT_THREAD_BUDGET, Budget
from coordinator.ops.budgets import BudgetOverride, budget, budgets_for, check_patterns, overrides, show_budget
from coordinator.store.etcd.channels import check_endpoints
from coordinator.store.etcd.settings import EtcdSettings

ENV_PREFIX = "INBOX_COORDINATOR_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
# The etcd password is read from this variable or from etcd_password_file, never from a flag (ps shows flags).
ETCD_PASSWORD_ENV = ENV_PREFIX + "ETCD_PASSWORD"
# Variables with our prefix that are read elsewhere and are not settings.
OTHER_ENV = frozenset({CONFIG_ENV, ENV_PREFIX + "ETCD_BIN", ETCD_PASSWORD_ENV})


class ConfigError(ValueError):
    """A setting's value is unusable; the message names the setting and its source."""


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "inbox-coordinator"


# --- value parsers: a flag's or variable's text, or a TOML value, to a typed value (ValueError: the problem) ---


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("not a string")
    return value.strip()


def _integer(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ValueError("not an integer")


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*")


def _duration(value: object) -> float:
    """Seconds: a number, or a number with a unit (250ms, 90s, 5m, 72h, 1d)."""
    if isinstance(value, bool):
        raise ValueError("not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    else:
        raise ValueError("not a duration (seconds, or a number with a unit: 250ms, 90s, 5m, 72h, 1d)")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("a duration must be a finite number of seconds, 0 or more")
    return seconds


def _address(value: object) -> str:
    text = _text(value)
    parse_host_port(text)
    return text


def _optional_address(value: object) -> str:
    text = _text(value)
    return _address(text) if text else ""


# The HTTP face's address in development mode, when http_listen is left at "auto".
DEVELOPMENT_HTTP_LISTEN = "127.0.0.1:8080"


def _http_address(value: object) -> str:
    text = _text(value)
    return text if text.lower() == "auto" else _optional_address(text)


def _names(value: object) -> tuple[str, ...]:
    """Host names (or IP addresses), comma-separated or a TOML list."""
    items = [_text(item) for item in value] if isinstance(value, list) else _text(value).split(",")
    names = tuple(item.strip().lower() for item in items if item.strip())
    for name in names:
        if not (is_ip(name.strip("[]")) or re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?\.?", name)):
            raise ValueError(f"{name!r} is not a host name or an IP address (no port, no scheme)")
    return names


def _endpoints(value: object) -> tuple[str, ...]:
    items = [_text(item) for item in value] if isinstance(value, list) else _text(value).split(",")
    endpoints = tuple(item.strip() for item in items if item.strip())
    for endpoint in endpoints:
        try:
            parse_host_port(endpoint.removeprefix("http://").removeprefix("https://").rstrip("/"))
        except ValueError as error:
            raise ValueError(f"endpoint {endpoint!r}: {error}") from None
    return endpoints


_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_SIZE = re.compile(r"\s*(\d+)\s*([KMG]iB|B)?\s*", re.IGNORECASE)


def _size(value: object) -> int:
    """Bytes: an integer, or an integer with a binary unit (512MiB, 2GiB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and (match := _SIZE.fullmatch(value)):
        return int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    raise ValueError("not a size (bytes, or a number with a unit: 512MiB, 2GiB)")


def _choice(*options: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        text = _text(value).lower()
        if text not in options:
            raise ValueError(f"not one of {', '.join(options)}")
        return text

    return parse


def _optional_path(value: object) -> Path | None:
    text = _text(value)
    return Path(text).expanduser() if text else None


def _boolean(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(value).lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0", ""):
        return False
    raise ValueError("not a boolean (true or false)")


def _number(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("not a number")
    if isinstance(value, int | float):
        number = float(value)
    else:
        try:
            number = float(_text(value))
        except ValueError:
            raise ValueError("not a number") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError("must be a finite number, 0 or more")
    return number


# --- the settings --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[object], Any]
    default: Any
    help: str
    metavar: str = ""
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def show(self, value: object) -> str:
        """A value as a person would write it: 72h, a,b,c, (none)."""
        if self.parse is _duration and isinstance(value, int | float):
            return format_duration(value)
        if self.parse is _size and isinstance(value, int):
            return format_size(value)
        if self.parse is budget:
            return show_budget(value)  # type: ignore[arg-type]
        if self.parse is overrides:
            return "(none)" if not value else f"{len(value)} override(s)"  # type: ignore[arg-type]
        if isinstance(value, tuple):
            value = ",".join(value)
        return "(none)" if value is None or value == "" else str(value)


def format_duration(seconds: float) -> str:
    if seconds == 0:
        return "0"
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


MIN_EMBEDDED_QUOTA, MAX_EMBEDDED_QUOTA = 16 << 20, 8 << 30
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: a group commit's nested transactions count against it

SETTINGS: tuple[Setting, ...] = (
    Setting("listen", _address, "127.0.0.1:50051", "HOST:PORT for gRPC", "HOST:PORT"),
    Setting(
        "etcd_endpoints",
        _endpoints,
        (),
        "etcd client endpoints, comma-separated: IP addresses or DNS names (https://HOST:PORT for TLS; each member's "
        "certificate must carry its endpoint's host); calls go to one and move to the next when it fails; empty "
        "starts an embedded development etcd",
        "HOST:PORT,...",
    ),
    Setting(
        "etcd_prefix", _text, "inbox-coordinator/v1/", "etcd key prefix of this deployment", "PREFIX", ("--prefix",)
    ),
    Setting("etcd_call_timeout", _duration, 5.0, "deadline of one etcd call", "DURATION"),
    Setting(
        "etcd_max_batch",
        _integer,
        64,
        "group commit: transactions sent together as one etcd request, at most (1: none; at most 128, etcd's "
        "default --max-txn-ops)",
        "COUNT",
    ),
    Setting(
        "etcd_batches_in_flight",
        _integer,
        2,
        "group commit: etcd requests in flight at once (1 suits agents that make one call at a time; "
        "docs/performance.md)",
        "COUNT",
    ),
    Setting("data_dir", _optional_path, None, "where the embedded development etcd keeps its data", "DIR"),
    Setting(
        "embedded_etcd_compaction",
        _duration,
        600.0,
        "the embedded etcd compacts its history older than this, every this long (periodic auto-compaction); 0: never",
        "DURATION",
    ),
    Setting(
        "embedded_etcd_quota",
        _size,
        2 << 30,
        "the embedded etcd's storage quota (--quota-backend-bytes): beyond it etcd refuses writes",
        "BYTES",
    ),
    Setting("default_ttl", _integer, 60, "claim TTL in seconds when a call gives none", "SECONDS"),
    Setting("min_ttl", _integer, 5, "smallest claim TTL a call may ask for, seconds", "SECONDS"),
    Setting("max_ttl", _integer, 3600, "largest claim TTL a call may ask for, seconds", "SECONDS"),
    Setting("send_timeout", _duration, 120.0, "time from BeginSend to IN_DOUBT without a confirm", "DURATION"),
    Setting("reply_retention", _duration, 72 * 3600.0, "how long a reply record is kept", "DURATION"),
    Setting("delivery_retention", _duration, 24 * 3600.0, "how long a delivery record is kept", "DURATION"),
    Setting(
        "store_summaries",
        _boolean,
        True,
        "keep the subject line and sender a claim gives (personal data, docs/security.md); false drops them",
    ),
    Setting(
        "claim_lease_bucket",
        _duration,
        1.0,
        "expiries are rounded up to it, and claims expiring together share an etcd lease; a claim frees up to "
        "this much after its TTL, plus under 1 s (etcd's leases are whole seconds) and etcd's expiry check",
        "DURATION",
    ),
    Setting("record_lease_bucket", _duration, 10.0, "the same for reply and delivery records (hours long)", "DURATION"),
    Setting(
        "thread_reply_budget",
        budget,
        DEFAULT_THREAD_BUDGET,
        "agents' replies to one conversation (thread) in a rolling window, at most (docs/design.md#reply-storms): "
        "N/WINDOW with the window in m, h or d (1 to 1000 replies, 1m to 30d), or off; people are never counted",
        "N/WINDOW",
    ),
    Setting(
        "correspondent_reply_budget",
        budget,
        DEFAULT_CORRESPONDENT_BUDGET,
        "agents' replies to one correspondent (the sender's address) in a rolling window, at most: as "
        "thread_reply_budget",
        "N/WINDOW",
    ),
    Setting(
        "reply_budget_overrides",
        overrides,
        (),
        "per-mailbox budgets, the first matching pattern wins: PATTERN=THREAD[,CORRESPONDENT];... "
        "(acme-*=5/1h,off); in the TOML file an array of tables {mailboxes, thread, correspondent}. A pattern "
        "matching no mailbox the token file grants is refused at start",
        "OVERRIDES",
    ),
    Setting("metrics_listen", _optional_address, "127.0.0.1:9464", "HOST:PORT for Prometheus /metrics; empty disables"),
    Setting(
        "http_listen",
        _http_address,
        "auto",
        f"HOST:PORT for the HTTP/JSON API (Connect protocol) and the claims board; auto: {DEVELOPMENT_HTTP_LISTEN} "
        "in development mode (no token_file), none otherwise; empty: none",
        "HOST:PORT",
    ),
    Setting(
        "http_allowed_hosts",
        _names,
        (),
        "Host names the HTTP face answers to besides the ones it listens on (the loopback names on a loopback "
        "address; any IP address and this machine's names on 0.0.0.0 or [::]): behind a proxy, the names it forwards; "
        "a request for another name is refused (421), as a DNS-rebinding page's would be",
        "NAME,...",
    ),
    Setting(
        "http_header_timeout",
        _duration,
        10.0,
        "an HTTP request's line and headers must arrive within this long of the connection's start (or of its first "
        "byte after an answer); else 408 and the connection is closed",
        "DURATION",
    ),
    Setting(
        "http_idle_timeout",
        _duration,
        30.0,
        "an HTTP connection kept alive between requests is closed after this long without one",
        "DURATION",
    ),
    Setting(
        "http_max_connections",
        _integer,
        1000,
        "HTTP connections open at once (Watch streams included); more are answered 503 and closed. Lowered at start "
        "to the open-file limit less 256 descriptors kept for gRPC and etcd (the soft limit is raised to the hard one)",
        "COUNT",
    ),
    Setting(
        "key_count_interval",
        _duration,
        15.0,
        "how often to count keys in etcd for the inbox_coordinator_etcd_keys gauge (a count-only read); 0: never",
        "DURATION",
    ),
    Setting("log_level", _choice("debug", "info", "warning", "error"), "info", "debug, info, warning or error"),
    Setting(
        "access_log",
        _boolean,
        False,
        "log every call at info, one line each; off: answered and cancelled calls at debug, refusals and errors "
        "as always (a line per call costs ~50 us of CPU: docs/performance.md)",
    ),
    Setting("log_format", _choice("auto", "json", "text"), "auto", "json, text, or auto (text on a terminal)"),
    Setting("shutdown_grace", _duration, 10.0, "on SIGTERM, how long calls in flight may take to finish", "DURATION"),
    Setting(
        "token_file",
        _optional_path,
        None,
        "principals with their token hashes, mailboxes and roles (docs/security.md); reloaded on SIGHUP; none: "
        "development mode, the caller's metadata names it",
        "FILE.toml",
    ),
    Setting("tls_cert", _optional_path, None, "serve gRPC over TLS with this certificate chain (PEM)", "FILE"),
    Setting("tls_key", _optional_path, None, "the private key of tls_cert (PEM)", "FILE"),
    Setting(
        "tls_client_ca",
        _optional_path,
        None,
        "mTLS: ask every client (gRPC and HTTP) for a certificate and verify it against this CA (PEM); its names "
        "can map to principals. Needs require_client_cert",
        "FILE",
    ),
    Setting(
        "require_client_cert",
        _boolean,
        False,
        "mTLS: refuse connections without a valid client certificate (with tls_client_ca: gRPC cannot ask for an "
        "optional one)",
    ),
    Setting(
        "allow_plaintext",
        _boolean,
        False,
        "serve without TLS on a non-loopback address (when a proxy or mesh terminates TLS)",
    ),
    Setting("etcd_ca_file", _optional_path, None, "the CA that signed etcd's certificates (turns TLS on)", "FILE"),
    Setting("etcd_cert_file", _optional_path, None, "client certificate for etcd's --client-cert-auth", "FILE"),
    Setting("etcd_key_file", _optional_path, None, "the private key of etcd_cert_file", "FILE"),
    Setting("etcd_username", _text, "", "etcd user (auth enabled); its password from etcd_password_file", "USER"),
    Setting(
        "etcd_password_file",
        _optional_path,
        None,
        f"file holding the etcd user's password (or set {ETCD_PASSWORD_ENV})",
        "FILE",
    ),
    Setting("rate_limit", _number, 500.0, "calls per second per principal (0: no limit)", "PER_SECOND"),
    Setting("rate_burst", _integer, 1000, "calls a principal may make at once above its rate", "CALLS"),
    Setting(
        "work_rate",
        _number,
        5_000.0,
        "records read (and searched) per second per principal: a principal reading more is slowed, then refused "
        "(0: no limit)",
        "PER_SECOND",
    ),
    Setting("work_burst", _integer, 10_000, "records a principal may read at once above its work rate", "RECORDS"),
    Setting("max_watches", _integer, 64, "concurrent Watch streams per principal", "STREAMS"),
    Setting(
        "watch_drain_timeout",
        _duration,
        10.0,
        "a Watch stream whose client has not taken its next message within this long is ended (ABORTED)",
        "DURATION",
    ),
    Setting(
        "watch_events_per_second",
        _number,
        2000.0,
        "Watch messages per second written to all streams of one principal (0: no limit)",
        "PER_SECOND",
    ),
    Setting("call_deadline", _duration, 30.0, "a unary call is cut off after this long, whatever the client asked"),
    Setting("max_message_bytes", _integer, 1 << 20, "largest request message accepted", "BYTES"),
    Setting(
        "request_timeout",
        _duration,
        10.0,
        "a call whose request message has not arrived this long after it opened is cut off (over HTTP: its body, 408)",
    ),
    Setting(
        "max_streams_per_connection",
        _integer,
        1000,
        "calls (HTTP/2 streams) one client connection may have open at once",
        "STREAMS",
    ),
)
BY_NAME = {setting.name: setting for setting in SETTINGS}


@dataclass(frozen=True)
class Config:
    listen: str
    etcd_endpoints: tuple[str, ...]
    etcd_prefix: str
    etcd_call_timeout: float
    etcd_max_batch: int
    etcd_batches_in_flight: int
    data_dir: Path | None
    embedded_etcd_compaction: float
    embedded_etcd_quota: int
    default_ttl: int
    min_ttl: int
    max_ttl: int
    send_timeout: float
    reply_retention: float
    delivery_retention: float
    store_summaries: bool
    claim_lease_bucket: float
    record_lease_bucket: float
    thread_reply_budget: Budget | None
    correspondent_reply_budget: Budget | None
    reply_budget_overrides: tuple[BudgetOverride, ...]
    metrics_listen: str
    http_listen: str
    http_allowed_hosts: tuple[str, ...]
    http_header_timeout: float
    http_idle_timeout: float
    http_max_connections: int
    key_count_interval: float
    log_level: str
    access_log: bool
    log_format: str
    shutdown_grace: float
    token_file: Path | None
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    require_client_cert: bool
    allow_plaintext: bool
    etcd_ca_file: Path | None
    etcd_cert_file: Path | None
    etcd_key_file: Path | None
    etcd_username: str
    etcd_password_file: Path | None
    rate_limit: float
    rate_burst: int
    work_rate: float
    work_burst: int
    max_watches: int
    call_deadline: float
    watch_drain_timeout: float
    watch_events_per_second: float
    max_message_bytes: int
    request_timeout: float
    max_streams_per_connection: int
    # The etcd password (from etcd_password_file or the environment); never printed.
    etcd_password: str | None = dataclasses.field(default=None, repr=False, compare=False)
    # Where each value came from: "default", "--listen", "INBOX_COORDINATOR_LISTEN", "/etc/x.toml: listen".
    origins: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)
    # Things worth saying that are not errors (an unknown INBOX_COORDINATOR_* variable, say).
    warnings: tuple[str, ...] = ()

    def origin(self, name: str) -> str:
        return self.origins.get(name, "default")

    @property
    def http_address(self) -> str:
        """Where the HTTP face listens; empty: nowhere."""
        if self.http_listen.lower() != "auto":
            return self.http_listen
        return DEVELOPMENT_HTTP_LISTEN if self.token_file is None else ""

    @property
    def embedded_etcd(self) -> bool:
        return not self.etcd_endpoints

    def etcd_settings(self, endpoints: Sequence[str] | None = None) -> EtcdSettings:
        return EtcdSettings(
            tuple(endpoints if endpoints is not None else self.etcd_endpoints),
            prefix=self.etcd_prefix,
            call_timeout_s=self.etcd_call_timeout,
            max_batch=self.etcd_max_batch,
            max_batches_in_flight=self.etcd_batches_in_flight,
            ca_file=self.etcd_ca_file,
            cert_file=self.etcd_cert_file,
            key_file=self.etcd_key_file,
            username=self.etcd_username or None,
            password=self.etcd_password,
        )

    def tls(self) -> TlsSettings | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        return TlsSettings(self.tls_cert, self.tls_key, self.tls_client_ca, self.require_client_cert)

    def quotas(self) -> QuotaSettings:
        return QuotaSettings(
            calls_per_second=self.rate_limit,
            burst=self.rate_burst,
            work_per_second=self.work_rate,
            work_burst=self.work_burst,
            max_watches=self.max_watches,
            call_deadline_s=self.call_deadline,
            watch_drain_timeout_s=self.watch_drain_timeout,
            watch_events_per_second=self.watch_events_per_second,
        )

    def rules(self) -> Rules:
        return Rules(
            Limits(ttl_min_seconds=self.min_ttl, ttl_max_seconds=self.max_ttl, ttl_default_seconds=self.default_ttl),
            claim_bucket_ms=_ms(self.claim_lease_bucket),
            record_bucket_ms=_ms(self.record_lease_bucket),
            reply_retention_ms=_ms(self.reply_retention),
            delivery_retention_ms=_ms(self.delivery_retention),
            send_timeout_ms=_ms(self.send_timeout),
            store_summaries=self.store_summaries,
            reply_budgets=budgets_for(
                self.thread_reply_budget, self.correspondent_reply_budget, self.reply_budget_overrides
            ),
        )


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


if {f.name for f in dataclasses.fields(Config)} - {"origins", "warnings", "etcd_password"} != set(
    BY_NAME
):  # pragma: no cover
    raise AssertionError("Config's fields and SETTINGS differ")


# --- loading -------------------------------------------------------------------------------------------------


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"config file {path}: cannot read it: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path}: not valid TOML: {error}") from None
    unknown = sorted(set(data) - set(BY_NAME))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting {unknown[0]!r} (settings are: {', '.join(BY_NAME)})")
    return data


def _toml_repr(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def load(
    flags: Mapping[str, str | None] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Config:
    """Settings from ``flags`` (name to the flag's text, None when not given), ``environ`` and the TOML file
    (``config_file``, else ``$INBOX_COORDINATOR_CONFIG``). Raises ConfigError for the first bad value."""
    flags = flags or {}
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {setting.name: setting.default for setting in SETTINGS}
    origins: dict[str, str] = {}
    warnings = [
        f"{key} is not a setting of inbox-coordinator; ignored (settings: {', '.join(s.env for s in SETTINGS)})"
        for key in sorted(environ)
        if key.startswith(ENV_PREFIX) and key not in OTHER_ENV and key[len(ENV_PREFIX) :].lower() not in BY_NAME
    ]

    def take(setting: Setting, raw: object, origin: str, shown: str) -> None:
        try:
            values[setting.name] = setting.parse(raw)
        except ValueError as error:
            raise ConfigError(f"{shown}: {error}") from None
        origins[setting.name] = origin

    path_text = config_file if config_file is not None else environ.get(CONFIG_ENV, "")
    if path_text:
        path = Path(path_text).expanduser()
        for key, raw in _read_toml(path).items():
            take(BY_NAME[key], raw, f"{path}: {key}", f"{path}: {key} = {_toml_repr(raw)}")
    for setting in SETTINGS:
        if setting.env in environ:
            take(setting, environ[setting.env], setting.env, f"{setting.env}={environ[setting.env]}")
    for setting in SETTINGS:
        raw_flag = flags.get(setting.name)
        if raw_flag is not None:
            take(setting, raw_flag, setting.flag, f"{setting.flag}={raw_flag}")
    password = environ.get(ETCD_PASSWORD_ENV)
    if values["etcd_password_file"] is not None:
        password_file: Path = values["etcd_password_file"]
        try:
            password = password_file.read_text().rstrip("\n")
        except OSError as error:
            raise ConfigError(
                f"{BY_NAME['etcd_password_file'].flag}={password_file}: cannot read: {error.strerror}"
            ) from None
    config = Config(**values, etcd_password=password, origins=origins, warnings=tuple(warnings))
    _check(config)
    return config


def describe(config: Config, name: str) -> str:
    """``default_ttl = 3 (INBOX_COORDINATOR_DEFAULT_TTL)``: a value and where it came from, for messages."""
    return f"{name} = {BY_NAME[name].show(getattr(config, name))} ({config.origin(name)})"


def _check(config: Config) -> None:
    """Checks between settings, and those that need more than one value's syntax."""

    def fail(problem: str, *names: str) -> None:
        raise ConfigError("; ".join(describe(config, name) for name in names) + f": {problem}")

    if config.etcd_endpoints:
        try:
            check_endpoints(config.etcd_endpoints)
        except ValueError as error:
            fail(str(error), "etcd_endpoints")
    if not config.etcd_prefix:
        fail("must not be empty", "etcd_prefix")
    if config.etcd_call_timeout <= 0:
        fail("must be more than 0", "etcd_call_timeout")
    if not 1 <= config.etcd_max_batch <= MAX_TXN_OPS:
        fail(f"must lie between 1 and {MAX_TXN_OPS} (etcd refuses a request of more operations)", "etcd_max_batch")
    if config.etcd_batches_in_flight < 1:
        fail("must be at least 1", "etcd_batches_in_flight")
    if 0 < config.embedded_etcd_compaction < 1:
        fail("must be 0 (never) or at least 1 second", "embedded_etcd_compaction")
    if not MIN_EMBEDDED_QUOTA <= config.embedded_etcd_quota <= MAX_EMBEDDED_QUOTA:
        fail(
            f"must lie between {format_size(MIN_EMBEDDED_QUOTA)} and {format_size(MAX_EMBEDDED_QUOTA)} "
            "(etcd's suggested maximum)",
            "embedded_etcd_quota",
        )
    if config.min_ttl < 1:
        fail("must be at least 1 second", "min_ttl")
    if config.max_ttl < config.min_ttl:
        fail("max_ttl must not be below min_ttl", "max_ttl", "min_ttl")
    if not config.min_ttl <= config.default_ttl <= config.max_ttl:
        fail("default_ttl must lie between min_ttl and max_ttl", "default_ttl", "min_ttl", "max_ttl")
    for name in ("send_timeout", "reply_retention", "delivery_retention"):
        if getattr(config, name) < 1:
            fail("must be at least 1 second", name)
    if not 0.001 <= config.claim_lease_bucket <= 60:
        fail("must lie between 1ms and 60s (it adds to how late a claim frees)", "claim_lease_bucket")
    if not 0.001 <= config.record_lease_bucket <= 3600:
        fail("must lie between 1ms and 1h", "record_lease_bucket")
    if config.metrics_listen and parse_host_port(config.metrics_listen) == parse_host_port(config.listen):
        fail("metrics and gRPC cannot share an address", "metrics_listen", "listen")
    if (config.tls_cert is None) != (config.tls_key is None):
        fail("a TLS certificate and its key go together: give both or neither", "tls_cert", "tls_key")
    if config.tls_client_ca is not None and config.tls_cert is None:
        fail("verifying client certificates needs TLS: give tls_cert and tls_key too", "tls_client_ca")
    if config.require_client_cert and config.tls_client_ca is None:
        fail("requiring client certificates needs tls_client_ca", "require_client_cert")
    if config.tls_client_ca is not None and not config.require_client_cert:
        fail(
            "a client CA is only used with require_client_cert = true: gRPC (grpcio) asks every client for a "
            "certificate or none, never optionally, so without it no certificate would ever be seen and a mapped "
            "one would get UNAUTHENTICATED. Set require_client_cert (every client presents a certificate), or "
            "leave tls_client_ca out (bearer tokens only)",
            "tls_client_ca",
            "require_client_cert",
        )
    if config.tls_cert is None and not config.allow_plaintext and not is_loopback(parse_host_port(config.listen)[0]):
        fail(
            "serving without TLS on a non-loopback address: give tls_cert and tls_key, or allow_plaintext when a "
            "proxy or mesh terminates TLS",
            "listen",
        )
    http = config.http_address
    if http and config.tls_cert is None and not config.allow_plaintext and not is_loopback(parse_host_port(http)[0]):
        fail(
            "serving HTTP without TLS on a non-loopback address: give tls_cert and tls_key (the HTTP face uses them "
            "too), or allow_plaintext when a proxy terminates TLS",
            "http_listen",
        )
    if http and http in (config.listen, config.metrics_listen):
        fail("the HTTP face needs an address of its own", "http_listen")
    if (config.etcd_cert_file is None) != (config.etcd_key_file is None):
        fail("an etcd client certificate and its key go together", "etcd_cert_file", "etcd_key_file")
    if config.etcd_username and config.etcd_password is None:
        fail(f"an etcd user needs its password: etcd_password_file or {ETCD_PASSWORD_ENV}", "etcd_username")
    for name in (
        "token_file",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "etcd_ca_file",
        "etcd_cert_file",
        "etcd_key_file",
    ):
        path = getattr(config, name)
        if path is not None and not path.is_file():
            fail("no such file", name)
    if config.reply_budget_overrides:
        granted: list[str] | None = None
        if config.token_file is not None:
            try:
                principals = load_token_file(config.token_file)
            except TokenFileError as error:
                fail(str(error), "token_file")
            granted = [
                pattern
                for principal in principals
                for pattern in (("*",) if principal.grants.has_role("admin") else principal.grants.patterns)
            ]
        problem = check_patterns(config.reply_budget_overrides, granted)
        if problem is not None:
            fail(problem, "reply_budget_overrides")
    if config.max_watches < 1:
        fail("must be at least 1", "max_watches")
    if config.rate_burst < 1:
        fail("must be at least 1", "rate_burst")
    if config.work_rate < 0:
        fail("must be 0 (no limit) or more", "work_rate")
    if config.work_burst < 1:
        fail("must be at least 1", "work_burst")
    if config.call_deadline <= 0:
        fail("must be more than 0", "call_deadline")
    if config.watch_events_per_second < 0:
        fail("must be 0 (no limit) or more", "watch_events_per_second")
    if config.watch_drain_timeout <= 0:
        fail("must be more than 0", "watch_drain_timeout")
    if config.max_message_bytes < 4096:
        fail("must be at least 4096 bytes", "max_message_bytes")
    if config.request_timeout <= 0:
        fail("must be more than 0", "request_timeout")
    for name in ("http_header_timeout", "http_idle_timeout"):
        if getattr(config, name) <= 0:
            fail("must be more than 0", name)
    if config.http_max_connections < 1:
        fail("must be at least 1", "http_max_connections")
    if config.max_streams_per_connection < 1:
        fail("must be at least 1", "max_streams_per_connection")
    for name in ("listen", "metrics_listen"):
        value = getattr(config, name)
        if value:
            host = parse_host_port(value)[0].strip("[]")
            if host and not is_ip(host) and not re.fullmatch(r"[A-Za-z0-9.-]+", host):
                fail("the host is neither an IP address nor a host name", name)


_DOC_DEFAULTS = {"etcd_endpoints": "(none: embedded etcd)", "data_dir": "~/.local/share/inbox-coordinator"}


def settings_table() -> str:
    """The reference table of docs/operations.md (a test keeps the two the same)."""
    rows = ["| setting (TOML key) | flag | environment | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for setting in SETTINGS:
        default = _DOC_DEFAULTS.get(setting.name) or setting.show(setting.default)
        rows.append(f"| `{setting.name}` | `{setting.flag}` | `{setting.env}` | `{default}` | {setting.help} |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover - prints the table for the docs
    sys.stdout.write(settings_table() + "\n")

"""Configuration: flags > environment > TOML file > defaults, errors that name the setting and its source,
and the `check` and `health` commands against a real etcd and a real coordinator."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from coordinator.ops.cli import version_warning
from coordinator.ops.config import SETTINGS, ConfigError, load
from coordinator.store.etcd.process import EtcdServer, etcd_version, free_port
from tests.conftest import StartCoordinator


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return str(path)


def test_flags_beat_the_environment_which_beats_the_file(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        'listen = "0.0.0.0:7000"\ndefault_ttl = 30\netcd_endpoints = ["10.0.0.5:2379", "10.0.0.6:2379"]\n'
        'reply_retention = "48h"\nlog_format = "json"\nallow_plaintext = true\n',
    )
    environ = {"INBOX_COORDINATOR_DEFAULT_TTL": "45", "INBOX_COORDINATOR_LISTEN": "0.0.0.0:7001"}
    config = load({"listen": "127.0.0.1:7002"}, environ, path)
    assert config.listen == "127.0.0.1:7002"
    assert config.origin("listen") == "--listen"
    assert config.default_ttl == 45
    assert config.origin("default_ttl") == "INBOX_COORDINATOR_DEFAULT_TTL"
    assert config.etcd_endpoints == ("10.0.0.5:2379", "10.0.0.6:2379")
    assert config.origin("etcd_endpoints") == f"{path}: etcd_endpoints"
    assert config.reply_retention == 48 * 3600
    assert config.log_format == "json"
    assert config.max_ttl == 3600
    assert config.origin("max_ttl") == "default"
    rules = config.rules()
    assert rules.reply_retention_ms == 48 * 3600 * 1000
    assert rules.limits.ttl_default_seconds == 45
    # The file named by the environment when no --config is given.
    assert load({}, {"INBOX_COORDINATOR_CONFIG": path}).listen == "0.0.0.0:7000"


def test_defaults_are_what_serve_with_no_arguments_always_used() -> None:
    config = load({}, {})
    assert config.listen == "127.0.0.1:50051"
    assert config.embedded_etcd
    assert config.etcd_prefix == "inbox-coordinator/v1/"
    assert (config.default_ttl, config.min_ttl, config.max_ttl) == (60, 5, 3600)
    assert config.send_timeout == 120
    rules = config.rules()
    assert (rules.claim_bucket_ms, rules.record_bucket_ms) == (1000, 10_000)
    assert (rules.reply_retention_ms, rules.delivery_retention_ms) == (72 * 3_600_000, 24 * 3_600_000)
    assert config.metrics_listen == "127.0.0.1:9464"
    assert config.shutdown_grace == 10
    etcd = config.etcd_settings()
    assert (etcd.max_batch, etcd.max_batches_in_flight) == (64, 2)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("250ms", 0.25), ("90s", 90), ("90", 90), ("1.5", 1.5), ("5m", 300), ("72h", 259_200), ("1d", 86_400)],
)
def test_durations(text: str, seconds: float) -> None:
    assert load({"shutdown_grace": text}, {}).shutdown_grace == seconds


@pytest.mark.parametrize(
    ("flags", "environ", "toml", "message"),
    [
        ({}, {"INBOX_COORDINATOR_DEFAULT_TTL": "abc"}, "", "INBOX_COORDINATOR_DEFAULT_TTL=abc: not an integer"),
        ({"default_ttl": "1.5"}, {}, "", "--default-ttl=1.5: not an integer"),
        ({"send_timeout": "soon"}, {}, "", "--send-timeout=soon: not a duration"),
        ({}, {}, 'reply_retention = "forever"\n', 'config.toml: reply_retention = "forever": not a duration'),
        ({}, {}, "default_ttl = true\n", "config.toml: default_ttl = true: not an integer"),
        ({}, {}, "listen = 50051\n", "config.toml: listen = 50051: not a string"),
        ({}, {"INBOX_COORDINATOR_LISTEN": "localhost"}, "", "INBOX_COORDINATOR_LISTEN=localhost: not HOST:PORT"),
        ({"log_level": "loud"}, {}, "", "--log-level=loud: not one of debug, info, warning, error"),
        ({}, {}, "ttl = 5\n", "config.toml: unknown setting 'ttl'"),
        ({}, {}, "listen = \n", "config.toml: not valid TOML"),
        (
            {"min_ttl": "100"},
            {},
            "",
            "default_ttl = 60 (default); min_ttl = 100 (--min-ttl); max_ttl = 3600 (default): default_ttl must lie",
        ),
        (
            {},
            {"INBOX_COORDINATOR_ETCD_ENDPOINTS": "etcd-a:2379,etcd-b:2379,etcd-a:2379"},
            "",
            "etcd_endpoints = etcd-a:2379,etcd-b:2379,etcd-a:2379 (INBOX_COORDINATOR_ETCD_ENDPOINTS): etcd endpoint "
            "'etcd-a:2379' is given twice",
        ),
        ({"metrics_listen": "127.0.0.1:50051"}, {}, "", "metrics and gRPC cannot share an address"),
        ({"claim_lease_bucket": "2m"}, {}, "", "claim_lease_bucket = 2m (--claim-lease-bucket): must lie between"),
        ({}, {}, "etcd_max_batch = 129\n", "config.toml: etcd_max_batch): must lie between 1 and 128"),
        ({"etcd_max_batch": "0"}, {}, "", "etcd_max_batch = 0 (--etcd-max-batch): must lie between 1 and 128"),
        (
            {},
            {"INBOX_COORDINATOR_ETCD_BATCHES_IN_FLIGHT": "0"},
            "",
            "etcd_batches_in_flight = 0 (INBOX_COORDINATOR_ETCD_BATCHES_IN_FLIGHT): must be at least 1",
        ),
    ],
)
def test_errors_name_the_setting_and_where_its_value_came_from(
    tmp_path: Path, flags: dict[str, str], environ: dict[str, str], toml: str, message: str
) -> None:
    path = _toml(tmp_path, toml) if toml else None
    with pytest.raises(ConfigError) as error:
        load(flags, environ, path)
    assert message.replace("config.toml", str(tmp_path / "config.toml")) in str(error.value)


def test_a_missing_file_and_a_misspelt_variable() -> None:
    with pytest.raises(ConfigError, match=r"config file /nonexistent/x.toml: cannot read it"):
        load({}, {}, "/nonexistent/x.toml")
    config = load({}, {"INBOX_COORDINATOR_LISTN": "0.0.0.0:1", "INBOX_COORDINATOR_ETCD_BIN": "/usr/bin/etcd"})
    assert len(config.warnings) == 1
    assert "INBOX_COORDINATOR_LISTN is not a setting" in config.warnings[0]


def test_every_setting_has_a_flag_a_variable_and_a_key() -> None:
    names = [s.name for s in SETTINGS]
    assert len(set(names)) == len(names)
    for setting in SETTINGS:
        assert setting.flag == "--" + setting.name.replace("_", "-")
        assert setting.env == "INBOX_COORDINATOR_" + setting.name.upper()
        # The default itself passes the setting's own parser (text in, the same value out).
        shown = setting.show(setting.default) if setting.default not in ((), None) else ""
        assert load({setting.name: shown if shown != "(none)" else ""}, {}) is not None


def test_etcd_version_warnings() -> None:
    for broken in ("3.5.0", "3.5.1", "3.5.2"):
        assert "NEVER" in (version_warning(broken) or "")
    for fine in ("3.5.3", "3.5.17", "3.4.23", "3.4.35", "3.6.0"):
        assert version_warning(fine) is None
    assert "older" in (version_warning("3.4.3") or "")


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "coordinator",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_serve_exits_2_on_a_bad_setting_and_says_which() -> None:
    code, _, err = await _cli("serve", env={"INBOX_COORDINATOR_DEFAULT_TTL": "abc"})
    assert code == 2
    assert "INBOX_COORDINATOR_DEFAULT_TTL=abc: not an integer" in err


async def test_check_prints_the_etcd_version_and_warns_for_the_broken_ones(etcd: EtcdServer, tmp_path: Path) -> None:
    path = _toml(tmp_path, f'etcd_endpoints = ["{etcd.endpoint}"]\netcd_prefix = "check/"\n')
    code, out, err = await _cli("check", "--config", path)
    assert code == 0, out + err
    version = etcd_version(etcd.binary)
    assert f"etcd {etcd.endpoint}: version {version}" in out
    assert "etcd_prefix = check/ (" in out
    assert "linearizable read answered" in out
    assert ("NEVER run etcd 3.5.0 to 3.5.2" in err) == (version_warning(version) is not None and "3.5." in version)


async def test_check_fails_when_etcd_is_unreachable(etcd: EtcdServer) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    code, out, err = await _cli("check", f"--etcd-endpoints={etcd.endpoint},{nowhere}", "--etcd-call-timeout=2s")
    assert code == 1
    assert f"etcd {etcd.endpoint}: version" in out
    assert f"etcd {nowhere}: UNREACHABLE" in out
    assert "etcd is unreachable" in err
    code, _, err = await _cli("check", "--default-ttl=x")
    assert code == 2
    assert "--default-ttl=x: not an integer" in err


async def test_health_command(start_coordinator: StartCoordinator) -> None:
    server = await start_coordinator()
    code, out, _ = await _cli("health", f"--address={server.address}")
    assert code == 0, out
    assert "SERVING" in out
    # The listen setting from the environment, as in the container image (0.0.0.0 asked on loopback).
    port = server.address.rpartition(":")[2]
    code, out, _ = await _cli(
        "health",
        "--service=",
        env={"INBOX_COORDINATOR_LISTEN": f"0.0.0.0:{port}", "INBOX_COORDINATOR_ALLOW_PLAINTEXT": "true"},
    )
    assert code == 0, out
    code, out, _ = await _cli("health", f"--address=127.0.0.1:{free_port()}", "--timeout=2")
    assert code == 1
    assert "UNAVAILABLE" in out

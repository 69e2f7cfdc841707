"""deploy/ agrees with the code: every command, flag, setting, port, probe and file the container image, the
compose file, the Kubernetes manifests and the systemd unit name exists and means what they assume.

There is no container engine here, so these files are parsed (YAML, TOML, the Dockerfile, the unit file) and
each thing they reference is checked against the CLI parser, the configuration loader, the metrics registry
and a running coordinator.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator import tracing
from coordinator.api.addresses import parse_host_port
from coordinator.ops.cli import EXIT_CONFIG, build_parser, version_warning
from coordinator.ops.config import BY_NAME, ENV_PREFIX, Config, load, settings_table
from coordinator.ops.metrics import Metrics
from coordinator.ops.server import LIVENESS_SERVICE, SERVICE_NAME
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _port(address: str) -> int:
    return parse_host_port(address)[1]


def _parses(argv: list[str]) -> Any:
    """The CLI's own parser accepts these arguments (it exits on an unknown command or flag)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as error:  # pragma: no cover - the message argparse printed says why
        raise AssertionError(f"inbox-coordinator {shlex.join(argv)}: not accepted by the CLI") from error


def _config_text(text: str, tmp_path: Path, environ: dict[str, str] | None = None) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load({}, environ or {}, str(path))


# --- the container image -------------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in lines]


def _exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list), f"{text}: use the exec (JSON) form, so that SIGTERM reaches the process"
    return [str(part) for part in value]


def test_the_image_installs_the_server_and_runs_serve_as_a_non_root_user() -> None:
    instructions = _dockerfile()
    by_name: dict[str, list[str]] = {}
    for name, args in instructions:
        by_name.setdefault(name, []).append(args)
    assert by_name["FROM"] == ["python:3.11-slim"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert {"server", "otel"} <= set(pyproject["project"]["optional-dependencies"])
    # The server, and OpenTelemetry's SDK and exporters: traces need only OTEL_* variables (docs/operations.md#traces).
    assert any('pip install ".[server,otel]"' in run for run in by_name["RUN"])

    # Everything copied exists and is let through the build context's ignore file.
    allowed = [
        line[1:].rstrip("/")
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for copy in by_name["COPY"]:
        *sources, _target = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.rstrip("/") in allowed, f"{source} is excluded by Dockerfile.dockerignore"
    packaged = pyproject["tool"]["setuptools"]["package-dir"].values()
    assert all(any(path.startswith(a) for a in allowed) for path in packaged)

    # A numeric non-root user, created with that uid.
    (user,) = by_name["USER"]
    uid = user.split(":")[0]
    assert uid.isdigit()
    assert uid != "0"
    assert any(f"--uid {uid}" in run for run in by_name["RUN"])

    # ENTRYPOINT + CMD is a command line the CLI accepts, with a script the package installs.
    entrypoint = _exec_form(by_name["ENTRYPOINT"][0])
    command = _exec_form(by_name["CMD"][0])
    assert entrypoint[0] in pyproject["project"]["scripts"]
    assert _parses(entrypoint[1:] + command).command == "serve"
    (healthcheck,) = by_name["HEALTHCHECK"]
    probe = _exec_form(healthcheck.split("CMD", 1)[1].strip())
    assert probe[0] == entrypoint[0]
    options = _parses(probe[1:])
    assert options.command == "health"
    assert options.service == SERVICE_NAME
    interval_timeout = re.search(r"--timeout=(\d+)s", healthcheck)
    assert interval_timeout is not None
    assert int(interval_timeout.group(1)) > options.timeout

    # Every variable set is a setting with a valid value, and the ports exposed are the ones configured.
    environ: dict[str, str] = {}
    for env in by_name["ENV"]:
        for pair in shlex.split(env):
            key, _, value = pair.partition("=")
            environ[key] = value
    settings = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
    assert settings
    config = load({}, settings)
    assert not config.warnings
    exposed = {int(port) for ports in by_name["EXPOSE"] for port in ports.split()}
    assert exposed == {_port(config.listen), _port(config.metrics_listen)}
    assert by_name["STOPSIGNAL"] == ["SIGTERM"]


# --- compose and Prometheus ----------------------------------------------------------------------------------


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _compose() -> dict[str, Any]:
    compose = _yaml(DEPLOY / "compose.yaml")
    assert isinstance(compose, dict)
    return compose


def _compose_config(service: dict[str, Any], tmp_path: Path) -> Config:
    """A compose coordinator's settings: its environment plus the TOML file it mounts, read by our loader."""
    environ = {k: str(v) for k, v in service["environment"].items()}
    mounted = {}
    for volume in service["volumes"]:
        source, target, *_ = volume.split(":")
        mounted[target] = DEPLOY / source
    config_file = mounted[environ.pop("INBOX_COORDINATOR_CONFIG")]
    return _config_text(config_file.read_text(), tmp_path, environ)


def test_compose_runs_three_etcd_members_two_coordinators_and_prometheus(tmp_path: Path) -> None:
    services = _compose()["services"]
    etcds = {name: s for name, s in services.items() if s["image"].startswith("quay.io/coreos/etcd:")}
    coordinators = {name: s for name, s in services.items() if s.get("image", "").startswith("inbox-coordinator:")}
    assert len(etcds) == 3
    assert len(coordinators) == 2
    assert "prometheus" in services

    # etcd 3.5.3 or later; the initial cluster names every member at its own address.
    members: dict[str, str] = {}
    for name, service in etcds.items():
        version = service["image"].rpartition(":v")[2]
        assert version.startswith("3.5.")
        assert version_warning(version) is None, version
        env = service["environment"]
        assert env["ETCD_NAME"] == name
        address = service["networks"]["coordination"]["ipv4_address"]
        assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"http://{address}:2379"
        assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"http://{address}:2380"
        members[name] = address
        assert int(env["ETCD_QUOTA_BACKEND_BYTES"]) == 8 * 1024**3
    initial = dict(
        entry.split("=", 1) for entry in next(iter(etcds.values()))["environment"]["ETCD_INITIAL_CLUSTER"].split(",")
    )
    assert initial == {name: f"http://{address}:2380" for name, address in members.items()}

    for name, service in coordinators.items():
        build = service["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        config = _compose_config(service, tmp_path)
        assert sorted(config.etcd_endpoints) == sorted(f"{address}:2379" for address in members.values())
        published = [int(p.split(":")[1]) for p in service["ports"]]
        assert published == [_port(config.listen)], name
        grace = int(service["stop_grace_period"].removesuffix("s"))
        assert grace > config.shutdown_grace
        assert set(service["depends_on"]) == set(etcds)

    prometheus = services["prometheus"]
    mounts = dict(volume.split(":")[:2] for volume in prometheus["volumes"])
    for source in mounts:
        assert (DEPLOY / source).is_file(), source
    scrape = _yaml(DEPLOY / "prometheus.yml")
    assert scrape["rule_files"] == [mounts["./prometheus-alerts.yml"]]
    jobs = {
        job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]] for job in scrape["scrape_configs"]
    }
    config = _compose_config(next(iter(coordinators.values())), tmp_path)
    assert sorted(jobs["inbox-coordinator"]) == sorted(
        f"{name}:{_port(config.metrics_listen)}" for name in coordinators
    )
    assert sorted(jobs["etcd"]) == sorted(f"{address}:2379" for address in members.values())


def _result_values() -> set[str]:
    """Every value the rpcs counter's result label can take."""
    values = {"ok"} | {code.name.lower() for code in grpc.StatusCode}
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        field = method.output_type.fields_by_name.get("result")
        if field is not None and field.enum_type is not None:
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", field.enum_type.name).upper() + "_"
            values |= {value.name.removeprefix(prefix).lower() for value in field.enum_type.values}
    return values


def _http_refusal_reasons() -> set[str]:
    """The reasons docs/operations.md lists for inbox_coordinator_http_refusals_total."""
    lines = (ROOT / "docs" / "operations.md").read_text().splitlines()
    row = next(line for line in lines if line.startswith("| `inbox_coordinator_http_refusals_total`"))
    listed = set(re.findall(r"`(\w+)`", row.split("|")[3].split(":", 1)[1]))
    assert listed, row
    return listed


def test_alerts_use_metrics_and_labels_that_exist() -> None:
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_count", "_sum"]}
    exported = {family.name + suffix for family in Metrics().registry.collect() for suffix in suffixes[family.type]}
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods}
    results = _result_values()
    rules = [rule for group in _yaml(DEPLOY / "prometheus-alerts.yml")["groups"] for rule in group["rules"]]
    assert len(rules) >= 10
    for rule in rules:
        expr = rule["expr"]
        for name in re.findall(r"\binbox_coordinator_\w+", expr):
            assert name in exported, f"{rule['alert']}: {name} is not a metric of the coordinator"
        for label, op, value in re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', expr):
            values = set(value.split("|")) if op == "=~" else {value}
            if label == "method" and "inbox_coordinator_rpc" in expr:
                assert values <= methods, rule["alert"]
            if label == "result":
                assert values <= results, rule["alert"]
            if label == "service":
                assert values == {SERVICE_NAME}, rule["alert"]
            if label == "family":
                assert values <= {"subjects", "deliveries", "sending"}, rule["alert"]
            if label == "reason" and "http_refusals" in expr:
                assert values <= _http_refusal_reasons(), rule["alert"]
        assert rule["annotations"]["summary"]


# --- Kubernetes ----------------------------------------------------------------------------------------------


def _k8s() -> dict[str, dict[str, Any]]:
    kustomization = _yaml(DEPLOY / "k8s" / "kustomization.yaml")
    objects: dict[str, dict[str, Any]] = {}
    for resource in kustomization["resources"]:
        for document in yaml.safe_load_all((DEPLOY / "k8s" / resource).read_text()):
            objects[f"{document['kind']}/{document['metadata']['name']}"] = document
    return objects


def _probe_services(deployment: dict[str, Any]) -> dict[str, tuple[int, str]]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {
        kind: (container[kind]["grpc"]["port"], container[kind]["grpc"]["service"])
        for kind in ("readinessProbe", "livenessProbe")
    }


def test_kubernetes_manifests_agree_with_the_code(tmp_path: Path) -> None:
    objects = _k8s()
    deployment = objects["Deployment/inbox-coordinator"]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]

    # The command line parses, and its --config is the ConfigMap's key where the volume mounts it.
    options = _parses(container["args"])
    assert options.command == "serve"
    (mount,) = container["volumeMounts"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = objects[f"ConfigMap/{volume['configMap']['name']}"]
    mounted = Path(options.config)
    assert str(mounted.parent) == mount["mountPath"]
    config = _config_text(config_map["data"][mounted.name], tmp_path)
    assert not config.embedded_etcd

    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": _port(config.listen), "metrics": _port(config.metrics_listen)}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    probes = _probe_services(deployment)
    assert probes["readinessProbe"] == (ports["grpc"], SERVICE_NAME)
    assert probes["livenessProbe"] == (ports["grpc"], LIVENESS_SERVICE)

    # Time to drain: the preStop pause plus shutdown_grace fit in the termination grace period.
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(pause[1]) + config.shutdown_grace
    for kind in ("requests", "limits"):
        assert set(container["resources"][kind]) == {"cpu", "memory"}
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    dockerfile_user = dict(_dockerfile())["USER"].split(":")[0]
    assert str(security["runAsUser"]) == dockerfile_user
    assert container["image"] == _compose()["services"]["coordinator-1"]["image"]

    for name, obj in objects.items():
        if obj["kind"] == "Service":
            assert obj["spec"]["selector"].items() <= labels.items(), name
            for port in obj["spec"]["ports"]:
                assert port["targetPort"] in ports, name
                assert port["port"] == ports[port["targetPort"]], name
    pdb = objects["PodDisruptionBudget/inbox-coordinator"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    assert deployment["spec"]["replicas"] > pdb["spec"]["maxUnavailable"]


async def test_the_probed_health_names_answer_serving(start_coordinator: StartCoordinator) -> None:
    """The names the Kubernetes probes and the image's HEALTHCHECK ask for are served by a real coordinator."""
    probes = _probe_services(_k8s()["Deployment/inbox-coordinator"])
    server = await start_coordinator()
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _port_number, service in probes.values():
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert response.status == health_pb2.HealthCheckResponse.SERVING, service


# --- systemd -------------------------------------------------------------------------------------------------


def test_the_systemd_unit_runs_a_command_the_cli_accepts(tmp_path: Path) -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "inbox-coordinator.service")
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].startswith("/")
    assert argv[0].endswith("/inbox-coordinator")
    options = _parses(argv[1:])
    assert options.command == "serve"
    assert options.config == "/etc/inbox-coordinator/config.toml"
    key, _, value = service["Environment"].partition("=")
    assert key.removeprefix(ENV_PREFIX).lower() in BY_NAME
    config = _config_text((DEPLOY / "systemd" / "config.toml").read_text(), tmp_path, {key: value})
    assert int(service["TimeoutStopSec"]) > config.shutdown_grace
    assert service["KillSignal"] == "SIGTERM"
    assert service["RestartPreventExitStatus"] == str(EXIT_CONFIG)
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.parametrize("path", ["compose/coordinator.toml", "systemd/config.toml"])
def test_every_shipped_config_file_loads(path: str, tmp_path: Path) -> None:
    config = load({}, {}, str(DEPLOY / path))
    assert not config.embedded_etcd
    assert config.metrics_listen


# --- the runbook ---------------------------------------------------------------------------------------------


def test_the_runbook_has_the_current_configuration_reference() -> None:
    runbook = (ROOT / "docs" / "operations.md").read_text()
    assert settings_table() in runbook, "regenerate with: python -m coordinator.ops.config"
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Running it for real", 1)[1].split("\n## ", 1)[0]
    assert "docs/operations.md" in section


def test_the_traces_compose_file_sends_the_coordinators_spans_to_jaeger(tmp_path: Path) -> None:
    """deploy/compose/traces.yaml (docs/operations.md#traces): one etcd, one coordinator configured for Jaeger
    by OTEL_* variables alone, and Jaeger's all-in-one image receiving OTLP on the port the coordinator names."""
    compose = _yaml(DEPLOY / "compose" / "traces.yaml")
    services = compose["services"]
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one:")
    coordinator = services["coordinator"]
    assert (DEPLOY / "compose" / coordinator["build"]["context"] / coordinator["build"]["dockerfile"]).resolve() == (
        DEPLOY / "Dockerfile"
    )
    environ = {key: str(value) for key, value in coordinator["environment"].items()}
    otel = {key: value for key, value in environ.items() if key.startswith("OTEL_")}
    settings = tracing.settings_from(otel)
    assert settings is not None
    assert settings.protocol == "http/protobuf"
    assert settings.problems == ()
    host, _, port = otel["OTEL_EXPORTER_OTLP_ENDPOINT"].removeprefix("http://").partition(":")
    assert host == "jaeger"
    assert f"{port}:{port}" in services["jaeger"]["ports"]
    config = _config_text("", tmp_path, {key: value for key, value in environ.items() if key not in otel})
    assert list(config.etcd_endpoints) == ["etcd:2379"]
    assert config.http_listen == "0.0.0.0:8080"
    assert "8080:8080" in coordinator["ports"]

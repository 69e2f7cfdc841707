"""When the OTEL_* variables turn the coordinator's traces on, and what a value it does not understand does: a
warning, never a failed start (docs/operations.md#traces)."""

from __future__ import annotations

import logging
import sys

import pytest

from coordinator import tracing


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"},  # set-up, but no exporter asked for
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"},
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"},
    ],
)
def test_traces_stay_off_unless_an_exporter_or_endpoint_is_asked_for(environ: dict[str, str]) -> None:
    assert tracing.settings_from(environ) is None


def test_an_endpoint_turns_traces_on_with_otlp_over_http_by_default() -> None:
    settings = tracing.settings_from({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert settings == tracing.TraceSettings(("otlp",), "http/protobuf")
    traces_only = tracing.settings_from({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert traces_only == tracing.TraceSettings(("otlp",), "http/protobuf")


def test_the_protocol_and_the_exporters_are_read_as_opentelemetry_names_them() -> None:
    settings = tracing.settings_from(
        {
            "OTEL_TRACES_EXPORTER": "otlp, console",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",  # the traces' own wins
        }
    )
    assert settings == tracing.TraceSettings(("otlp", "console"), "grpc")


def test_values_not_understood_are_named_and_replaced_by_the_default() -> None:
    settings = tracing.settings_from(
        {"OTEL_TRACES_EXPORTER": "zipkin,otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    )
    assert settings is not None
    assert settings.exporters == ("otlp",)
    assert settings.protocol == "http/protobuf"
    assert len(settings.problems) == 2
    assert "OTEL_TRACES_EXPORTER='zipkin'" in settings.problems[0]
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='http/json'" in settings.problems[1]


def test_without_the_otel_extra_the_coordinator_serves_untraced_and_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "coordinator.tracing._spans", None)  # as if OpenTelemetry were not installed
    with caplog.at_level(logging.WARNING, logger="coordinator.tracing"):
        assert tracing.start_from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) is None
    assert tracing.active is None
    assert "pip install 'inbox-coordinator[otel]'" in caplog.text


def test_settings_the_sdk_refuses_leave_the_coordinator_untraced(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_BSP_MAX_QUEUE_SIZE": "1"}
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.WARNING, logger="coordinator.tracing"):
        for key, value in environ.items():
            patch.setenv(key, value)
        assert tracing.start_from_environment(environ) is None  # its batch size (512) exceeds the queue
    assert tracing.active is None
    assert "refused its settings" in caplog.text

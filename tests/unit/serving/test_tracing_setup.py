"""The OTEL_* variables tracing reads (pagedserve.envs.otel_settings) resolved by
pagedserve.serving.tracing.tracing_setup: defaults, the protocol from the URL, and a bad value refused naming its
variable. Tracing.from_config without an endpoint makes nothing, whatever the variables say."""
from __future__ import annotations

import pytest

from pagedserve.envs import otel_settings
from pagedserve.serving.tracing import Tracing, tracing_setup

GRPC_URL = "http://collector:4317"


def setup_of(url: str = GRPC_URL, **environ: str):
    return tracing_setup(url, otel_settings(environ))


def test_defaults_are_the_specifications():
    s = setup_of()
    assert (s.endpoint, s.protocol, s.sampler, s.sampler_arg) == (GRPC_URL, "grpc", "parentbased_always_on", 1.0)
    assert s.service_name == "pagedserve" and s.resource_attributes == {} and s.schedule_delay_ms is None


def test_the_variables_are_read():
    s = setup_of(OTEL_TRACES_SAMPLER="ParentBased_TraceIdRatio", OTEL_TRACES_SAMPLER_ARG="0.25",
                 OTEL_SERVICE_NAME="llm-sidecar", OTEL_RESOURCE_ATTRIBUTES="k8s.pod.name=p-1, team=a%2Cb",
                 OTEL_BSP_SCHEDULE_DELAY="200", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    assert (s.sampler, s.sampler_arg, s.service_name) == ("parentbased_traceidratio", 0.25, "llm-sidecar")
    assert s.resource_attributes == {"k8s.pod.name": "p-1", "team": "a,b"} and s.schedule_delay_ms == 200.0
    assert s.protocol == "http/protobuf" and s.endpoint == GRPC_URL + "/v1/traces"   # base URL: path appended


def test_the_protocol_follows_the_url_unless_named():
    assert setup_of("http://c:4318/v1/traces").protocol == "http/protobuf"
    s = setup_of("http://c:4318/v1/traces", OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="grpc",
                 OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")   # the traces variable wins over the general one
    assert s.protocol == "grpc"


@pytest.mark.parametrize("variable, value", [
    ("OTEL_TRACES_SAMPLER", "sometimes"),
    ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
    ("OTEL_TRACES_SAMPLER_ARG", "half"),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
    ("OTEL_RESOURCE_ATTRIBUTES", "team"),
    ("OTEL_BSP_SCHEDULE_DELAY", "-5"),
    ("OTEL_BSP_SCHEDULE_DELAY", "soon"),
])
def test_a_bad_value_is_refused_naming_its_variable(variable, value):
    environ = {variable: value}
    if variable == "OTEL_TRACES_SAMPLER_ARG":
        environ["OTEL_TRACES_SAMPLER"] = "traceidratio"
    with pytest.raises(ValueError, match=f"^{variable}: '{value}' is not "):
        Tracing.from_config(GRPC_URL, environ)


def test_no_endpoint_no_tracing_whatever_the_variables_say():
    environ = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": GRPC_URL, "OTEL_TRACES_SAMPLER": "sometimes"}
    assert Tracing.from_config(None, environ) is None and Tracing.from_config("", environ) is None

"""Server reflection answers under both protocol versions a client may ask for first: grpc.reflection.v1 (grpcurl,
buf curl and grpcui try it first) and grpc.reflection.v1alpha. Each test speaks the raw reflection protocol on the
version's own method path, as ``grpcurl list`` / ``grpcurl describe`` do."""
from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb

pytestmark = pytest.mark.e2e

SERVICES = {"pagedserve.v1.InferenceService", "grpc.health.v1.Health"}


def reflect(target: str, version: str, requests: list[rpb.ServerReflectionRequest]):
    """Send reflection requests on ``grpc.reflection.<version>.ServerReflection`` (the two versions share their
    message wire format, so the v1alpha message classes encode both)."""
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                     request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=rpb.ServerReflectionResponse.FromString)
        return list(call(iter(requests), timeout=30))


def files_of(response: rpb.ServerReflectionResponse) -> list[descriptor_pb2.FileDescriptorProto]:
    return [descriptor_pb2.FileDescriptorProto.FromString(b)
            for b in response.file_descriptor_response.file_descriptor_proto]


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_list_and_describe_resolve_both_services(server, version):
    listed, *described = reflect(server.target, version, [
        rpb.ServerReflectionRequest(list_services=""),
        *(rpb.ServerReflectionRequest(file_containing_symbol=name) for name in sorted(SERVICES))])
    names = {s.name for s in listed.list_services_response.service}
    assert SERVICES | {f"grpc.reflection.{v}.ServerReflection" for v in ("v1", "v1alpha")} <= names
    for name, response in zip(sorted(SERVICES), described):
        assert not response.HasField("error_response"), response.error_response
        package, _, service = name.rpartition(".")
        files = files_of(response)
        assert any(f.package == package and service in {s.name for s in f.service} for f in files), name


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_describe_a_message_and_an_unknown_symbol(server, version):
    found, missing = reflect(server.target, version, [
        rpb.ServerReflectionRequest(file_containing_symbol="pagedserve.v1.GenerateRequest"),
        rpb.ServerReflectionRequest(file_containing_symbol="no.such.Symbol")])
    assert any("GenerateRequest" in {m.name for m in f.message_type} for f in files_of(found))
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_the_v1_reflection_service_describes_itself(server):
    (response,) = reflect(server.target, "v1", [
        rpb.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection")])
    (proto,) = files_of(response)[:1]
    assert proto.package == "grpc.reflection.v1"
    method = proto.service[0].method[0]
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
